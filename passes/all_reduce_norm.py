"""All-reduce + residual add + RMSNorm fusion, for tensor-parallel models.

A row-parallel projection's partial sums are all-reduced, then the decoder adds the residual
and normalizes. Traced through torch.distributed's functional collectives, the post-grad graph
holds (``group`` is the process group's name, a string)::

    ar = _c10d_functional.wait_tensor(_c10d_functional.all_reduce(x, "sum", group))

    fused_add_rms_norm(ar, r, w, eps)                 (custom ops)
        => all_reduce_fused_add_rms_norm(x, r, w, eps, group)
    fused_add_rms_norm_static_fp8_quant(ar, r, w, s, eps)   (after RMSNormQuantFusionPass)
        => all_reduce_fused_add_rms_norm_static_fp8_quant(x, r, w, s, eps, group)
    h = ar + r;  w * (h * rsqrt(mean(h**2, -1, keepdim) + eps))   (plain torch, ``plain_torch``)
        => all_reduce_fused_add_rms_norm(x, r, w, eps, group)

In plain torch, Inductor's decompositions leave ``add, pow(., 2), mean(., [-1], True),
add(., eps), rsqrt, mul, mul(weight, .)``, with ``convert_element_type`` to fp32 and back
around the statistics for a 16-bit activation; the matcher reads that chain (operands of a
mul in either order). The residual sum may have any other readers (the next layer's
residual); every other intermediate must be read only inside the pattern.

Conditions for every pattern: a sum all-reduce whose waited result is read by nothing but the
norm (an all-reduce also read elsewhere has to materialize anyway, e.g. the vocab-parallel
embedding's, which is both the first norm's input and the first residual). The group name is
copied from the matched all-reduce, never a rank: the rewritten graph is the same on every
rank. The fused op goes where the add (or norm) was, the point where every input exists.
"""
from __future__ import annotations

import operator
from collections import Counter
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph)

from .base import VgraphPass
from .fx_utils import (copy_meta, defined_before, dtype_of, is_call, is_last_dim, known_equal,
                       node_order, only_user, op_args, op_name, users_within, value)

_vg = torch.ops.vgraph
_aten = torch.ops.aten
_prims = torch.ops.prims
# A torch built without distributed support has no functional collectives: nothing to match.
_DISTRIBUTED = torch.distributed.is_available()
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default if _DISTRIBUTED else None
WAIT = torch.ops._c10d_functional.wait_tensor.default if _DISTRIBUTED else None
FUSED_ADD_RMS_NORM = _vg.fused_add_rms_norm.default
FUSED_ADD_RMS_NORM_STATIC = _vg.fused_add_rms_norm_static_fp8_quant.default
AR_FUSED_ADD_RMS_NORM = _vg.all_reduce_fused_add_rms_norm.default
AR_FUSED_ADD_RMS_NORM_STATIC = _vg.all_reduce_fused_add_rms_norm_static_fp8_quant.default
CONVERT = _prims.convert_element_type.default
ADD, MUL = _aten.add.Tensor, _aten.mul.Tensor

# The custom norm ops and the fused op replacing each; both return (normed, residual').
_FUSED_FOR = {FUSED_ADD_RMS_NORM: AR_FUSED_ADD_RMS_NORM,
              FUSED_ADD_RMS_NORM_STATIC: AR_FUSED_ADD_RMS_NORM_STATIC}


class AllReduceRMSNormFusionPass(VgraphPass):
    """Fuses a sum all-reduce with the residual add and RMSNorm that read it.

    ``plain_torch=False`` leaves the plain-torch norm to Inductor (only the custom-op forms
    fuse), as ``SiluMulFusionPass(plain_torch=False)`` does for a model built without custom ops.
    """

    def __init__(self, plain_torch: bool = True) -> None:
        self.plain_torch = plain_torch

    def config(self) -> dict[str, Any]:
        return {"plain_torch": self.plain_torch}

    def apply(self, graph: Graph) -> Counter:
        counts: Counter = Counter()
        if not _DISTRIBUTED:
            return counts
        waits = [node for node in graph.nodes if is_call(node, WAIT)]
        # Each match consumes its own all-reduce and norm, so rewriting one leaves the other
        # candidates' nodes intact.
        for wait in waits:
            reduced = _sum_all_reduce(wait)
            reader = only_user(wait)
            if reduced is None or reader is None:
                continue
            if is_call(reader, *_FUSED_FOR):
                fused = _fuse_norm_op(graph, reduced, wait, reader)
            elif self.plain_torch and is_call(reader, ADD):
                fused = _fuse_plain(graph, reduced, wait, reader)
            else:
                fused = None
            if fused is not None:
                counts[fused] += 1
        return counts


def _sum_all_reduce(wait: Node) -> Optional[Node]:
    """The ``all_reduce(x, "sum", group)`` this wait completes, if read by nothing else."""
    reduced = op_args(wait)["tensor"]
    if not is_call(reduced, ALL_REDUCE) or only_user(reduced) is not wait:
        return None
    return reduced if op_args(reduced)["reduce_op"] == "sum" else None


def _fuse_norm_op(graph: Graph, reduced: Node, wait: Node, norm: Node) -> Optional[str]:
    """``fused_add_rms_norm[_static_fp8_quant](ar, r, ...)``, ``ar`` as x or as the residual
    (the add is commutative); the norm's getitem reads move to the fused op as they are."""
    args = op_args(norm)
    if args["x"] is wait and args["residual"] is not wait:
        residual = args["residual"]
    elif args["residual"] is wait and args["x"] is not wait:
        residual = args["x"]
    else:
        return None
    reduce_args = op_args(reduced)
    target = _FUSED_FOR[norm.target]
    if target is AR_FUSED_ADD_RMS_NORM:
        new_args = (reduce_args["input"], residual, args["weight"], args["eps"], reduce_args["group_name"])
    else:
        new_args = (reduce_args["input"], residual, args["weight"], args["scale"], args["eps"],
                    reduce_args["group_name"])
    with graph.inserting_before(norm):
        fused = graph.call_function(target, new_args)
    copy_meta(norm, fused)
    norm.replace_all_uses_with(fused)
    for node in (norm, wait, reduced):
        graph.erase_node(node)
    return op_name(target)


