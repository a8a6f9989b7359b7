"""AllReduceRMSNormFusionPass: on post-grad-style graphs with a real 1-rank gloo group (the
custom-op, fp8 and plain-torch forms, and what must not fuse), then inside vgraph's backend
on a small tensor-parallel-shaped model (match counts per site, numerics, fusion off)."""
from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest
import torch

from tests.gloo_group import single_rank_group
from vgraph.ops.norm import fused_add_rms_norm_reference
from vgraph.passes import AllReduceRMSNormFusionPass, PassManager, default_passes

from . import EPS, V, apply, assert_outputs_match, op_counts, scale, trace

C10D = torch.ops._c10d_functional
ALL_REDUCE, WAIT = C10D.all_reduce.default, C10D.wait_tensor.default
AR_NORM = V.all_reduce_fused_add_rms_norm.default
AR_NORM_FP8 = V.all_reduce_fused_add_rms_norm_static_fp8_quant.default
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def group():
    with single_rank_group() as name:
        yield name


def inputs(dtype: torch.dtype = torch.float32, tokens: int = 5, hidden: int = 32):
    """A row-parallel partial x, the residual, the norm weight."""
    return (torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype),
            torch.randn(hidden, dtype=dtype))


def reduced(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    return C10D.wait_tensor(C10D.all_reduce(x, op, group))


def custom_form(group: str) -> Callable:
    def f(x, r, w):
        return V.fused_add_rms_norm(reduced(x, group), r, w, EPS)
    return f


def fuse_and_run(fn: Callable, *args: torch.Tensor, p=None):
    """(outputs after the pass, outputs of the unfused graph, the pass's matches per pattern)."""
    gm = trace(fn, *args)
    unfused = gm(*args)
    p = p or AllReduceRMSNormFusionPass()
    apply(p, gm)
    fused = gm(*args)
    assert_outputs_match(fused, unfused)
    return fused, unfused, dict(p.last_pattern_counts)


def assert_fused(fn: Callable, *args: torch.Tensor, target=AR_NORM, **pass_kwargs) -> Counter:
    p = AllReduceRMSNormFusionPass(**pass_kwargs)
    gm = apply(p, trace(fn, *args))
    assert p.matched_count == 1 and p.last_pattern_counts == {target._schema.name.split("::")[1]: 1}
    counts = op_counts(gm.graph)
    assert counts[target] == 1 and counts[ALL_REDUCE] == counts[WAIT] == 0
    assert counts[V.fused_add_rms_norm.default] == counts[torch.ops.aten.rsqrt.default] == 0
    assert_outputs_match(gm(*args), fn(*args))
    return counts


def fused_node(gm_graph: torch.fx.Graph) -> torch.fx.Node:
    return next(n for n in gm_graph.nodes if n.target in (AR_NORM, AR_NORM_FP8))


# ------------------------------------------------------------------ what fuses


@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_op_form(group, dtype):
    x, r, w = inputs(dtype)
    assert_fused(custom_form(group), x, r, w)
    gm = apply(AllReduceRMSNormFusionPass(), trace(custom_form(group), x, r, w))
    assert fused_node(gm.graph).args[-1] == group, "the matched all-reduce's group, by name"


def test_all_reduce_as_the_residual_operand(group):
    x, r, w = inputs()
    assert_fused(lambda x, r, w: V.fused_add_rms_norm(r, reduced(x, group), w, EPS), x, r, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual_read", [True, False], ids=["residual-read", "last-norm"])
def test_plain_torch_form(group, dtype, residual_read):
    x, r, w = inputs(dtype)

    def f(x, r, w):
        out, residual = fused_add_rms_norm_reference(reduced(x, group), r, w, EPS)
        return (out, residual * 2) if residual_read else out

    counts = assert_fused(f, x, r, w)
    assert counts[torch.ops.aten.pow.Tensor_Scalar] == counts[torch.ops.aten.mean.dim] == 0
    assert counts[torch.ops.aten.add.Tensor] == 0


def test_fp8_variant_after_the_norm_quant_fusion(group):
    """all-reduce -> add + RMSNorm -> static fp8 quant: RMSNormQuantFusionPass fuses the norm
    and the quant, then this pass takes the all-reduce in too (it runs last)."""
    x, r, w = inputs()

    def f(x, r, w, s):
        out, residual = V.fused_add_rms_norm(reduced(x, group), r, w, EPS)
        return V.static_scaled_fp8_quant(out, s), residual

    manager = PassManager(default_passes())
    gm = apply(manager, trace(f, x, r, w, scale()))
    assert manager.last_match_counts == {"RMSNormQuantFusionPass": 1, "SiluMulFusionPass": 0,
                                         "AllReduceRMSNormFusionPass": 1, "NormLinearFusionPass": 0}
    counts = op_counts(gm.graph)
    assert counts[AR_NORM_FP8] == 1 and counts[ALL_REDUCE] == 0
    assert counts[V.fused_add_rms_norm_static_fp8_quant.default] == 0
    assert fused_node(gm.graph).args[-1] == group
    assert_outputs_match(gm(x, r, w, scale()), f(x, r, w, scale()))


def test_static_fp8_decoder_through_every_pass(group):
    """A static-fp8 TP decoder's norm sites, L = 2: the first norm (after the embedding's
    all-reduce) fuses with its quant only; each o_proj/down_proj all-reduce with the add, norm
    and quant after it; the final norm feeds the unquantized lm_head, so it fuses without quant."""
    x, _, w = inputs()

    def f(x, w, s):
        h = reduced(x, group)                                              # vocab-parallel embedding
        residual, h = h, V.static_scaled_fp8_quant(V.rms_norm(h, w, EPS), s).float()
        for layer in range(2):
            if layer:
                h, residual = V.fused_add_rms_norm(reduced(h, group), residual, w, EPS)
                h = V.static_scaled_fp8_quant(h, s).float()                # qkv_proj input
            h, residual = V.fused_add_rms_norm(reduced(h * 0.5, group), residual, w, EPS)
            h = V.static_scaled_fp8_quant(h, s).float() * 0.25             # "MLP"
        return V.fused_add_rms_norm(reduced(h, group), residual, w, EPS)[0]

    manager = PassManager(default_passes())
    gm = apply(manager, trace(f, x, w, scale()))
    steps = {step.name: step.patterns for step in manager.history[-1].steps}
    assert steps["RMSNormQuantFusionPass"] == {"rms_norm_static_fp8_quant": 1,
                                               "fused_add_rms_norm_static_fp8_quant": 3}
    assert steps["AllReduceRMSNormFusionPass"] == {"all_reduce_fused_add_rms_norm_static_fp8_quant": 3,
                                                   "all_reduce_fused_add_rms_norm": 1}
    assert op_counts(gm.graph)[ALL_REDUCE] == 1  # the embedding's
    assert_outputs_match(gm(x, w, scale()), f(x, w, scale()))


def test_each_site_counts(group):
    """Two layers' row-parallel outputs, each all-reduced into the next norm: 2 per layer."""
    x, r, w = inputs()

    def f(x, r, w):
        h, residual = V.fused_add_rms_norm(reduced(x, group), r, w, EPS)
        for _ in range(3):
            h, residual = V.fused_add_rms_norm(reduced(h * 0.5, group), residual, w, EPS)
        return h, residual

    _, _, counts = fuse_and_run(f, x, r, w)
    assert counts == {"all_reduce_fused_add_rms_norm": 4}


# ------------------------------------------------------------------ what must not fuse


def _read_elsewhere(group):
    def f(x, r, w):
        ar = reduced(x, group)
        return V.fused_add_rms_norm(ar, r, w, EPS)[0], ar * 2
    return f


def _first_norm(group):
    """The vocab-parallel embedding's all-reduce: both the first norm's input (no residual
    add) and the first residual."""
    def f(x, r, w):
        h = reduced(x, group)
        return V.rms_norm(h, w, EPS), h
    return f


def _max(group):
    return lambda x, r, w: V.fused_add_rms_norm(reduced(x, group, "max"), r, w, EPS)


def _broadcast_residual(group):
    return lambda x, r, w: fused_add_rms_norm_reference(reduced(x, group), r[:1], w, EPS)


def _norm_over_tokens(group):
    def f(x, r, w):
        h = reduced(x, group) + r
        return w * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + EPS)), h
    return f


def _no_norm(group):
    return lambda x, r, w: (reduced(x, group) + r) * w


@pytest.mark.parametrize("make", [_read_elsewhere, _first_norm, _max, _broadcast_residual,
                                  _norm_over_tokens, _no_norm])
def test_no_match(group, make):
    x, r, w = inputs()
    _, _, counts = fuse_and_run(make(group), x, r, w)
    assert counts == {}


def test_plain_torch_off_leaves_the_plain_norm_to_inductor(group):
    x, r, w = inputs()
    f = lambda x, r, w: fused_add_rms_norm_reference(reduced(x, group), r, w, EPS)  # noqa: E731
    _, _, counts = fuse_and_run(f, x, r, w, p=AllReduceRMSNormFusionPass(plain_torch=False))
    assert counts == {}
    assert_fused(custom_form(group), x, r, w, plain_torch=False)


def test_uuid_has_its_setting_and_no_rank():
    assert AllReduceRMSNormFusionPass().uuid() == AllReduceRMSNormFusionPass().uuid()
    assert AllReduceRMSNormFusionPass().uuid() != AllReduceRMSNormFusionPass(plain_torch=False).uuid()
    assert AllReduceRMSNormFusionPass().config() == {"plain_torch": True}
