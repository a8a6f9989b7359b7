"""RMSNorm + projection fusion: the norm runs inside the projection's one-row GEMV.

Patterns, as they appear in the post-grad graph of a 16-bit model on CUDA, whose projections
are ``vgraph::linear`` (and ``vgraph::linear_silu_and_mul`` for an MLP's gate_up)::

    linear(rms_norm(x, w, eps), W, b)                  => rms_norm_linear(x, w, eps, W, b, False)
    linear_silu_and_mul(rms_norm(x, w, eps), W, b)     => rms_norm_linear(x, w, eps, W, b, True)
    linear(fused_add_rms_norm(x, r, w, eps)[0], W, b)  => fused_add_rms_norm_linear(x, r, w, eps, W, b, False)[0]
        (and [1], the new residual, keeps its readers; the same with linear_silu_and_mul)

In a Llama-shaped decoder layer these are the input norm before the qkv projection and the
post-attention norm before gate_up: two of the ~11 kernels of a batch-1 decode step's layer.
The fused ops are the two ops in turn wherever the projection does not take the GEMV kernel
(ops/dense_linear.py). Where it does, the kernel rounds as the norm kernel does but adds the
row's squares in another order, so a result can move in its last bit, as any change of the
GEMV's summation order would.

Why it is a default pass for narrow rows only: the fused kernel has every program normalize
the whole row itself (ops/kernels/gemv.py), which trades a launch for re-reads of the row from
L2. On an H200 (``python -m perf.decode_kernels_ab --rows 1,2 --chosen --norm``,
perf/results/decode-kernels-cuda-norm.json) that lost on the 8B shape's 4096-wide rows (qkv
0.78x, gate_up 0.92x) and won on the 0.5B's 896 (qkv 1.29x at one row, 1.12x at two; gate_up
1.06x). Where between them it stops paying was not measured, so the default pass fuses rows
of at most ``NARROW_ROWS`` (1024) elements, the side that was measured to win;
``NormLinearFusionPass()`` without a limit fuses any width (``--pass
vgraph.passes.norm_linear:NormLinearFusionPass``).

The norm's output must have the projection as its only user, as its ``x`` argument: with a
LoRA adapter on the projection, or anything else reading the normed row, the norm has to
run anyway.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph)

from .base import VgraphPass
from .fx_utils import (fused_insertion_point, is_call, node_order, only_user, op_args, op_name, pair_reads,
                       replace_pair, replace_single)

_vg = torch.ops.vgraph
RMS_NORM = _vg.rms_norm.default
FUSED_ADD_RMS_NORM = _vg.fused_add_rms_norm.default
PROJECTIONS = {_vg.linear.default: False, _vg.linear_silu_and_mul.default: True}  # op -> silu_mul
RMS_NORM_LINEAR = _vg.rms_norm_linear.default
FUSED_ADD_RMS_NORM_LINEAR = _vg.fused_add_rms_norm_linear.default


NARROW_ROWS = 1024  # the default pass's widest row (module doc)


class NormLinearFusionPass(VgraphPass):
    """Fuses ``rms_norm`` / ``fused_add_rms_norm`` into the projection that alone reads their
    output (module doc); ``max_width``: only rows of at most that many elements (None: any)."""

    def __init__(self, max_width: Optional[int] = None) -> None:
        self.max_width = max_width

    def config(self) -> dict[str, Any]:
        return {"max_width": self.max_width}

    def apply(self, graph: Graph) -> Counter:
        order = node_order(graph)
        counts: Counter = Counter()
        # Each match owns a distinct norm (the projection is its only user), so rewriting one
        # never touches another candidate; positions of the remaining nodes stay ordered.
        for projection in [node for node in graph.nodes if is_call(node, *PROJECTIONS)]:
            fused = self._fuse(graph, projection, order)
            if fused is not None:
                counts[fused] += 1
        return counts

    def _fuse(self, graph: Graph, projection: Node, order: dict[Node, int]) -> Optional[str]:
        args = op_args(projection)
        src, weight, bias = args["x"], args["weight"], args["bias"]
        # One user counts once however many of its arguments it takes: the normed row must
        # be the projection's input only, not its weight or bias too.
        if only_user(src) is not projection or src is weight or src is bias:
            return None
        if self.max_width is not None and not _at_most(src, self.max_width):
            return None
        tail = (weight, bias, PROJECTIONS[projection.target])  # the fused op's last arguments
        if is_call(src, RMS_NORM):
            norm_args = op_args(src)
            replace_single(graph, src, projection, RMS_NORM_LINEAR,
                           (norm_args["x"], norm_args["weight"], norm_args["eps"], *tail))
            return op_name(RMS_NORM_LINEAR)
        return _fuse_add_rms_norm(graph, src, projection, tail, order)


def _fuse_add_rms_norm(graph: Graph, normed: Node, projection: Node, tail: tuple,
                       order: dict[Node, int]) -> Optional[str]:
    """``proj(fused_add_rms_norm(x, r, w, eps)[0])``, the new residual read by anyone; ``tail``:
    the projection's weight, bias and whether it is the SwiGLU one."""
    found = pair_reads(normed, FUSED_ADD_RMS_NORM)
    if found is None:
        return None
    norm, residual_reads = found
    where = fused_insertion_point(norm, projection, tail[:2], residual_reads, order)
    if where is None:
        return None
    norm_args = op_args(norm)
    replace_pair(graph, normed, projection, FUSED_ADD_RMS_NORM_LINEAR,
                 (norm_args["x"], norm_args["residual"], norm_args["weight"], norm_args["eps"], *tail),
                 residual_reads, where)
    return op_name(FUSED_ADD_RMS_NORM_LINEAR)


def _at_most(row: Node, width: int) -> bool:
    """Whether the normed row's last dimension is known (its fake value) and at most ``width``."""
    value = row.meta.get("val")
    last = value.shape[-1] if isinstance(value, torch.Tensor) and value.dim() else None
    return isinstance(last, int) and last <= width
