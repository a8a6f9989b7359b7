"""SiLU-and-mul fusion: the SwiGLU activation as one op, then fused with its fp8 quant.

Stage 1 finds ``silu(x[..., :d]) * x[..., d:]`` written in plain torch (d = half of x's last
dim) and replaces it with ``vgraph::silu_and_mul(x)``. By the time this pass sees it,
Inductor's decompositions have rewritten ``silu``; in torch 2.13 the post-grad graph holds::

    fp32:  mul(div(g, add(exp(neg(g)), 1)), u)
    bf16:  mul(convert(div(g', add(exp(neg(g')), 1)), bf16), u)   with g' = convert(g, fp32)

where g and u are the two halves of x: ``aten.slice`` on the last dim, or the two outputs of
a ``split``/``chunk``. The matcher also accepts ``aten.silu`` itself and ``a * sigmoid(a)``,
the spellings other torch versions use. Halves are checked with the fake tensors' sizes,
so a cut anywhere but the middle, or on another dim, does not match.

Stage 2 turns ``static_scaled_fp8_quant(silu_and_mul(x), s)`` into
``silu_and_mul_static_fp8_quant(x, s)``; it runs after stage 1, so plain torch followed by a
quant ends as the fully fused op.

Every intermediate of a pattern must be used only inside it (otherwise it would have to be
computed anyway); the halves of x may have other users and then stay in the graph.
"""
from __future__ import annotations

import operator
from collections import Counter
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph)

from .base import VgraphPass
from .fx_utils import (copy_meta, dtype_of, erase_dead, is_call, is_last_dim, known_at_least,
                       known_equal, op_args, op_name, only_user, replace_single, users_within, value)

aten, prims, _vg = torch.ops.aten, torch.ops.prims, torch.ops.vgraph
SILU_AND_MUL = _vg.silu_and_mul.default
STATIC_QUANT = _vg.static_scaled_fp8_quant.default
SILU_AND_MUL_STATIC = _vg.silu_and_mul_static_fp8_quant.default
CONVERT = prims.convert_element_type.default
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
ADDS = (aten.add.Tensor, aten.add.Scalar)


class SiluMulFusionPass(VgraphPass):
    """Plain-torch SiLU-and-mul -> ``silu_and_mul``; ``silu_and_mul`` + static quant -> fused.

    ``plain_torch`` / ``quant`` switch the two stages.
    """

    def __init__(self, plain_torch: bool = True, quant: bool = True) -> None:
        self.plain_torch = plain_torch
        self.quant = quant

    def config(self) -> dict[str, Any]:
        return {"plain_torch": self.plain_torch, "quant": self.quant}

    def apply(self, graph: Graph) -> Counter:
        counts: Counter = Counter()
        if self.plain_torch:
            counts[op_name(SILU_AND_MUL)] = _fuse_plain_silu_mul(graph)
        if self.quant:
            counts[op_name(SILU_AND_MUL_STATIC)] = _fuse_silu_mul_quant(graph)
        return counts


# ---------------------------------------------------------------- stage 1: plain torch


def _fuse_plain_silu_mul(graph: Graph) -> int:
    matches = 0
    erased: set[Node] = set()
    for mul in [node for node in graph.nodes if is_call(node, aten.mul.Tensor)]:
        if mul in erased:  # an a * sigmoid(a) inside an earlier match
            continue
        match = _match_silu_mul(mul)
        if match is None:
            continue
        x, pattern_nodes = match
        with graph.inserting_before(mul):
            fused = graph.call_function(SILU_AND_MUL, (x,))
        copy_meta(mul, fused)
        mul.replace_all_uses_with(fused)
        erased |= erase_dead(graph, pattern_nodes)
        matches += 1
    return matches


def _match_silu_mul(mul: Node) -> Optional[tuple[Node, list[Node]]]:
    """(x, the pattern's nodes) if ``mul`` computes ``silu(x[..., :d]) * x[..., d:]``."""
    lhs, rhs = mul.args[0], mul.args[1]
    for act, up in ((lhs, rhs), (rhs, lhs)):
        silu = _match_silu(act)
        if silu is None:
            continue
        gate, silu_nodes = silu
        gate_half, up_half = _half_of(gate), _half_of(up)
        if gate_half is None or up_half is None:
            continue
        x = gate_half[0]
        if (up_half[0] is not x or gate_half[1] != 0 or up_half[1] != 1
                or dtype_of(mul) != dtype_of(x)
                or not users_within(silu_nodes, [*silu_nodes, mul])):
            continue
        cleanup = [mul, *silu_nodes, gate, up]
        cleanup += [n.args[0] for n in (gate, up) if is_call(n, operator.getitem)]  # the split
        return x, cleanup
    return None


