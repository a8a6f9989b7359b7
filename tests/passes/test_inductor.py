"""The passes inside real ``torch.compile`` runs: Inductor calls the manager on the post-grad
graph, the fused ops end up in the compiled code, and the uuid keys Inductor's cache.

Inductor's FX-graph cache is switched off for the count tests: a cache hit loads compiled
code without running any post-grad pass, so counts would depend on earlier runs.
``test_cache_hit_skips_passes`` pins that behaviour down in a private cache dir.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import fresh_cache

from vgraph.passes import PassManager, RMSNormQuantFusionPass, default_passes

from . import EPS, V, GraphRecorder, assert_outputs_match, scale

pytestmark = pytest.mark.slow
LAYERS, HIDDEN = 2, 16


def mini_decoder(x: torch.Tensor, norm_w: torch.Tensor, s: torch.Tensor, dynamic: bool):
    """Llama's norm / activation / quant sites with stand-ins for attention and the GEMMs.

    The stand-ins are single elementwise ops (dequantize, concat), which Inductor rounds
    exactly as eager does, so compiled and eager outputs agree bit for bit once fused.
    """
    def quant(t):
        return V.dynamic_per_token_scaled_fp8_quant(t) if dynamic \
            else (V.static_scaled_fp8_quant(t, s), s)

    def dequant(qs):
        return (qs[0].float() * qs[1]).to(x.dtype)

    residual, quantized = x, []
    h = V.rms_norm(x, norm_w[0], EPS)
    for layer in range(LAYERS):
        if layer:
            h, residual = V.fused_add_rms_norm(h, residual, norm_w[2 * layer], EPS)
        attn = dequant(quant(h))                                    # "qkv_proj .. o_proj"
        h, residual = V.fused_add_rms_norm(attn, residual, norm_w[2 * layer + 1], EPS)
        hq = dequant(quant(h))
        gate_up = torch.cat([hq, hq * 0.5], dim=-1)                  # "gate_up_proj"
        act = F.silu(gate_up[..., :HIDDEN]) * gate_up[..., HIDDEN:]
        h = dequant(quant(act))                                      # "down_proj"
        quantized.append(h)
    return V.fused_add_rms_norm(h, residual, norm_w[-1], EPS)[0], quantized


def compile_decoder(manager: PassManager, dynamic_quant: bool, dtype: torch.dtype):
    """Compiles once with a dynamic token dim; returns (compiled fn, its inputs' maker)."""
    torch._dynamo.reset()
    weights = torch.randn(2 * LAYERS + 1, HIDDEN, dtype=dtype)

    def make_inputs(tokens: int):
        x = torch.randn(tokens, HIDDEN, dtype=dtype)
        torch._dynamo.mark_dynamic(x, 0)
        return x, weights, scale(), dynamic_quant

    compiled = torch.compile(mini_decoder, fullgraph=True)
    with torch._inductor.config.patch(post_grad_custom_post_pass=manager, fx_graph_cache=False):
        compiled(*make_inputs(5))
    return compiled, make_inputs


@pytest.fixture(scope="module", params=[
    pytest.param((False, torch.float32), id="static-fp32"),
    pytest.param((True, torch.bfloat16), id="dynamic-bf16"),
])
def compiled_decoder(request):
    dynamic_quant, dtype = request.param
    recorder = GraphRecorder()
    manager = PassManager(default_passes() + [recorder])
    compiled, make_inputs = compile_decoder(manager, dynamic_quant, dtype)
    yield dynamic_quant, manager, recorder, compiled, make_inputs
    torch._dynamo.reset()


def test_counts_are_exact(compiled_decoder):
    dynamic_quant, manager, recorder, _, _ = compiled_decoder
    rms, silu = manager.passes[0], manager.passes[1]
    assert manager.graphs_seen == 1 and recorder.calls == 1
    if dynamic_quant:
        # only the first input norm has no residual add; fused_add + dynamic has no fused op
        assert dict(rms.pattern_counts) == {"rms_norm_dynamic_per_token_fp8_quant": 1}
        assert dict(silu.pattern_counts) == {"silu_and_mul": LAYERS}
    else:
        assert dict(rms.pattern_counts) == {"rms_norm_static_fp8_quant": 1,
                                            "fused_add_rms_norm_static_fp8_quant": 2 * LAYERS - 1}
        assert dict(silu.pattern_counts) == {"silu_and_mul": LAYERS,
                                             "silu_and_mul_static_fp8_quant": LAYERS}
    assert manager.match_counts() == {"RMSNormQuantFusionPass": rms.total_matched,
                                      "SiluMulFusionPass": silu.total_matched,
                                      "AllReduceRMSNormFusionPass": 0, "NormLinearFusionPass": 0,
                                      "GraphRecorder": 0}


def test_post_pass_graph_has_only_fused_ops(compiled_decoder):
    dynamic_quant, _, recorder, _, _ = compiled_decoder
    ops = recorder.counts
    assert ops[torch.ops.aten.div.Tensor] == ops[torch.ops.aten.exp.default] == 0  # no silu left
    assert ops[V.fused_add_rms_norm.default] == (2 * LAYERS if dynamic_quant else 1)
    if dynamic_quant:
        assert ops[V.rms_norm_dynamic_per_token_fp8_quant.default] == 1
        assert ops[V.silu_and_mul.default] == LAYERS
        assert ops[V.dynamic_per_token_scaled_fp8_quant.default] == 3 * LAYERS - 1
    else:
        assert ops[V.rms_norm_static_fp8_quant.default] == 1
        assert ops[V.fused_add_rms_norm_static_fp8_quant.default] == 2 * LAYERS - 1
        assert ops[V.silu_and_mul_static_fp8_quant.default] == LAYERS
        assert ops[V.rms_norm.default] == ops[V.static_scaled_fp8_quant.default] == 0
        assert ops[V.silu_and_mul.default] == 0


@pytest.mark.parametrize("tokens", [5, 9])
def test_outputs_equal_eager(compiled_decoder, tokens):
    _, manager, _, compiled, make_inputs = compiled_decoder
    inputs = make_inputs(tokens)
    assert_outputs_match(compiled(*inputs), mini_decoder(*inputs))
    assert manager.graphs_seen == 1  # the dynamic token dim: no recompile


def test_cache_hit_skips_passes():
    """Inductor's FX-graph cache keys on the manager's uuid; on a hit no pass runs at all."""
    def f(x, w, s):
        return V.static_scaled_fp8_quant(V.rms_norm(x, w, EPS), s)

    x, w = torch.randn(4, HIDDEN), torch.randn(HIDDEN)
    ref = f(x, w, scale())

    def run(manager: PassManager) -> int:
        torch._dynamo.reset()
        with torch._inductor.config.patch(post_grad_custom_post_pass=manager,
                                          fx_graph_cache=True):
            assert_outputs_match(torch.compile(f)(x, w, scale()), ref)
        return manager.match_counts()["RMSNormQuantFusionPass"]

    with fresh_cache():
        assert run(PassManager([RMSNormQuantFusionPass()])) == 1          # miss: pass runs
        assert run(PassManager([RMSNormQuantFusionPass()])) == 0          # hit: pass skipped
        assert run(PassManager([RMSNormQuantFusionPass(dynamic=False)])) == 1  # new uuid: miss
    torch._dynamo.reset()


def test_norm_linear_fusion_in_a_compiled_decoder():
    """NormLinearFusionPass inside torch.compile (dynamic token dim): a 16-bit CUDA model's
    norm -> projection sites, with the residual stream threaded through; outputs equal eager."""
    from vgraph.passes import NormLinearFusionPass
    torch._dynamo.reset()
    qkv, gate_up, down = torch.randn(3 * HIDDEN, HIDDEN), torch.randn(4 * HIDDEN, HIDDEN), torch.randn(HIDDEN, 2 * HIDDEN)
    norm_w = torch.randn(2 * LAYERS + 1, HIDDEN)

    def decoder(x):
        h, residual = V.rms_norm(x, norm_w[0], EPS), x
        for layer in range(LAYERS):
            if layer:
                h, residual = V.fused_add_rms_norm(h, residual, norm_w[2 * layer], EPS)
            attn = V.linear(h, qkv, None)[:, :HIDDEN]
            h, residual = V.fused_add_rms_norm(attn, residual, norm_w[2 * layer + 1], EPS)
            h = V.linear(V.linear_silu_and_mul(h, gate_up, None), down, None)
        return V.fused_add_rms_norm(h, residual, norm_w[-1], EPS)[0]

    recorder, fusion = GraphRecorder(), NormLinearFusionPass()
    compiled = torch.compile(decoder, fullgraph=True)
    x = torch.randn(5, HIDDEN)
    torch._dynamo.mark_dynamic(x, 0)
    with torch._inductor.config.patch(post_grad_custom_post_pass=PassManager([fusion, recorder]),
                                      fx_graph_cache=False):
        compiled(x)
    assert dict(fusion.pattern_counts) == {"rms_norm_linear": 1, "fused_add_rms_norm_linear": 2 * LAYERS - 1}
    assert recorder.counts[V.rms_norm.default] == 0 and recorder.counts[V.fused_add_rms_norm.default] == 1
    for tokens in (1, 7):
        x = torch.randn(tokens, HIDDEN)
        assert_outputs_match(compiled(x), decoder(x))
    torch._dynamo.reset()
