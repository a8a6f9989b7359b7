"""AllReduceRMSNormFusionPass inside vgraph's backend: a decoder-shaped model whose row-parallel
projections end in torch.distributed functional all-reduces (a 1-rank gloo group), split at a
stand-in attention op and compiled piece by piece, with the pass manager the engine builds."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from tests.gloo_group import single_rank_group
from vgraph.compiler.backend import VgraphBackend
from vgraph.compiler.build import build_pass_manager
from vgraph.compiler.cache import CompileCache
from vgraph.compiler.compiled_forward import CompiledForward
from vgraph.config import CompileConfig, EngineConfig, ModelConfig
from vgraph.ops.norm import fused_add_rms_norm_reference, rms_norm_reference

from . import V

pytestmark = pytest.mark.slow
LAYERS, HIDDEN, VOCAB = 2, 16, 32
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
AR_NORM = V.all_reduce_fused_add_rms_norm.default
SPLIT = "vgraph_test::tp_attention"


@torch.library.custom_op(SPLIT, mutates_args=())
def tp_attention(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x * 0.5 + layer


@tp_attention.register_fake
def _(x: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


class TPShaped(nn.Module):
    """Llama's all-reduce sites: the vocab-parallel embedding (then a norm without residual),
    o_proj and down_proj (each then the residual add + RMSNorm), L layers."""

    def __init__(self, custom_ops: bool) -> None:
        super().__init__()
        self.custom_ops, self.dtype = custom_ops, torch.float32
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        linears = lambda out: nn.ModuleList(nn.Linear(HIDDEN, out, bias=False) for _ in range(LAYERS))  # noqa: E731
        self.qkv, self.o, self.up = linears(HIDDEN), linears(HIDDEN), linears(2 * HIDDEN)
        self.down = nn.ModuleList(nn.Linear(2 * HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS))
        self.norm_w = nn.Parameter(1 + 0.1 * torch.randn(2 * LAYERS + 1, HIDDEN))
        self.requires_grad_(False)

    def _norm(self, h, residual, i):
        if residual is None:
            return (V.rms_norm if self.custom_ops else rms_norm_reference)(h, self.norm_w[i], 1e-6)
        add_norm = V.fused_add_rms_norm if self.custom_ops else fused_add_rms_norm_reference
        return add_norm(h, residual, self.norm_w[i], 1e-6)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        h = funcol.all_reduce(self.embed(input_ids), "sum", group)
        residual, h = h, self._norm(h, None, 0)
        for i in range(LAYERS):
            if i:
                h, residual = self._norm(h, residual, 2 * i)
            h = torch.ops.vgraph_test.tp_attention(self.qkv[i](h), i)
            h = funcol.all_reduce(self.o[i](h), "sum", group)
            h, residual = self._norm(h, residual, 2 * i + 1)
            h = funcol.all_reduce(self.down[i](torch.relu(self.up[i](h))), "sum", group)
        return self._norm(h, residual, 2 * LAYERS)[0]


class OpTotals:
    """A user pass after vgraph's: sums the op counts of every graph it sees."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.counts.update(n.target for n in graph.nodes if n.op == "call_function")

    def uuid(self) -> str:
        return "tests.passes.OpTotals/1"


def compile_model(model: nn.Module, tmp_path, **compile_options):
    """The model compiled through vgraph's backend and the engine's pass manager; returns
    (compiled forward, the backend's counters, the ops left after the passes)."""
    torch._dynamo.reset()
    totals = OpTotals()
    config = CompileConfig(splitting_ops=[SPLIT], passes=[totals], **compile_options)
    manager = build_pass_manager(EngineConfig(ModelConfig("unused"), compile=config))
    backend = VgraphBackend(config, manager, CompileCache(tmp_path, "tp-shaped"))
    forward = CompiledForward(model, backend)
    with torch.inference_mode():
        forward(torch.arange(6) % VOCAB, torch.arange(6))
    return forward, backend.counters, totals.counts


@pytest.fixture(scope="module")
def group():
    with single_rank_group() as name:
        yield name
    torch._dynamo.reset()


@pytest.mark.parametrize("custom_ops", [True, None], ids=["custom-ops", "plain-torch"])
def test_fusion_on_and_off(group, tmp_path, custom_ops):
    """custom_ops None is the CPU default: a plain-torch model whose plain norms the passes
    may lift (custom_ops=False would leave them to Inductor)."""
    torch.manual_seed(0)
    model = TPShaped(custom_ops is True)
    fused, on, ops_on = compile_model(model, tmp_path / "on", custom_ops=custom_ops)
    # o_proj and down_proj of every layer; the embedding's all-reduce is also the first residual
    assert on.pass_matches["AllReduceRMSNormFusionPass"] == 2 * LAYERS
    assert ops_on[AR_NORM] == 2 * LAYERS and ops_on[ALL_REDUCE] == 1  # distinct graphs: all differ
    assert ops_on[V.fused_add_rms_norm.default] == 0
    unfused, off, ops_off = compile_model(model, tmp_path / "off", custom_ops=custom_ops,
                                          enable_allreduce_fusion=False)
    assert "AllReduceRMSNormFusionPass" not in off.pass_matches
    assert ops_off[AR_NORM] == 0 and ops_off[ALL_REDUCE] == 2 * LAYERS + 1
    with torch.inference_mode():
        for n in (3, 11):
            ids, pos = torch.randint(0, VOCAB, (n,)), torch.arange(n)
            eager = model(ids, pos)
            torch.testing.assert_close(fused(ids, pos), unfused(ids, pos), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(fused(ids, pos), eager, rtol=1e-5, atol=1e-5)
    assert on.graphs_seen == off.graphs_seen == 1, "no recompile"


def test_the_flag_is_in_the_pass_managers_uuid():
    def manager(**options):
        return build_pass_manager(EngineConfig(ModelConfig("unused"), compile=CompileConfig(**options)))

    on, off = manager(), manager(enable_allreduce_fusion=False)
    assert [type(p).__name__ for p in on.passes][-2:] == ["AllReduceRMSNormFusionPass", "NormLinearFusionPass"]
    assert "AllReduceRMSNormFusionPass" not in [type(p).__name__ for p in off.passes]
    assert on.uuid() != off.uuid() and on.uuid() == manager().uuid()
    assert manager(custom_ops=False).passes[-2].plain_torch is False
    assert manager(enable_fusion=False) is None
