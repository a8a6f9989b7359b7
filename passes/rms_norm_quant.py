"""RMSNorm + fp8 quant fusion: one kernel instead of a norm that writes its output and a
quant that reads it back.

Patterns, as they appear in Inductor's post-grad graph (functional custom ops are direct
``call_function`` nodes; a tuple result is read through ``operator.getitem``)::

    rms_norm(x, w, eps) -> static_scaled_fp8_quant(., s)
        => rms_norm_static_fp8_quant(x, w, s, eps)
    rms_norm(x, w, eps) -> dynamic_per_token_scaled_fp8_quant(.)
        => rms_norm_dynamic_per_token_fp8_quant(x, w, eps)
    fused_add_rms_norm(x, r, w, eps)[0] -> static_scaled_fp8_quant(., s)
        => fused_add_rms_norm_static_fp8_quant(x, r, w, s, eps)   (residual' keeps its users)

The norm output must have the quant as its only user: if anything else reads the
unquantized output the norm has to run anyway, and fusing would gain nothing. There is no
fused op for ``fused_add_rms_norm`` followed by a *dynamic* quant, so that sequence is left
alone.
"""
from __future__ import annotations

import operator
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
STATIC_QUANT = _vg.static_scaled_fp8_quant.default
DYNAMIC_QUANT = _vg.dynamic_per_token_scaled_fp8_quant.default
RMS_NORM_STATIC = _vg.rms_norm_static_fp8_quant.default
RMS_NORM_DYNAMIC = _vg.rms_norm_dynamic_per_token_fp8_quant.default
FUSED_ADD_RMS_NORM_STATIC = _vg.fused_add_rms_norm_static_fp8_quant.default


class RMSNormQuantFusionPass(VgraphPass):
    """Fuses ``rms_norm`` / ``fused_add_rms_norm`` with the fp8 quant of their output.

    ``static`` / ``dynamic`` switch the static-scale and dynamic per-token patterns, so an
    experiment can measure each on its own.
    """

    def __init__(self, static: bool = True, dynamic: bool = True) -> None:
        self.static = static
        self.dynamic = dynamic

    def config(self) -> dict[str, Any]:
        return {"static": self.static, "dynamic": self.dynamic}

    def apply(self, graph: Graph) -> Counter:
        targets = [op for op, on in ((STATIC_QUANT, self.static), (DYNAMIC_QUANT, self.dynamic))
                   if on]
        quants = [node for node in graph.nodes if is_call(node, *targets)]
        order = node_order(graph)
        counts: Counter = Counter()
        # Each match owns a distinct norm (the quant is its only user), so rewriting one
        # never touches another candidate.
        for quant in quants:
            fused = self._fuse(graph, quant, order)
            if fused is not None:
                counts[fused] += 1
        return counts

    def _fuse(self, graph: Graph, quant: Node, order: dict[Node, int]) -> Optional[str]:
        """Rewrites the norm feeding ``quant`` if it matches; returns the pattern's name."""
        src = op_args(quant)["x"]
        if is_call(src, RMS_NORM) and only_user(src) is quant:
            return _fuse_rms_norm(graph, src, quant)
        if quant.target is STATIC_QUANT and is_call(src, operator.getitem):
            return _fuse_add_rms_norm_static(graph, src, quant, order)
        return None


def _fuse_rms_norm(graph: Graph, norm: Node, quant: Node) -> str:
    """``quant(rms_norm(x, w, eps))`` -> one fused op with the same outputs as ``quant``."""
    norm_args = op_args(norm)
    if quant.target is STATIC_QUANT:
        target = RMS_NORM_STATIC
        args = (norm_args["x"], norm_args["weight"], op_args(quant)["scale"], norm_args["eps"])
    else:  # the dynamic fused op returns (q, scales) like the quant it replaces
        target = RMS_NORM_DYNAMIC
        args = (norm_args["x"], norm_args["weight"], norm_args["eps"])
    replace_single(graph, norm, quant, target, args)
    return op_name(target)


def _fuse_add_rms_norm_static(graph: Graph, normed: Node, quant: Node,
                              order: dict[Node, int]) -> Optional[str]:
    """``static_quant(fused_add_rms_norm(x, r, w, eps)[0])``, residual' read by anyone."""
    found = pair_reads(normed, FUSED_ADD_RMS_NORM)
    if found is None or only_user(normed) is not quant:
        return None
    norm, residual_reads = found
    norm_args, scale = op_args(norm), op_args(quant)["scale"]
    where = fused_insertion_point(norm, quant, [scale], residual_reads, order)
    if where is None:
        return None
    replace_pair(graph, normed, quant, FUSED_ADD_RMS_NORM_STATIC, (
        norm_args["x"], norm_args["residual"], norm_args["weight"], scale, norm_args["eps"]), residual_reads, where)
    return op_name(FUSED_ADD_RMS_NORM_STATIC)
