"""``vgraph::linear`` / ``vgraph::linear_silu_and_mul``, the RMSNorm-fused forms
(``vgraph::rms_norm_linear``, ``vgraph::fused_add_rms_norm_linear``) and the one-row GEMV kernels
behind their CUDA implementations (interpreted on CPU, compiled on a GPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vgraph.ops import dense_linear
from vgraph.ops.kernels.gemv import (GemvConfig, NormPrologue, config_for, gemv_silu_mul_triton, gemv_triton,
                                     rms_norm_gemv_triton)
from vgraph.ops.norm import fused_add_rms_norm_reference, rms_norm_reference

# Small shapes through each launch configuration config_for can pick: rows that do not fill
# the last program, K that does and does not divide the block.
CONFIGS = [GemvConfig(16, 256, 4), GemvConfig(16, 1024, 8), GemvConfig(8, 1024, 8), GemvConfig(8, 512, 4),
           GemvConfig(4, 1024, 4)]
SHAPES = [(37, 300), (64, 1024), (20, 512 + 96)]


def _case(n: int, k: int, device: str, dtype: torch.dtype, bias: bool, rows: int = 1):
    x = torch.randn(rows, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (x, w, b), (on(x), on(w), on(b))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}w{c.num_warps}")
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_matches_f_linear(kernel_device, config, n, k, bias, rows):
    (x, w, b), args = _case(n, k, kernel_device, torch.float32, bias, rows)
    got = gemv_triton(*args, config=config)
    torch.testing.assert_close(got.cpu(), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", CONFIGS[3:], ids=lambda c: f"n{c.block_n}k{c.block_k}w{c.num_warps}")
@pytest.mark.parametrize("n,k", [(38, 300), (64, 1024)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
def test_fused_swiglu_matches_projection_then_activation(kernel_device, config, n, k, bias, rows):
    (x, w, b), args = _case(n, k, kernel_device, torch.float32, bias, rows)
    got = gemv_silu_mul_triton(*args, config=config)
    assert got.shape == (rows, n // 2)
    torch.testing.assert_close(got.cpu(), dense_linear.linear_silu_and_mul_reference(x, w, b), atol=1e-4, rtol=1e-4)


def test_bf16_rounds_the_projection_as_the_unfused_pair_does(kernel_device):
    """The fused kernel rounds gate and up to bf16 before the activation, as the projection's
    bf16 output is rounded before ``silu_and_mul``: no drift between batch 1 and larger batches
    beyond the projection's own summation order."""
    (x, w, _), args = _case(64, 512, kernel_device, torch.bfloat16, False)
    gate_up = F.linear(x.float(), w.float()).to(torch.bfloat16).float()
    expected = (F.silu(gate_up[:, :32]) * gate_up[:, 32:]).to(torch.bfloat16)
    torch.testing.assert_close(gemv_silu_mul_triton(*args).cpu(), expected, atol=2e-2, rtol=2e-2)


def test_config_for_each_branch():
    assert config_for(28672, 4096) == GemvConfig(16, 256, 4)     # many rows: gate_up, heads
    assert config_for(4096, 14336) == GemvConfig(16, 1024, 8)    # long rows: down
    assert config_for(4096, 14336, rows=2) == GemvConfig(8, 1024, 8)  # two accumulators: half the rows
    assert config_for(6144, 4096) == GemvConfig(8, 512, 4)       # qkv, o of an 8B
    assert config_for(1152, 896) == GemvConfig(4, 1024, 4)       # a 0.5B's small projections


@pytest.mark.parametrize("rows,weight,dtype,expected", [
    (1, (96, 64), torch.bfloat16, True),
    (1, (96, 64), torch.float16, True),
    (1, (28672, 4096), torch.bfloat16, True),     # one row: every projection
    (2, (1152, 896), torch.bfloat16, True),       # two rows (batch 2): small weights
    (2, (896, 4864), torch.bfloat16, True),
    (2, (6144, 4096), torch.bfloat16, False),     # ... not an 8B's: the library won there
    (2, (896, 8192), torch.bfloat16, False),
    (3, (96, 64), torch.bfloat16, False),         # a batch: the library
    (1, (96, 64), torch.float32, False),          # fp32: the library (the kernel was measured at 16 bits)
])
def test_which_calls_take_the_kernel(rows, weight, dtype, expected):
    x, w = torch.zeros(rows, weight[1], dtype=dtype, device="meta"), torch.zeros(weight, dtype=dtype, device="meta")
    assert dense_linear.takes_gemv(x, w) is expected


