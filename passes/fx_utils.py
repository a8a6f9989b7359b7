"""Helpers for reading and rewriting Inductor's post-grad FX graphs: for pass authors.

vgraph's fusion passes walk the graph directly instead of using Inductor's pattern matcher:
the patterns are short chains of custom ops, and a walk states every condition of a match
(who else uses an intermediate, which dim a slice cuts, where the new node goes) in plain
code that a reader can check. A user pass can do the same with these helpers.

What a pass sees: Inductor calls it on the *post-grad* graph of one compiled piece, after
functionalization and Inductor's decompositions. Custom ops are ``call_function`` nodes whose
target is an ``OpOverload`` (``torch.ops.vgraph.rms_norm.default``); a tuple result is read
through ``operator.getitem`` nodes; every node carries its fake value in ``node.meta["val"]``,
whose sizes may be SymInts (the token dimension is dynamic). ``vgraph passes report`` or a
``dump_graphs_dir`` shows these graphs as Python.

The rules a rewrite follows (each helper below serves one of them):

- match on what a node computes, not how it was spelled: ``is_call`` for the target,
  ``op_args`` to read arguments by schema name whatever their positional/keyword spelling;
- only fuse what nothing else reads: ``only_user``, ``users_within``, ``getitem_users``
  (if an intermediate has another reader, it must be computed anyway);
- decide shapes without guards: ``known_equal`` / ``known_at_least`` answer "provably",
  so a symbolic size never adds a recompile condition;
- insert where every input exists: ``node_order``, ``defined_before``, ``fused_insertion_point``;
- replace a producer and its consumer by one op: ``replace_single``; a consumer of a two-output
  op's first output: ``pair_reads``, ``replace_pair``;
- give the new node the replaced node's ``meta`` (``copy_meta``): later Inductor passes and
  lowering read ``meta["val"]``;
- erase what became dead (``erase_dead``), users first, and return match counts per pattern
  name (``op_name`` gives the fused op's short name). The pass manager lints the graph after
  every pass, so a broken rewrite fails at that pass, not deep inside Inductor.

``op_counts`` counts a graph's calls by target, as the pass manager records them before and
after each pass.
"""
from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

# Meta entries a replacement node inherits from the node whose value it now produces:
# "val" (the fake tensor) is what later Inductor passes and lowering read.
_COPIED_META = ("val", "tensor_meta", "stack_trace")


def target_name(node: Node) -> str:
    """A readable, process-independent name for what a node calls: ``vgraph.rms_norm.default``,
    ``aten.mul.Tensor``, ``getitem``; placeholders and outputs are named by their op."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return node.op
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", type(target).__name__)


def op_counts(graph: Graph) -> Counter:
    """Calls per target name (``target_name``); placeholders and the output are left out."""
    return Counter(target_name(n) for n in graph.nodes
                   if n.op in ("call_function", "call_method", "call_module"))


def is_call(node: Any, *targets: Any) -> bool:
    """True when ``node`` is an FX ``call_function`` of one of ``targets`` (OpOverloads)."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def op_name(op: torch._ops.OpOverload) -> str:
    """``vgraph::rms_norm_static_fp8_quant`` -> ``rms_norm_static_fp8_quant`` (pattern names)."""
    return op._schema.name.split("::")[-1]


