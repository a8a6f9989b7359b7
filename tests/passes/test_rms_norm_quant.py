"""RMSNormQuantFusionPass on small post-grad graphs: what fuses, what must not, numerics."""
from __future__ import annotations

import pytest
import torch

from vgraph.passes import RMSNormQuantFusionPass

from . import EPS, V, apply, check_pass, op_counts, scale, trace

DTYPES = [torch.float32, torch.bfloat16]
UNFUSED = (V.rms_norm.default, V.fused_add_rms_norm.default,
           V.static_scaled_fp8_quant.default, V.dynamic_per_token_scaled_fp8_quant.default)


def inputs(dtype: torch.dtype, tokens: int = 5, hidden: int = 32) -> tuple[torch.Tensor, ...]:
    """x, residual, weight: small and awkwardly sized."""
    return (torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype),
            torch.randn(hidden, dtype=dtype))


def assert_only(counts, fused, **expected_unfused) -> None:
    """``fused`` occurs once per expected match and the unfused ops are gone (or as given)."""
    for op, n in fused.items():
        assert counts[op] == n, f"{op}: {counts[op]} != {n}"
    for op in UNFUSED:
        assert counts[op] == expected_unfused.get(op._opname, 0), op


# ------------------------------------------------------------------ patterns that fuse


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_static(dtype):
    x, _, w = inputs(dtype)

    def f(x, w, s):
        return V.static_scaled_fp8_quant(V.rms_norm(x, w, EPS), s)

    p = RMSNormQuantFusionPass()
    counts = check_pass(p, f, x, w, scale())
    assert p.matched_count == 1 and p.pattern_counts == {"rms_norm_static_fp8_quant": 1}
    assert_only(counts, {V.rms_norm_static_fp8_quant.default: 1})


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_dynamic(dtype):
    x, _, w = inputs(dtype)

    def f(x, w):
        q, s = V.dynamic_per_token_scaled_fp8_quant(V.rms_norm(x, w, EPS))
        return q, s * 2  # the scales keep their consumers

    p = RMSNormQuantFusionPass()
    counts = check_pass(p, f, x, w)
    assert p.matched_count == 1 and p.pattern_counts == {"rms_norm_dynamic_per_token_fp8_quant": 1}
    assert_only(counts, {V.rms_norm_dynamic_per_token_fp8_quant.default: 1})


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_static_keeps_residual(dtype):
    x, r, w = inputs(dtype)

    def f(x, r, w, s):
        y, new_r = V.fused_add_rms_norm(x, r, w, EPS)
        return V.static_scaled_fp8_quant(y, s), new_r * 3

    p = RMSNormQuantFusionPass()
    counts = check_pass(p, f, x, r, w, scale())
    assert p.matched_count == 1
    assert_only(counts, {V.fused_add_rms_norm_static_fp8_quant.default: 1})


def test_fused_add_rms_norm_static_residual_unused():
    """The last layer: the new residual is dropped, the quantized output is all that is read."""
    x, r, w = inputs(torch.float32)

    def f(x, r, w, s):
        return V.static_scaled_fp8_quant(V.fused_add_rms_norm(x, r, w, EPS)[0], s)

    p = RMSNormQuantFusionPass()
    counts = check_pass(p, f, x, r, w, scale())
    assert p.matched_count == 1
    assert_only(counts, {V.fused_add_rms_norm_static_fp8_quant.default: 1})


def test_scale_computed_after_norm_inserts_at_quant():
    """The scale only exists after the norm, and the residual is read after the quant."""
    x, r, w = inputs(torch.float32)

    def f(x, r, w, s):
        y, new_r = V.fused_add_rms_norm(x, r, w, EPS)
        q = V.static_scaled_fp8_quant(y, s.abs())
        return q, new_r + 1

    p = RMSNormQuantFusionPass()
    check_pass(p, f, x, r, w, scale())
    assert p.matched_count == 1


def test_dynamic_token_dim():
    x, r, w = inputs(torch.float32)

    def f(x, w, s):
        return V.static_scaled_fp8_quant(V.rms_norm(x, w, EPS), s)

    p = RMSNormQuantFusionPass()
    gm = apply(p, trace(f, x, w, scale(), symbolic=True))
    assert p.matched_count == 1 and op_counts(gm.graph)[V.rms_norm_static_fp8_quant.default] == 1


