"""A user-written fusion pass, end to end through the engine: write it, plug it in, see what it
matched and whether it changed the output.

The demo model compiled with ``custom_ops=False`` and ``quantization="fp8"`` writes its RMSNorms
and its fp8 activation quantization in plain torch, for Inductor to fuse on its own. vgraph's
RMSNorm+quant fusion matches vgraph's ops, so it finds nothing there. Two user passes lift the
plain-torch code back into vgraph's ops:

- ``PlainRMSNormPass``: ``w * (x * rsqrt(mean(x**2, -1) + eps))`` -> ``vgraph::rms_norm``;
- ``PlainDynamicQuantPass``: the per-token dynamic fp8 quant -> ``vgraph::dynamic_per_token_scaled_fp8_quant``.

Both say ``position = "before"``: they run before vgraph's own passes, which then fuse every
norm with the quant that follows it (``rms_norm_dynamic_per_token_fp8_quant``): 2 sites per
layer, where the custom-op model has 1 in the whole model (its later norms are
``fused_add_rms_norm``, which has no fused dynamic-quant form). Placed "after", the same passes
run once vgraph's passes have already looked, and nothing is fused. A third user pass, a plain
function with a ``uuid``, counts the vgraph ops left at the end.

    .venv/bin/python examples/user_pass.py [--positions before after] [--dump-dir DIR]

The same passes from the command line, without editing anything::

    vgraph generate --prompt Hi --no-custom-ops --quantization fp8 \\
        --pass before:examples/user_pass.py:PlainRMSNormPass \\
        --pass before:examples/user_pass.py:PlainDynamicQuantPass
    vgraph passes report --no-custom-ops --quantization fp8 --pass examples/user_pass.py:PlainRMSNormPass ...

Match counts printed here are per piece instance (per site in the model; identical decoder
layers compile once but count once each), as ``compile_counters.pass_matches`` reports them.
These passes match fp32 graphs only (the demo model's dtype); a bf16 model adds casts around
the same ops.

Your pass and the compile cache: the pass's ``uuid()`` is part of the cache key.
``VgraphPass.uuid()`` hashes the source of the pass's module and of the modules it imports
from its own package (a helper holding a switch included), so an edit gives a new entry. Code
it reaches otherwise (``importlib``, data files) must be declared: override
``source_modules()``, or put settings in ``config()``. A pass whose source cannot be read
(``python -c``, a notebook cell) has no uuid: its compile runs without the cache, with one
warning. The startup log prints each user pass's uuid next to the key (cache_dir.md).
"""
from __future__ import annotations

import argparse
import operator
from collections import Counter
from typing import Optional

import torch
from torch.fx import Graph, Node

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph)
from vgraph.ops.kernels.common import FP8_DTYPE, FP8_MAX
from vgraph.passes import PlacedPass, VgraphPass
from vgraph.passes.fx_utils import copy_meta, is_call, node_order, only_user

aten, prims, V = torch.ops.aten, torch.ops.prims, torch.ops.vgraph


class PlainRMSNormPass(VgraphPass):
    """``w * (x * rsqrt(mean(x ** 2, -1, keepdim=True) + eps))`` -> ``vgraph::rms_norm``.

    Matches fp32 graphs as Inductor's post-grad graph spells them (pow, mean, add, rsqrt,
    mul, mul); the intermediates must not be read by anything else (x may be).
    """

    position = "before"

    def apply(self, graph: Graph) -> Counter:
        matches = 0
        for out in [n for n in graph.nodes if is_call(n, aten.mul.Tensor)]:
            found = self._match(out)
            if found is None:
                continue
            x, weight, eps, chain = found
            with graph.inserting_before(out):
                norm = graph.call_function(V.rms_norm.default, (x, weight, eps))
            copy_meta(out, norm)
            out.replace_all_uses_with(norm)
            for node in chain:  # from the output back to the input: users go first
                graph.erase_node(node)
            matches += 1
        return Counter(rms_norm=matches)

    def _match(self, out: Node) -> Optional[tuple[Node, Node, float, list[Node]]]:
        """(x, weight, eps, nodes to erase) if ``out`` is the last mul of the norm."""
        weight, scaled = out.args
        if not is_call(scaled, aten.mul.Tensor):
            return None
        x, rsqrt = scaled.args
        if not is_call(rsqrt, aten.rsqrt.default) or not is_call(rsqrt.args[0], aten.add.Tensor):
            return None
        add = rsqrt.args[0]
        mean, eps = add.args
        if not is_call(mean, aten.mean.dim) or not isinstance(eps, float):
            return None
        square, dims, keepdim = mean.args[0], list(mean.args[1]), mean.args[2:3] == (True,)
        last = x.meta["val"].dim() - 1
        if not keepdim or dims not in ([-1], [last]) or not is_call(square, aten.pow.Tensor_Scalar):
            return None
        if square.args != (x, 2) or x.meta["val"].dtype != torch.float32:
            return None
        chain = [scaled, rsqrt, add, mean, square]
        if any(len(node.users) != 1 for node in chain):  # an intermediate is read elsewhere
            return None
        return x, weight, eps, [out, *chain]


