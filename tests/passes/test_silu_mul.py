"""SiluMulFusionPass on small post-grad graphs: plain-torch SwiGLU, + static quant, negatives."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vgraph.passes import SiluMulFusionPass

from . import V, apply, check_pass, op_counts, scale, trace

DTYPES = [torch.float32, torch.bfloat16]
ELEMENTWISE = (torch.ops.aten.neg.default, torch.ops.aten.exp.default,
               torch.ops.aten.div.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.slice.Tensor)


def packed(dtype: torch.dtype = torch.float32, d: int = 24) -> torch.Tensor:
    """A [gate | up] activation: 5 tokens, last dim 2*d."""
    return torch.randn(5, 2 * d, dtype=dtype)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def assert_fused(counts, silu_and_mul: int = 1, fused_quant: int = 0) -> None:
    assert counts[V.silu_and_mul.default] == silu_and_mul
    assert counts[V.silu_and_mul_static_fp8_quant.default] == fused_quant
    for op in ELEMENTWISE:
        assert counts[op] == 0, f"{op} left in the graph"


# ------------------------------------------------------------------ stage 1: plain torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_slices(dtype):
    p = SiluMulFusionPass()
    counts = check_pass(p, swiglu, packed(dtype))
    assert p.matched_count == 1 and p.pattern_counts == {"silu_and_mul": 1}
    assert_fused(counts)


@pytest.mark.parametrize("split", [
    pytest.param(lambda x: x.chunk(2, -1), id="chunk"),
    pytest.param(lambda x: x.split([x.shape[-1] // 2] * 2, dim=-1), id="split_with_sizes"),
    pytest.param(lambda x: (x[:, :x.shape[1] // 2], x[:, x.shape[1] // 2:]), id="positive-dim"),
])
def test_other_spellings_of_the_halves(split):
    def f(x):
        gate, up = split(x)
        return up * F.silu(gate)  # operands swapped as well

    p = SiluMulFusionPass()
    counts = check_pass(p, f, packed(torch.bfloat16))
    assert p.matched_count == 1
    assert counts[V.silu_and_mul.default] == 1 and counts[torch.ops.aten.mul.Tensor] == 0


def test_sigmoid_spelling():
    def f(x):
        d = x.shape[-1] // 2
        g = x[..., :d]
        return (g * torch.sigmoid(g)) * x[..., d:]

    p = SiluMulFusionPass()
    check_pass(p, f, packed())
    assert p.matched_count == 1


def test_halves_also_used_elsewhere_stay():
    """The slices have other readers: fused anyway, and the slices remain for those readers."""
    def f(x):
        d = x.shape[-1] // 2
        return swiglu(x), x[..., :d] + x[..., d:]

    p = SiluMulFusionPass()
    counts = check_pass(p, f, packed())
    assert p.matched_count == 1 and counts[torch.ops.aten.slice.Tensor] == 2


def test_three_dims_and_several_sites():
    def f(x):
        return swiglu(x) + swiglu(x * 2), swiglu(x.flip(-1))

    p = SiluMulFusionPass()
    counts = check_pass(p, f, torch.randn(2, 3, 16))
    assert p.matched_count == 3 and counts[V.silu_and_mul.default] == 3


# ------------------------------------------------------------------ stage 2: + static quant


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_op_then_static_quant(dtype):
    def f(x, s):
        return V.static_scaled_fp8_quant(V.silu_and_mul(x), s)

    p = SiluMulFusionPass()
    counts = check_pass(p, f, packed(dtype), scale())
    assert p.matched_count == 1 and p.pattern_counts == {"silu_and_mul_static_fp8_quant": 1}
    assert_fused(counts, silu_and_mul=0, fused_quant=1)
    assert counts[V.static_scaled_fp8_quant.default] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_torch_then_static_quant_ends_fully_fused(dtype):
    def f(x, s):
        return V.static_scaled_fp8_quant(swiglu(x), s)

    p = SiluMulFusionPass()
    counts = check_pass(p, f, packed(dtype), scale())
    assert p.matched_count == 2
    assert p.pattern_counts == {"silu_and_mul": 1, "silu_and_mul_static_fp8_quant": 1}
    assert_fused(counts, silu_and_mul=0, fused_quant=1)


def test_quant_stage_can_be_switched_off():
    def f(x, s):
        return V.static_scaled_fp8_quant(swiglu(x), s)

    p = SiluMulFusionPass(quant=False)
    counts = check_pass(p, f, packed(), scale())
    assert p.pattern_counts == {"silu_and_mul": 1}
    assert counts[V.silu_and_mul.default] == 1 and counts[V.static_scaled_fp8_quant.default] == 1


# ------------------------------------------------------------------ must not match


def _assert_untouched(f, *inputs) -> None:
    p = SiluMulFusionPass()
    counts = check_pass(p, f, *inputs)
    assert p.matched_count == 0
    assert counts[V.silu_and_mul.default] == 0
    assert counts[V.silu_and_mul_static_fp8_quant.default] == 0


def test_slice_not_at_half():
    x = torch.randn(5, 48)
    _assert_untouched(lambda x: F.silu(x[..., :20]) * x[..., 20:40], x)
    _assert_untouched(lambda x: F.silu(x[..., :24]) * x[..., 23:47], x)
    _assert_untouched(lambda x: F.silu(x[..., :24]) * x[..., 25:], torch.randn(5, 49))


def test_halves_swapped():
    _assert_untouched(lambda x: F.silu(x[..., 24:]) * x[..., :24], packed())


def test_halves_of_different_tensors():
    _assert_untouched(lambda x, y: F.silu(x[..., :24]) * y[..., 24:], packed(), packed())


def test_cut_on_another_dim():
    _assert_untouched(lambda x: F.silu(x[:3]) * x[3:], torch.randn(6, 8))


def test_silu_output_also_used_elsewhere():
    def f(x):
        a = F.silu(x[..., :24])
        return a * x[..., 24:], a

    _assert_untouched(f, packed())


def test_silu_kept_in_fp32_for_bf16_input():
    """A silu whose result stays fp32 is not what silu_and_mul computes in bf16."""
    _assert_untouched(lambda x: (F.silu(x[..., :24].float()) * x[..., 24:]).to(x.dtype),
                      packed(torch.bfloat16))


def test_silu_and_mul_read_before_quant_elsewhere():
    def f(x, s):
        a = V.silu_and_mul(x)
        return V.static_scaled_fp8_quant(a, s), a

    p = SiluMulFusionPass()
    counts = check_pass(p, f, packed(), scale())
    assert p.matched_count == 0 and counts[V.silu_and_mul_static_fp8_quant.default] == 0
    assert counts[V.silu_and_mul.default] == 1 and counts[V.static_scaled_fp8_quant.default] == 1


def test_symbolic_last_dim_is_left_alone():
    """With the last dim symbolic, 'd is half of it' is not provable: no match, no guard."""
    p = SiluMulFusionPass()
    gm = apply(p, trace(swiglu, packed(), symbolic=True))
    assert p.matched_count == 0 and op_counts(gm.graph)[V.silu_and_mul.default] == 0
