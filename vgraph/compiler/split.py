"""Splitting the captured graph at the splitting ops (attention by default).

Each splitting-op call becomes a piece of its own and the runs of nodes between them become
the pieces Inductor compiles, so an L-layer model gives 2L + 1 pieces, L + 1 compiled.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.passes.split_module import split_module


def op_name(target: object) -> str:
    """``namespace::name`` for an op overload or packet, else ''."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return ""


def _is_splitting(node: torch.fx.Node, splitting_ops: set[str]) -> bool:
    return node.op == "call_function" and op_name(node.target) in splitting_ops


@dataclass
class Piece:
    name: str  # attribute of the split module, e.g. "submod_3"
    is_splitting_op: bool
    module: torch.fx.GraphModule


def split_graph(gm: torch.fx.GraphModule, splitting_ops: list[str]) -> tuple[torch.fx.GraphModule, list[Piece]]:
    ops = set(splitting_ops)
    partition, assignment = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if _is_splitting(node, ops):
            partition += 1
            assignment[node] = partition
            partition += 1
        else:
            assignment[node] = partition
    split = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)
    pieces = []
    for node in split.graph.nodes:
        if node.op == "call_module":
            module = getattr(split, node.target)
            pieces.append(Piece(node.target, any(_is_splitting(n, ops) for n in module.graph.nodes), module))
    return split, pieces


COLLECTIVE_NAMESPACE = "_c10d_functional"


def count_collectives(module: torch.fx.GraphModule) -> int:
    """Functional collectives issued in ``module`` (``wait_tensor`` is their completion, not one)."""
    return sum(1 for n in module.graph.nodes if n.op == "call_function"
               and op_name(n.target).startswith(COLLECTIVE_NAMESPACE + "::")
               and not op_name(n.target).endswith("::wait_tensor"))
