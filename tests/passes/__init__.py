"""Helpers shared by the pass tests.

Most tests run a pass on the graph Inductor's post-grad passes would see, obtained in
milliseconds with ``make_fx`` and Inductor's own decomposition table (the same aten ops,
the same custom-op calls and ``getitem`` reads as under ``torch.compile``), then run the
rewritten graph eagerly and compare it with the unfused function. ``test_inductor.py``
checks the same passes inside real ``torch.compile`` runs.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import vgraph.ops  # noqa: F401
from tests.ops.tolerances import assert_fp8_within_one_step

V = torch.ops.vgraph
FP8 = torch.float8_e4m3fn
EPS = 1e-6


def trace(fn: Callable, *inputs: torch.Tensor, symbolic: bool = False) -> torch.fx.GraphModule:
    """``fn`` as a post-grad-style aten graph (Inductor's decompositions applied)."""
    mode = "symbolic" if symbolic else "fake"
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode=mode)(*inputs)


def apply(p: Callable[[torch.fx.Graph], Any], gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Runs a pass (or manager) on ``gm``'s graph and makes ``gm`` executable again."""
    p(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def op_counts(graph: torch.fx.Graph) -> Counter:
    """How often each call target occurs, e.g. ``counts[V.rms_norm.default]``."""
    return Counter(node.target for node in graph.nodes if node.op == "call_function")


def flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for item in out for t in flat(item)]


def assert_outputs_match(out: Any, ref: Any) -> None:
    """fp8 within one fp8 step; everything else to 1e-6 (fp32) or bf16's tolerance."""
    outs, refs = flat(out), flat(ref)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype and o.shape == r.shape
        if r.dtype == FP8:
            assert_fp8_within_one_step(o, r)
        else:
            tol = 1e-6 if r.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(o, r, rtol=tol, atol=tol)


def check_pass(p: Callable, fn: Callable, *inputs: torch.Tensor) -> Counter:
    """Traces ``fn``, applies ``p``, checks numerics against eager ``fn``; returns op counts."""
    gm = apply(p, trace(fn, *inputs))
    assert_outputs_match(gm(*inputs), fn(*inputs))
    return op_counts(gm.graph)


def scale(value: float = 0.05) -> torch.Tensor:
    """A static fp8 scale: one-element fp32."""
    return torch.tensor([value], dtype=torch.float32)


class GraphRecorder:
    """A user pass that changes nothing and keeps the op counts of the graph it last saw;
    appended to a manager, it shows the graph as vgraph's passes left it."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.calls = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.counts = op_counts(graph)
        self.calls += 1

    def uuid(self) -> str:
        return "tests.passes.GraphRecorder/1"