def _fuse_plain(graph: Graph, reduced: Node, wait: Node, add: Node) -> Optional[str]:
    """``h = ar + r`` then the decomposed RMSNorm of ``h``; ``h`` keeps its other readers."""
    residual = _other_operand(add, wait)
    if residual is None or not _same_shape_and_dtype(add, wait, residual):
        return None
    norm = _plain_rms_norm(add)
    if norm is None:
        return None
    out, weight, eps, inner = norm
    if not defined_before(weight, add, node_order(graph)):  # the graph as rewritten so far
        return None
    reduce_args = op_args(reduced)
    with graph.inserting_before(add):
        fused = graph.call_function(AR_FUSED_ADD_RMS_NORM, (
            reduce_args["input"], residual, weight, eps, reduce_args["group_name"]))
        normed = graph.call_function(operator.getitem, (fused, 0))
        new_residual = graph.call_function(operator.getitem, (fused, 1))
    if "val" in out.meta and "val" in add.meta:
        fused.meta["val"] = (out.meta["val"], add.meta["val"])
    copy_meta(out, normed)
    copy_meta(add, new_residual)
    out.replace_all_uses_with(normed)
    for node in reversed(inner):  # users first: out, ..., the first statistic
        graph.erase_node(node)
    add.replace_all_uses_with(new_residual)
    for node in (add, wait, reduced):
        graph.erase_node(node)
    if not new_residual.users:  # the final norm: nothing reads the last residual
        graph.erase_node(new_residual)
    return op_name(AR_FUSED_ADD_RMS_NORM)


def _other_operand(node: Node, operand: Node) -> Optional[Node]:
    """The other tensor operand of a binary op that reads ``operand`` exactly once."""
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    if a is operand and isinstance(b, Node) and b is not operand:
        return b
    if b is operand and isinstance(a, Node):
        return a
    return None


def _same_shape_and_dtype(add: Node, *operands: Node) -> bool:
    """No broadcast, no promotion: the add's operands and result agree in size and dtype."""
    out = value(add)
    if not isinstance(out, torch.Tensor):
        return False
    for operand in operands:
        val = value(operand)
        if (not isinstance(val, torch.Tensor) or val.dtype != out.dtype or val.dim() != out.dim()
                or not all(known_equal(a, b) for a, b in zip(val.shape, out.shape))):
            return False
    return True


def _plain_rms_norm(h: Node) -> Optional[tuple[Node, Any, float, list[Node]]]:
    """Reads ``w * to(h.float() * rsqrt(mean(h.float()**2, -1, keepdim) + eps), h.dtype)`` off
    ``h``'s readers; returns (output node, weight, eps, the pattern's nodes in graph order)."""
    dtype = dtype_of(h)
    hf = _single_user_convert(h, torch.float32) if dtype != torch.float32 else h
    if hf is None:
        return None
    power = next((u for u in hf.users if is_call(u, _aten.pow.Tensor_Scalar) and u.args[0] is hf
                  and u.args[1] == 2), None)
    mean = power is not None and only_user(power)
    if not (is_call(mean, _aten.mean.dim) and _last_dim_keepdim(mean)):
        return None
    add_eps = only_user(mean)
    if not (is_call(add_eps, ADD) and add_eps.args[0] is mean and isinstance(add_eps.args[1], float)):
        return None
    rsqrt = only_user(add_eps)
    if not is_call(rsqrt, _aten.rsqrt.default):
        return None
    scaled = only_user(rsqrt)
    if not (is_call(scaled, MUL) and _other_operand(scaled, rsqrt) is hf):
        return None
    back = _single_user_convert(scaled, dtype) if dtype != torch.float32 else scaled
    out = back is not None and only_user(back)
    if not is_call(out, MUL):
        return None
    weight = _other_operand(out, back)
    if weight is None or dtype_of(out) != dtype or not _is_norm_weight(weight, h):
        return None
    inner = [n for n in (hf, power, mean, add_eps, rsqrt, scaled, back, out) if n is not h]
    inner = list(dict.fromkeys(inner))
    readers_of_h = {power, scaled} if hf is h else {hf}
    if not users_within(inner[:-1], inner) or not readers_of_h <= set(h.users):
        return None
    return out, weight, add_eps.args[1], inner


def _single_user_convert(node: Node, dtype: torch.dtype) -> Optional[Node]:
    """The one ``convert_element_type(node, dtype)`` among ``node``'s readers, if any."""
    converts = [u for u in node.users if is_call(u, CONVERT) and u.args[1] == dtype]
    return converts[0] if len(converts) == 1 else None


def _last_dim_keepdim(mean: Node) -> bool:
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    ndim = value(mean.args[0]).dim()
    return keepdim is True and isinstance(dims, (list, tuple)) and len(dims) == 1 \
        and is_last_dim(dims[0], ndim)


def _is_norm_weight(weight: Node, h: Node) -> bool:
    """A 1-D weight over ``h``'s last dim (anything else is not an RMSNorm's scale)."""
    w, hv = value(weight), value(h)
    return isinstance(w, torch.Tensor) and w.dim() == 1 and known_equal(w.shape[0], hv.shape[-1])
