"""A user-written fusion pass, end to end: write it, plug it in, see what it matched.

The model code below writes its RMSNorm in plain torch, so vgraph's RMSNorm+quant fusion has
nothing to grab. ``PlainRMSNormPass`` rewrites that plain-torch norm into ``vgraph::rms_norm``;
it runs before vgraph's own passes, which then fuse the norm with the fp8 quant after it.
A second user pass, a plain function with a ``uuid``, counts the vgraph ops left at the end.

    .venv/bin/python examples/user_pass.py [--dump-dir DIR]

With ``--dump-dir`` the graph is written before and after each pass. (Later this plugs in
through ``CompileConfig(passes=[PlainRMSNormPass()])``; here it uses the PassManager directly.)
"""
from __future__ import annotations

import argparse
from collections import Counter
from typing import Optional

import torch
from torch.fx import Graph, Node

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph)
from vgraph.passes import PassManager, VgraphPass, default_passes

aten = torch.ops.aten


def _call(node: object, target: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


class PlainRMSNormPass(VgraphPass):
    """``w * (x * rsqrt(mean(x ** 2, -1, keepdim=True) + eps))`` -> ``vgraph::rms_norm``.

    Matches fp32 graphs as Inductor's post-grad graph spells them (pow, mean, add, rsqrt,
    mul, mul); the intermediates must not be read by anything else.
    """

    def apply(self, graph: Graph) -> Counter:
        matches = 0
        for out in [n for n in graph.nodes if _call(n, aten.mul.Tensor)]:
            found = self._match(out)
            if found is None:
                continue
            x, weight, eps, chain = found
            with graph.inserting_before(out):
                norm = graph.call_function(torch.ops.vgraph.rms_norm.default, (x, weight, eps))
            norm.meta["val"] = out.meta.get("val")
            out.replace_all_uses_with(norm)
            for node in chain:  # from the output back to the input: users go first
                graph.erase_node(node)
            matches += 1
        return Counter(rms_norm=matches)

    def _match(self, out: Node) -> Optional[tuple[Node, Node, float, list[Node]]]:
        """(x, weight, eps, nodes to erase) if ``out`` is the last mul of the norm."""
        weight, scaled = out.args
        if not _call(scaled, aten.mul.Tensor):
            return None
        x, rsqrt = scaled.args
        if not _call(rsqrt, aten.rsqrt.default) or not _call(rsqrt.args[0], aten.add.Tensor):
            return None
        add = rsqrt.args[0]
        mean, eps = add.args
        if not _call(mean, aten.mean.dim) or not isinstance(eps, float):
            return None
        square, dims, keepdim = mean.args[0], list(mean.args[1]), mean.args[2:3] == (True,)
        last = x.meta["val"].dim() - 1
        if not keepdim or dims not in ([-1], [last]) or not _call(square, aten.pow.Tensor_Scalar):
            return None
        if square.args != (x, 2) or x.meta["val"].dtype != torch.float32:
            return None
        chain = [scaled, rsqrt, add, mean, square]
        if any(len(node.users) != 1 for node in chain):  # an intermediate is read elsewhere
            return None
        return x, weight, eps, [out, *chain]


def count_vgraph_ops(graph: Graph) -> int:
    """The simplest user pass: a function with a uuid. Returns what it 'matched'."""
    return sum(1 for n in graph.nodes
               if n.op == "call_function" and str(n.target).startswith("vgraph."))


count_vgraph_ops.uuid = lambda: "count_vgraph_ops/1"


def block(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Model code with a hand-written RMSNorm feeding an fp8 quant."""
    h = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    return torch.ops.vgraph.static_scaled_fp8_quant(h, s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump-dir", help="write the graph before/after each pass here")
    args = parser.parse_args()

    manager = PassManager([PlainRMSNormPass(), *default_passes(), count_vgraph_ops],
                          dump_dir=args.dump_dir)
    x, w, s = torch.randn(8, 64), torch.randn(64), torch.tensor([0.05])
    # fx_graph_cache off: on an Inductor cache hit no pass runs, and there would be no counts.
    with torch._inductor.config.patch(post_grad_custom_post_pass=manager, fx_graph_cache=False):
        out = torch.compile(block)(x, w, s)

    print("matches per pass:", manager.match_counts())
    print("patterns:", {p.pass_name: dict(p.pattern_counts)
                        for p in manager.passes if isinstance(p, VgraphPass)})
    differ = (out.view(torch.uint8) != block(x, w, s).view(torch.uint8)).sum()
    print(f"compiled vs eager: {int(differ)} of {out.numel()} fp8 values differ")
    print("manager uuid (enters Inductor's cache key):", manager.uuid()[:16], "...")


if __name__ == "__main__":
    main()
