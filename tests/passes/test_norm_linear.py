"""NormLinearFusionPass on small post-grad graphs: what fuses, what must not, numerics (the
fused ops' CPU implementation is the two ops in turn, so outputs must agree to rounding)."""
from __future__ import annotations

import pytest
import torch

from vgraph.passes import NormLinearFusionPass, PassManager, default_passes
from vgraph.passes.norm_linear import NARROW_ROWS

from . import EPS, V, apply, check_pass, op_counts, trace

DTYPES = [torch.float32, torch.bfloat16]
UNFUSED = (V.rms_norm.default, V.fused_add_rms_norm.default, V.linear.default, V.linear_silu_and_mul.default)


def inputs(dtype: torch.dtype, tokens: int = 3, hidden: int = 32, out: int = 24):
    """x, residual, norm weight, projection weight, bias."""
    return (torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype),
            torch.randn(hidden, dtype=dtype), torch.randn(out, hidden, dtype=dtype) / hidden ** 0.5,
            torch.randn(out, dtype=dtype))


def assert_only(counts, fused: dict, **unfused) -> None:
    for op, n in fused.items():
        assert counts[op] == n, f"{op}: {counts[op]} != {n}"
    for op in UNFUSED:
        assert counts[op] == unfused.get(op._opname, 0), op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_rms_norm_then_projection(dtype, silu_mul):
    x, _, nw, w, b = inputs(dtype)
    project = V.linear_silu_and_mul if silu_mul else V.linear

    def f(x, nw, w, b):
        return project(V.rms_norm(x, nw, EPS), w, b)

    p = NormLinearFusionPass()
    counts = check_pass(p, f, x, nw, w, b)
    assert p.pattern_counts == {"rms_norm_linear": 1}
    assert_only(counts, {V.rms_norm_linear.default: 1})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_fused_add_rms_norm_then_projection_keeps_the_residual(dtype, silu_mul):
    x, r, nw, w, b = inputs(dtype)
    project = V.linear_silu_and_mul if silu_mul else V.linear

    def f(x, r, nw, w, b):
        normed, new_r = V.fused_add_rms_norm(x, r, nw, EPS)
        return project(normed, w, None), new_r * 3

    p = NormLinearFusionPass()
    counts = check_pass(p, f, x, r, nw, w, b)
    assert p.pattern_counts == {"fused_add_rms_norm_linear": 1}
    assert_only(counts, {V.fused_add_rms_norm_linear.default: 1})


def test_a_decoder_layer_fuses_both_norms():
    """Input norm -> qkv, post-attention norm -> gate_up, as a Llama layer reads them; the
    residual stream threads through both fused ops."""
    x, r, nw, _, _ = inputs(torch.float32)
    qkv, gate_up, down = torch.randn(48, 32), torch.randn(64, 32), torch.randn(32, 32)

    def f(x, r, nw, qkv, gate_up, down):
        h, r = V.fused_add_rms_norm(x, r, nw, EPS)
        attn = V.linear(h, qkv, None)[:, :32]
        h, r = V.fused_add_rms_norm(attn, r, nw, EPS)
        return V.linear(V.linear_silu_and_mul(h, gate_up, None), down, None), r

    p = NormLinearFusionPass()
    counts = check_pass(p, f, x, r, nw, qkv, gate_up, down)
    assert p.pattern_counts == {"fused_add_rms_norm_linear": 2}
    assert_only(counts, {V.fused_add_rms_norm_linear.default: 2}, linear=1)


def test_a_norm_read_twice_is_left_alone():
    """A LoRA adapter (or anything) also reading the normed row: the norm must run anyway."""
    x, _, nw, w, b = inputs(torch.float32)

    def f(x, nw, w, b):
        h = V.rms_norm(x, nw, EPS)
        return V.linear(h, w, b), h * 2

    p = NormLinearFusionPass()
    counts = check_pass(p, f, x, nw, w, b)
    assert p.matched_count == 0
    assert counts[V.rms_norm.default] == 1 and counts[V.linear.default] == 1


def test_the_norm_as_the_weight_argument_is_left_alone():
    x, _, nw, _, _ = inputs(torch.float32)

    def f(x, nw):
        return V.linear(x, V.rms_norm(x, nw, EPS), None)

    counts = op_counts(apply(NormLinearFusionPass(), trace(f, x, nw)).graph)
    assert counts[V.rms_norm.default] == 1 and counts[V.rms_norm_linear.default] == 0


@pytest.mark.parametrize("with_residual", [False, True])
def test_the_normed_row_as_input_and_weight_is_left_alone(with_residual):
    """``linear(h, h)``: one user that takes the normed row twice; fusing would leave the
    weight argument reading an erased node."""
    x, r, nw, _, _ = inputs(torch.float32, tokens=32, hidden=32)

    def f(x, r, nw):
        h = V.fused_add_rms_norm(x, r, nw, EPS)[0] if with_residual else V.rms_norm(x, nw, EPS)
        return V.linear(h, h, None)

    p = NormLinearFusionPass()
    counts = check_pass(p, f, x, r, nw)
    assert p.matched_count == 0 and counts[V.linear.default] == 1


def test_a_residual_read_before_the_projection_with_a_late_weight():
    """The projection's weight is computed after the norm and the new residual is read in
    between: no place exists for the fused op, so nothing changes."""
    x, r, nw, w, _ = inputs(torch.float32)

    def f(x, r, nw, w):
        normed, new_r = V.fused_add_rms_norm(x, r, nw, EPS)
        early = new_r + 1
        return V.linear(normed, w * early.sum(), None), early

    p = NormLinearFusionPass()
    counts = check_pass(p, f, x, r, nw, w)
    assert p.matched_count == 0 and counts[V.fused_add_rms_norm.default] == 1


def test_a_default_pass_for_narrow_rows_and_loadable_by_spec():
    """Default for rows of at most NARROW_ROWS (module doc); any width by the spec users give --pass."""
    assert [p.max_width for p in default_passes() if isinstance(p, NormLinearFusionPass)] == [NARROW_ROWS]
    from vgraph.passes import load_pass
    assert isinstance(load_pass("vgraph.passes.norm_linear:NormLinearFusionPass"), NormLinearFusionPass)
    manager = PassManager([NormLinearFusionPass()])
    x, _, nw, w, b = inputs(torch.float32)
    gm = trace(lambda x, nw, w, b: V.linear(V.rms_norm(x, nw, EPS), w, b), x, nw, w, b)
    manager(gm.graph)
    assert manager.match_counts() == {"NormLinearFusionPass": 1}


@pytest.mark.parametrize("width,fused", [(NARROW_ROWS, True), (NARROW_ROWS + 8, False)])
def test_a_width_limit_fuses_only_rows_that_narrow(width, fused):
    x, nw, w, b = torch.randn(2, width), torch.randn(width), torch.randn(24, width), torch.randn(24)
    p = NormLinearFusionPass(max_width=NARROW_ROWS)
    gm = trace(lambda x, nw, w, b: V.linear(V.rms_norm(x, nw, EPS), w, b), x, nw, w, b)
    counts = op_counts(apply(p, gm).graph)
    assert p.matched_count == int(fused)
    assert counts[V.rms_norm_linear.default] == int(fused) and counts[V.rms_norm.default] == int(not fused)
    assert NormLinearFusionPass(max_width=1).uuid() != NormLinearFusionPass().uuid()