def op_args(node: Node) -> dict[str, Any]:
    """The call's arguments by schema name, filling in defaults.

    The same op may be spelled with positional or keyword arguments, with or without its
    defaults; reading by name makes matching independent of the spelling.
    """
    schema = node.target._schema  # type: ignore[union-attr]
    named: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            named[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            named[arg.name] = node.kwargs[arg.name]
        else:
            named[arg.name] = arg.default_value if arg.has_default_value() else None
    return named


def value(arg: Any) -> Any:
    """The trace-time value of an argument: a node's fake value (tensor or SymInt), else itself."""
    return arg.meta.get("val") if isinstance(arg, Node) else arg


def dtype_of(node: Any) -> Optional[torch.dtype]:
    val = value(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def known_equal(a: Any, b: Any) -> bool:
    """``a == b`` provably, for ints or SymInts; never adds a guard, so 'unknown' is False."""
    if a is None or b is None:
        return False
    return bool(statically_known_true(a == b))


def known_at_least(a: Any, b: Any) -> bool:
    """``a >= b`` provably (see ``known_equal``)."""
    if a is None or b is None:
        return False
    return bool(statically_known_true(a >= b))


def is_last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and ndim > 0 and dim % ndim == ndim - 1


def only_user(node: Node) -> Optional[Node]:
    """The single user of ``node``, or None when it has zero or several."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def getitem_users(node: Node) -> Optional[dict[int, list[Node]]]:
    """Users of a tuple-returning node grouped by index; None if anything else uses the tuple.

    Rewriting a multi-output op is only safe when every consumer reads one element through
    ``operator.getitem``: those reads can be re-pointed one by one.
    """
    by_index: dict[int, list[Node]] = {}
    for user in node.users:
        if not is_call(user, operator.getitem) or not isinstance(user.args[1], int):
            return None
        by_index.setdefault(user.args[1], []).append(user)
    return by_index


def users_within(nodes: Iterable[Node], allowed: Iterable[Node]) -> bool:
    """True when every user of every node in ``nodes`` is in ``allowed``.

    A fusion deletes the intermediates of a pattern; if something outside the pattern also
    reads one, deleting it is impossible and keeping it would compute it twice.
    """
    allowed = set(allowed)
    return all(user in allowed for node in nodes for user in node.users)


def node_order(graph: Graph) -> dict[Node, int]:
    """Position of each node, to decide where a replacement may be inserted."""
    return {node: i for i, node in enumerate(graph.nodes)}


def defined_before(arg: Any, node: Node, order: dict[Node, int]) -> bool:
    """True when ``arg`` (a node or a constant) is available at ``node``'s position."""
    return not isinstance(arg, Node) or order[arg] < order[node]


def fused_insertion_point(first: Node, last: Node, inputs: Sequence[Any], early_reads: Sequence[Node],
                          order: dict[Node, int]) -> Optional[Node]:
    """Where one op replacing the span ``first`` .. ``last`` of a pattern can go, so that every
    input precedes it and every reader of an early output follows it.

    At ``first``, if the pattern's later ``inputs`` already exist there (the usual case: graph
    inputs, weights); else at ``last``, if nothing reads ``early_reads`` (getitems of
    ``first``'s outputs that the fused op also produces) in between. Otherwise no valid place
    exists without reordering the graph, and the pattern is skipped.
    """
    if all(defined_before(arg, first, order) for arg in inputs):
        return first
    users = [user for read in early_reads for user in read.users]
    # A user missing from ``order`` was made by an earlier rewrite of the same pass, anywhere
    # in the graph: taken as before ``last``, which skips the pattern rather than risk a use
    # ahead of its definition.
    if all(order.get(user, -1) > order[last] for user in users):
        return last
    return None


def replace_single(graph: Graph, producer: Node, consumer: Node, target: Any, args: tuple) -> Node:
    """Replaces ``consumer(producer(...))`` (the consumer ``producer``'s only user) with
    ``target(*args)``, inserted before the consumer; both old nodes are erased."""
    with graph.inserting_before(consumer):
        fused = graph.call_function(target, args)
    copy_meta(consumer, fused)
    consumer.replace_all_uses_with(fused)
    graph.erase_node(consumer)
    graph.erase_node(producer)
    return fused


def pair_reads(first: Node, producer_target: Any) -> Optional[tuple[Node, list[Node]]]:
    """For ``first`` = ``producer(...)[0]`` of a two-output op (``fused_add_rms_norm``'s normed
    row and new residual): the producer and the reads of its output 1, when ``first`` is the
    only read of output 0 and nothing else uses the tuple; else None."""
    if not is_call(first, operator.getitem):
        return None
    producer, index = first.args
    if not is_call(producer, producer_target) or index != 0:
        return None
    outputs = getitem_users(producer)
    if outputs is None or len(outputs.get(0, [])) != 1 or set(outputs) - {0, 1}:
        return None
    return producer, outputs.get(1, [])


def replace_pair(graph: Graph, first: Node, consumer: Node, target: Any, args: tuple,
                 second_reads: list[Node], where: Node) -> None:
    """Replaces ``consumer(producer(...)[0])`` (``pair_reads`` found ``second_reads``) with
    ``target(*args)``, a two-output op inserted before ``where``: its output 0 takes the
    consumer's uses and its output 1 those of ``second_reads``; the old nodes are erased."""
    producer = first.args[0]
    with graph.inserting_before(where):
        fused = graph.call_function(target, args)
        out = graph.call_function(operator.getitem, (fused, 0))
        second = graph.call_function(operator.getitem, (fused, 1)) if second_reads else None
    if "val" in consumer.meta and "val" in producer.meta:
        fused.meta["val"] = (consumer.meta["val"], producer.meta["val"][1])
    copy_meta(consumer, out)
    consumer.replace_all_uses_with(out)
    for read in second_reads:
        copy_meta(read, second)
        read.replace_all_uses_with(second)
        graph.erase_node(read)
    for node in (consumer, first, producer):
        graph.erase_node(node)


def copy_meta(src: Node, dst: Node) -> None:
    """Gives ``dst`` the metadata of ``src``, whose value it replaces."""
    for key in _COPIED_META:
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def erase_dead(graph: Graph, nodes: Iterable[Node]) -> set[Node]:
    """Erases those of ``nodes`` (call_function only) that no longer have users; returns them.

    Repeats until nothing changes, so a chain whose tail was just erased goes too. Nodes
    still used elsewhere (e.g. a slice another op also reads) stay.
    """
    pending = {node for node in nodes if node.op == "call_function"}
    erased: set[Node] = set()
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if not node.users:
                graph.erase_node(node)
                pending.discard(node)
                erased.add(node)
                changed = True
    return erased