def _match_silu(node: Any) -> Optional[tuple[Node, list[Node]]]:
    """(a, the nodes computing it) if ``node`` is ``silu(a)`` in ``a``'s own dtype.

    Low-precision inputs are upcast to fp32 around the computation and cast back; the casts
    are part of the pattern. A silu whose result stays in fp32 for a bf16 input is not what
    ``silu_and_mul`` computes, so it does not match.
    """
    if not isinstance(node, Node):
        return None
    downcast = is_call(node, CONVERT)
    core = _match_silu_core(node.args[0] if downcast else node)
    if core is None:
        return None
    a, nodes = core
    if downcast:  # the upcast must be to fp32, the precision silu_and_mul computes in
        if not is_call(a, CONVERT) or dtype_of(a) != torch.float32:
            return None
        nodes = [node, *nodes, a]
        a = a.args[0]
    if not isinstance(a, Node) or dtype_of(a) != dtype_of(node):
        return None
    return a, nodes


def _match_silu_core(node: Any) -> Optional[tuple[Node, list[Node]]]:
    """(a, nodes) for ``silu(a)``, ``a / (1 + exp(-a))`` or ``a * sigmoid(a)``."""
    if is_call(node, aten.silu.default):
        return node.args[0], [node]
    if is_call(node, aten.div.Tensor):
        a, denominator = node.args[0], node.args[1]
        exp = _one_plus(denominator)
        if is_call(exp, aten.exp.default) and is_call(exp.args[0], aten.neg.default) \
                and exp.args[0].args[0] is a:
            return a, [node, denominator, exp, exp.args[0]]
    if is_call(node, aten.mul.Tensor):
        for a, sig in (node.args, reversed(node.args)):
            if is_call(sig, aten.sigmoid.default) and sig.args[0] is a:
                return a, [node, sig]
    return None


def _one_plus(node: Any) -> Optional[Node]:
    """t if ``node`` is ``t + 1`` or ``1 + t`` (alpha 1), else None."""
    if not is_call(node, *ADDS) or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args[0], node.args[1]
    if isinstance(a, Node) and not isinstance(b, Node) and b == 1:
        return a
    if isinstance(b, Node) and not isinstance(a, Node) and a == 1:
        return b
    return None


def _half_of(node: Any) -> Optional[tuple[Node, int]]:
    """(x, 0) if ``node`` is the first half of x's last dim, (x, 1) the second, else None."""
    if is_call(node, aten.slice.Tensor):
        return _slice_half(node)
    if is_call(node, operator.getitem) and is_call(node.args[0], *SPLITS):
        return _split_half(node.args[0], node.args[1])
    return None


def _last_dim_size(x: Any, dim: Any) -> Any:
    """x's last-dim size (int or SymInt) if ``dim`` is x's last dim, else None."""
    val = value(x)
    if not isinstance(val, torch.Tensor) or not is_last_dim(dim, val.dim()):
        return None
    return val.shape[-1]


def _slice_half(node: Node) -> Optional[tuple[Node, int]]:
    args = op_args(node)
    x, size = args["self"], _last_dim_size(args["self"], args["dim"])
    if size is None or args["step"] != 1:
        return None
    start = value(args["start"]) if args["start"] is not None else 0
    end = value(args["end"])
    if known_equal(start, 0) and end is not None and known_equal(2 * end, size):
        return x, 0
    if known_equal(2 * start, size) and (end is None or known_at_least(end, size)):
        return x, 1
    return None


def _split_half(split: Node, index: Any) -> Optional[tuple[Node, int]]:
    args = op_args(split)
    x, size = args["self"], _last_dim_size(args["self"], args["dim"])
    if size is None or index not in (0, 1):
        return None
    if split.target is aten.split.Tensor:
        halves = known_equal(2 * value(args["split_size"]), size)
    else:
        sizes = [value(s) for s in args["split_sizes"]]
        halves = len(sizes) == 2 and known_equal(sizes[0], sizes[1]) \
            and known_equal(2 * sizes[0], size)
    return (x, index) if halves else None


# ---------------------------------------------------------------- stage 2: + static quant


def _fuse_silu_mul_quant(graph: Graph) -> int:
    matches = 0
    for quant in [node for node in graph.nodes if is_call(node, STATIC_QUANT)]:
        args = op_args(quant)
        act = args["x"]
        if not is_call(act, SILU_AND_MUL) or only_user(act) is not quant:
            continue
        replace_single(graph, act, quant, SILU_AND_MUL_STATIC, (op_args(act)["x"], args["scale"]))
        matches += 1
    return matches
