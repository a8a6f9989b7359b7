"""vgraph's Inductor FX passes: fusion passes and the pass manager that runs them.

Depends on torch and ``vgraph.ops`` only, so the passes can be used on any model::

    from vgraph.passes import PassManager, default_passes
    manager = PassManager(default_passes())
    with torch._inductor.config.patch(post_grad_custom_post_pass=manager):
        torch.compile(model)(*inputs)
    print(manager.match_counts())
"""
from __future__ import annotations

from .base import CallablePass, VgraphPass, as_pass
from .manager import PassManager, default_passes
from .rms_norm_quant import RMSNormQuantFusionPass
from .silu_mul import SiluMulFusionPass

__all__ = ["PassManager", "default_passes", "VgraphPass", "CallablePass", "as_pass",
           "RMSNormQuantFusionPass", "SiluMulFusionPass"]
