"""vgraph's Inductor FX passes: fusion passes and the pass manager that runs them.

Depends on torch and ``vgraph.ops`` only, so the passes can be used on any model::

    from vgraph.passes import PassManager, default_passes
    manager = PassManager(default_passes())
    with torch._inductor.config.patch(post_grad_custom_post_pass=manager):
        torch.compile(model)(*inputs)
    print(manager.match_counts())

``vgraph.passes.report(model, passes=[...])`` compiles a vgraph model without and with passes
and writes what they did (matches, graph diffs, numerics, step times, Inductor's kernels); it
lives in the runtime (``vgraph.lab``) and is imported on first use, so importing this package
never imports the runtime.
"""
from __future__ import annotations

from typing import Any

from .all_reduce_norm import AllReduceRMSNormFusionPass
from .base import CallablePass, VgraphPass, as_pass
from .loading import PassSpecError, PlacedPass, arrange, load_pass, position_of
from .manager import GraphRecord, PassManager, PassStep, default_passes
from .norm_linear import NormLinearFusionPass
from .rms_norm_quant import RMSNormQuantFusionPass
from .silu_mul import SiluMulFusionPass

__all__ = ["PassManager", "default_passes", "VgraphPass", "CallablePass", "as_pass",
           "RMSNormQuantFusionPass", "SiluMulFusionPass", "AllReduceRMSNormFusionPass", "NormLinearFusionPass", "GraphRecord", "PassStep",
           "PlacedPass", "PassSpecError", "load_pass", "position_of", "arrange", "report"]


def __getattr__(name: str) -> Any:
    """``report`` is the runtime's (vgraph.lab.report): imported on first use only."""
    if name == "report":
        from vgraph.lab import report
        return report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