def test_heads_and_strided_rows_stay_with_the_library():
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device="meta")
    head = torch.zeros(dense_linear.LIBRARY_FROM_ROWS, 64, dtype=torch.bfloat16, device="meta")
    assert not dense_linear.takes_gemv(x, head)
    assert not dense_linear.takes_gemv(torch.zeros(1, 128, dtype=torch.bfloat16)[:, ::2],
                                       torch.zeros(96, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 3])
def test_ops_on_cpu_are_the_references(rows):
    x, w, b = torch.randn(rows, 48), torch.randn(40, 48), torch.randn(40)
    torch.testing.assert_close(torch.ops.vgraph.linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(torch.ops.vgraph.linear(x, w, None), F.linear(x, w))
    torch.testing.assert_close(torch.ops.vgraph.linear_silu_and_mul(x, w, b),
                               F.silu(F.linear(x, w, b)[:, :20]) * F.linear(x, w, b)[:, 20:])


def test_opcheck():
    x, w, b = torch.randn(2, 48), torch.randn(40, 48), torch.randn(40)
    torch.library.opcheck(torch.ops.vgraph.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.vgraph.linear_silu_and_mul.default, (x, w, None))


def test_the_kernels_refuse_a_batch():
    with pytest.raises(ValueError, match="1 or 2"):
        gemv_triton(torch.randn(3, 8), torch.randn(4, 8))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="weight"):
        torch.ops.vgraph.linear(torch.randn(1, 8), torch.randn(4, 9), None)
    with pytest.raises(ValueError, match="even"):
        torch.ops.vgraph.linear_silu_and_mul(torch.randn(1, 8), torch.randn(5, 8), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_cuda_ops_agree_with_the_library(rows):
    """On the GPU, one or two rows take the kernel and more rows the library; both agree with it."""
    x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1152, 896, device="cuda", dtype=torch.bfloat16) / 30
    b = torch.randn(1152, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(torch.ops.vgraph.linear(x, w, b), F.linear(x, w, b), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(torch.ops.vgraph.linear_silu_and_mul(x, w, b),
                               torch.ops.vgraph.silu_and_mul(F.linear(x, w, b)), atol=2e-2, rtol=2e-2)


def _norm_case(rows: int, n: int, k: int, dtype: torch.dtype, residual: bool, silu_mul: bool):
    x = torch.randn(rows, k, dtype=dtype)
    r = torch.randn(rows, k, dtype=dtype) if residual else None
    norm_w = (1 + 0.1 * torch.randn(k)).to(dtype)
    w = (torch.randn(2 * n if silu_mul else n, k) / k ** 0.5).to(dtype)
    return x, r, norm_w, w, torch.randn(w.shape[0], dtype=dtype)


def _unfused(x, r, norm_w, w, b, silu_mul):
    """The norm then the projection, by the references: what the fused forms must compute."""
    normed, new_r = (rms_norm_reference(x, norm_w, 1e-6), None) if r is None else \
        fused_add_rms_norm_reference(x, r, norm_w, 1e-6)
    out = dense_linear.linear_silu_and_mul_reference(normed, w, b) if silu_mul else F.linear(normed, w, b)
    return out, new_r


@pytest.mark.parametrize("config", [None, GemvConfig(4, 256, 4)], ids=["default", "n4k256"])
@pytest.mark.parametrize("n,k", [(37, 300), (20, 512 + 96)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_prologue_matches_the_norm_then_the_projection(kernel_device, config, n, k, residual, silu_mul,
                                                            rows, dtype):
    """The kernel normalizes each row itself (sums of squares over K slices, the norm kernel's
    roundings); program 0 writes the new residual, bit for bit ``x + residual``."""
    x, r, norm_w, w, b = _norm_case(rows, n, k, dtype, residual, silu_mul)
    on = lambda t: None if t is None else t.to(kernel_device)  # noqa: E731
    got, new_r = rms_norm_gemv_triton(on(x), NormPrologue(on(norm_w), 1e-6, on(r)), on(w), on(b), silu_mul, config)
    expected, expected_r = _unfused(x, r, norm_w, w, b, silu_mul)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)
    assert (new_r is None) == (r is None)
    if r is not None:
        assert torch.equal(new_r.cpu(), expected_r)


def test_norm_prologue_reads_a_strided_norm_weight(kernel_device):
    """The norm kernel takes any 1-D weight (it makes it contiguous); so does the prologue."""
    x, r, _, w, b = _norm_case(1, 20, 300, torch.float32, True, False)
    norm_w = (1 + 0.1 * torch.randn(600))[::2]
    on = lambda t: t.to(kernel_device)  # noqa: E731
    got, _ = rms_norm_gemv_triton(on(x), NormPrologue(on(norm_w), 1e-6, on(r)), on(w), on(b))
    torch.testing.assert_close(got.cpu(), _unfused(x, r, norm_w, w, b, False)[0], atol=1e-4, rtol=1e-4)


def test_norm_prologue_refuses_mismatched_inputs():
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="norm wants"):
        rms_norm_gemv_triton(x, NormPrologue(torch.ones(15), 1e-6), w)
    with pytest.raises(ValueError, match="norm wants"):
        rms_norm_gemv_triton(x, NormPrologue(torch.ones(16), 1e-6, torch.randn(2, 16)), w)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_gemv_triton(torch.randn(1, 32)[:, ::2], NormPrologue(torch.ones(16), 1e-6), w)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_norm_linear_ops_on_cpu_are_the_two_ops(rows, silu_mul):
    x, r, norm_w, w, b = _norm_case(rows, 20, 48, torch.float32, True, silu_mul)
    expected, expected_r = _unfused(x, None, norm_w, w, b, silu_mul)
    torch.testing.assert_close(torch.ops.vgraph.rms_norm_linear(x, norm_w, 1e-6, w, b, silu_mul), expected)
    (expected, expected_r) = _unfused(x, r, norm_w, w, b, silu_mul)
    out, new_r = torch.ops.vgraph.fused_add_rms_norm_linear(x, r, norm_w, 1e-6, w, b, silu_mul)
    torch.testing.assert_close(out, expected)
    assert torch.equal(new_r, expected_r)


def test_norm_linear_opcheck_and_bad_shapes():
    x, r, norm_w, w, b = _norm_case(2, 20, 48, torch.float32, True, True)
    torch.library.opcheck(torch.ops.vgraph.rms_norm_linear.default, (x, norm_w, 1e-6, w, b, True))
    torch.library.opcheck(torch.ops.vgraph.fused_add_rms_norm_linear.default, (x, r, norm_w, 1e-6, w, None, False))
    with pytest.raises(ValueError, match="norm weight"):
        torch.ops.vgraph.rms_norm_linear(x, torch.ones(47), 1e-6, w, b, True)
    with pytest.raises(ValueError, match="even"):
        torch.ops.vgraph.rms_norm_linear(x, norm_w, 1e-6, torch.randn(5, 48), None, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_cuda_norm_linear_ops_agree_with_the_two_ops(rows, silu_mul):
    """One or two rows run the norm inside the GEMV, more rows the norm kernel then the
    projection's own path; both agree with the unfused pair, and the residual is exact."""
    x, r, norm_w, w, b = (t.cuda() for t in _norm_case(rows, 576, 896, torch.bfloat16, True, silu_mul))
    normed, expected_r = torch.ops.vgraph.fused_add_rms_norm(x, r, norm_w, 1e-6)
    project = torch.ops.vgraph.linear_silu_and_mul if silu_mul else torch.ops.vgraph.linear
    out, new_r = torch.ops.vgraph.fused_add_rms_norm_linear(x, r, norm_w, 1e-6, w, b, silu_mul)
    torch.testing.assert_close(out, project(normed, w, b), atol=2e-2, rtol=2e-2)
    assert torch.equal(new_r, expected_r)
    torch.testing.assert_close(torch.ops.vgraph.rms_norm_linear(x, norm_w, 1e-6, w, b, silu_mul),
                               project(torch.ops.vgraph.rms_norm(x, norm_w, 1e-6), w, b), atol=2e-2, rtol=2e-2)