class PlainDynamicQuantPass(VgraphPass):
    """The plain-torch per-token fp8 quant -> ``vgraph::dynamic_per_token_scaled_fp8_quant``::

        s = clamp_min(amax(abs(x), [-1], keepdim) / 448, min_scale)
        q = convert(clamp_max(clamp_min(x / s, -448), 448), e4m3)      -> (q, s)

    The scale ``s`` is an output too (the fp8 GEMM reads it), so the fused op goes where ``q``
    was computed, and only if every other reader of ``s`` comes after that point.
    """

    position = "before"

    def apply(self, graph: Graph) -> Counter:
        matches = 0
        order = node_order(graph)
        for q in [n for n in graph.nodes if is_call(n, prims.convert_element_type.default)]:
            found = self._match(q, order)
            if found is None:
                continue
            x, scale, chain = found
            with graph.inserting_before(q):
                fused = graph.call_function(V.dynamic_per_token_scaled_fp8_quant.default, (x,))
                new_q = graph.call_function(operator.getitem, (fused, 0))
                new_scale = graph.call_function(operator.getitem, (fused, 1))
            fused.meta["val"] = (q.meta["val"], scale.meta["val"])
            copy_meta(q, new_q)
            copy_meta(scale, new_scale)
            q.replace_all_uses_with(new_q)
            dead = [*reversed(chain), scale, *scale_chain(scale)]  # users before what they read
            chain[0].replace_input_with(scale, x)  # the x / s being erased must not hold s
            scale.replace_all_uses_with(new_scale)
            for node in dead:
                graph.erase_node(node)
            matches += 1
        return Counter(dynamic_per_token_scaled_fp8_quant=matches)

    def _match(self, q: Node, order: dict[Node, int]) -> Optional[tuple[Node, Node, list[Node]]]:
        """(x, the scale node, [div, clamp_min, clamp_max, q]) if ``q`` ends the pattern."""
        if q.args[1] != FP8_DTYPE or not is_call(q.args[0], aten.clamp_max.default):
            return None
        clamp_max = q.args[0]
        clamp_min = clamp_max.args[0]
        if clamp_max.args[1] != FP8_MAX or not is_call(clamp_min, aten.clamp_min.default) \
                or clamp_min.args[1] != -FP8_MAX or not is_call(clamp_min.args[0], aten.div.Tensor):
            return None
        div = clamp_min.args[0]
        x, scale = div.args
        if not isinstance(x, Node) or x.meta["val"].dtype != torch.float32 or not scale_of(scale, x):
            return None
        if any(only_user(n) is None for n in (div, clamp_min, clamp_max)):
            return None
        later = [u for u in scale.users if u is not div]
        if any(order[u] < order[q] for u in later):  # a reader of s before q: no place for the op
            return None
        return x, scale, [div, clamp_min, clamp_max, q]


def scale_of(scale: object, x: Node) -> bool:
    """``scale`` is ``clamp_min(amax(abs(x), [-1], True) / 448, min)`` over this very x."""
    if not is_call(scale, aten.clamp_min.default) or not is_call(scale.args[0], aten.div.Tensor):
        return False
    div = scale.args[0]
    amax = div.args[0]
    if div.args[1] != FP8_MAX or not is_call(amax, aten.amax.default) or list(amax.args[1]) != [-1]:
        return False
    absolute = amax.args[0]
    return is_call(absolute, aten.abs.default) and absolute.args[0] is x \
        and all(only_user(n) is not None for n in (div, amax, absolute))


def scale_chain(scale: Node) -> list[Node]:
    """The nodes computing the scale from x, users first: div, amax, abs."""
    div = scale.args[0]
    amax = div.args[0]
    return [div, amax, amax.args[0]]


def count_vgraph_ops(graph: Graph) -> int:
    """The simplest user pass: a function with a uuid. Returns what it 'matched'."""
    return sum(1 for n in graph.nodes
               if n.op == "call_function" and str(n.target).startswith("vgraph."))


count_vgraph_ops.uuid = lambda: "count_vgraph_ops/1"


def build(position: str, dump_dir: Optional[str] = None):
    """The demo model, plain-torch norms and quant, with the lifting passes at ``position``."""
    from vgraph import LLM
    lifts = [PlacedPass(PlainRMSNormPass(), position), PlacedPass(PlainDynamicQuantPass(), position)]
    return LLM("demo-model-v1", custom_ops=False, quantization="fp8", passes=[*lifts, count_vgraph_ops],
               num_gpu_blocks=64, dump_graphs_dir=dump_dir, use_cache=dump_dir is None)


def main(argv: Optional[list[str]] = None) -> dict[str, dict[str, int]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", nargs="+", choices=["before", "after"], default=["before", "after"])
    parser.add_argument("--dump-dir", help="write each graph before/after each pass here (compiles cold)")
    args = parser.parse_args(argv)
    from vgraph import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [7, 8, 9, 10, 11]}]
    matches, tokens = {}, {}
    for position in args.positions:
        dump = f"{args.dump_dir}/{position}" if args.dump_dir else None
        llm = build(position, dump)
        matches[position] = dict(llm.engine.runner.compile_counters.pass_matches)
        tokens[position] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        print(f"lifting passes {position} vgraph's: matches per site {matches[position]}")
        print(f"  greedy tokens: {tokens[position]}")
    if len(tokens) == 2:
        print("same tokens either way:", tokens["before"] == tokens["after"])
    return matches


if __name__ == "__main__":
    main()