def test_two_layer_decoder_counts_exactly():
    """Llama's norm sites with static scales: 2 per layer (2L), the first without a residual;
    the final norm feeds the unquantized lm_head and stays."""
    x, _, w = inputs(torch.float32)

    def f(x, w, s):
        residual = x
        h = V.static_scaled_fp8_quant(V.rms_norm(x, w, EPS), s).float()     # layer 0 input
        h, residual = V.fused_add_rms_norm(h, residual, w, EPS)             # layer 0 post-attn
        h = V.static_scaled_fp8_quant(h, s).float()
        for _ in range(2):                                                 # layer 1
            h, residual = V.fused_add_rms_norm(h, residual, w, EPS)
            h = V.static_scaled_fp8_quant(h, s).float()
        return V.fused_add_rms_norm(h, residual, w, EPS)[0]                 # final norm

    p = RMSNormQuantFusionPass()
    counts = check_pass(p, f, x, w, scale())
    assert p.matched_count == 4
    assert p.pattern_counts == {"rms_norm_static_fp8_quant": 1,
                                "fused_add_rms_norm_static_fp8_quant": 3}
    assert counts[V.fused_add_rms_norm.default] == 1  # the unquantized final norm stays


# ------------------------------------------------------------------ patterns that must not


def test_norm_output_also_used_unquantized():
    x, r, w = inputs(torch.float32)

    def f(x, r, w, s):
        y = V.rms_norm(x, w, EPS)
        q = V.static_scaled_fp8_quant(y, s)
        q2, _ = V.dynamic_per_token_scaled_fp8_quant(y)
        y2, _ = V.fused_add_rms_norm(x, r, w, EPS)
        return q, q2, y, V.static_scaled_fp8_quant(y2, s), y2 + 1

    p = RMSNormQuantFusionPass()
    counts = check_pass(p, f, x, r, w, scale())
    assert p.matched_count == 0
    assert_only(counts, {}, rms_norm=1, fused_add_rms_norm=1, static_scaled_fp8_quant=2,
                dynamic_per_token_scaled_fp8_quant=1)


def test_quant_of_another_input():
    x, r, w = inputs(torch.float32)

    def f(x, r, w, s):
        y = V.rms_norm(x, w, EPS)
        y2, new_r = V.fused_add_rms_norm(x, r, w, EPS)
        return y, y2, V.static_scaled_fp8_quant(x + 1, s), V.static_scaled_fp8_quant(new_r, s)

    p = RMSNormQuantFusionPass()
    check_pass(p, f, x, r, w, scale())
    assert p.matched_count == 0  # quant(residual') is not the normed output


def test_fused_add_with_dynamic_quant_has_no_target():
    """No fused op covers fused_add_rms_norm + dynamic quant: the graph stays as it was."""
    x, r, w = inputs(torch.float32)

    def f(x, r, w):
        y, new_r = V.fused_add_rms_norm(x, r, w, EPS)
        return V.dynamic_per_token_scaled_fp8_quant(y), new_r

    p = RMSNormQuantFusionPass()
    counts = check_pass(p, f, x, r, w)
    assert p.matched_count == 0 and counts[V.fused_add_rms_norm.default] == 1


def test_residual_read_between_norm_and_quant_of_late_scale():
    """Scale defined after the norm *and* residual' read before the quant: no valid place."""
    x, r, w = inputs(torch.float32)

    def f(x, r, w, s):
        y, new_r = V.fused_add_rms_norm(x, r, w, EPS)
        early = new_r * 2
        return V.static_scaled_fp8_quant(y, s.abs()), early

    p = RMSNormQuantFusionPass()
    check_pass(p, f, x, r, w, scale())
    assert p.matched_count == 0


@pytest.mark.parametrize("static,dynamic,expected", [(False, True, 1), (True, False, 1),
                                                     (False, False, 0)])
def test_config_switches_patterns(static, dynamic, expected):
    x, _, w = inputs(torch.float32)

    def f(x, w, s):
        return (V.static_scaled_fp8_quant(V.rms_norm(x, w, EPS), s),
                V.dynamic_per_token_scaled_fp8_quant(V.rms_norm(x * 2, w, EPS)))

    p = RMSNormQuantFusionPass(static=static, dynamic=dynamic)
    counts = check_pass(p, f, x, w, scale())
    assert p.matched_count == expected
    assert counts[V.rms_norm_static_fp8_quant.default] == int(static)
    assert counts[V.rms_norm_dynamic_per_token_fp8_quant.default] == int(dynamic)


def test_counts_accumulate_over_graphs():
    x, _, w = inputs(torch.float32)

    def f(x, w, s):
        return V.static_scaled_fp8_quant(V.rms_norm(x, w, EPS), s)

    p = RMSNormQuantFusionPass()
    for _ in range(2):
        apply(p, trace(f, x, w, scale()))
    apply(p, trace(lambda x: x + 1, x))
    assert (p.matched_count, p.total_matched) == (0, 2)
    p.reset_counts()
    assert (p.matched_count, p.total_matched, dict(p.pattern_counts)) == (0, 0, {})
