"""The backend on a toy model with a counting attention op: pieces, compilations, dispatch."""
from __future__ import annotations

import pytest
import torch

from vgraph.compiler.backend import VgraphBackend
from vgraph.compiler.cache import CompileCache
from vgraph.compiler.compiled_forward import CompiledForward
from vgraph.config import CompileConfig

CALLS = {"attention": 0}


@torch.library.custom_op("vgraph_test::counting_attention", mutates_args=())
def counting_attention(x: torch.Tensor, layer: int) -> torch.Tensor:
    CALLS["attention"] += 1
    return x * 0.5 + layer


@counting_attention.register_fake
def _(x: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


class Toy(torch.nn.Module):
    """L layers of (linear -> attention -> linear), like a decoder's alternation."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.inp = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))
        self.embed = torch.nn.Embedding(32, 8)
        self.dtype = torch.float32
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + positions[:, None].float()
        for i, (a, b) in enumerate(zip(self.inp, self.out)):
            h = torch.ops.vgraph_test.counting_attention(torch.relu(a(h)), i)
            h = b(h)
        return h


@pytest.fixture(scope="module")
def compiled_toy(tmp_path_factory):
    torch._dynamo.reset()
    model = Toy(layers=3)
    config = CompileConfig(splitting_ops=["vgraph_test::counting_attention"], compile_sizes=[4])
    cache = CompileCache(tmp_path_factory.mktemp("cache"), "toy")
    backend = VgraphBackend(config, None, cache)
    fwd = CompiledForward(model, backend)
    with torch.inference_mode():
        fwd(torch.arange(6) % 32, torch.arange(6))
    return model, fwd, backend


def test_piece_and_compile_counts(compiled_toy):
    _, _, backend = compiled_toy
    c = backend.counters
    assert c.pieces == 2 * 3 + 1 and c.compiled_pieces == 3 + 1
    # first, middle (x2, identical) and last pieces: three distinct graphs, each compiled
    # once dynamically and once for compile size 4
    assert c.unique_piece_graphs == 3
    assert c.inductor_compilations == 3 * 2 and c.cache_saves == 6
    assert c.graphs_seen == 1


@pytest.mark.parametrize("n", [1, 2, 4, 7, 33])
def test_compiled_equals_eager_at_every_size_without_recompiling(compiled_toy, n):
    model, fwd, backend = compiled_toy
    before = CALLS["attention"]
    with torch.inference_mode():  # the runner's inputs are inference tensors too
        ids, pos = torch.randint(0, 32, (n,)), torch.arange(n)
        out = fwd(ids, pos)
        ref = model(ids, pos)
    assert CALLS["attention"] - before == 2 * 3, "attention runs eagerly between the pieces"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert backend.counters.graphs_seen == 1, "no recompile"


def test_one_row_runs_the_same_graph(compiled_toy):
    """Traced size-oblivious, the compiled forward serves one row without a recompile (Dynamo
    would otherwise specialize the token dimension on 0 and 1): a batch of one runs unpadded."""
    model, fwd, backend = compiled_toy
    ids, pos = torch.tensor([7]), torch.tensor([3])
    with torch.inference_mode():
        out = fwd(ids, pos)
        ref = model(ids, pos)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.shape[0] == 1 and backend.counters.graphs_seen == 1
