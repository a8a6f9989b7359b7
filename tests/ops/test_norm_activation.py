"""RMSNorm and SiLU-and-mul: opcheck, reference semantics, and Triton kernels vs reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vgraph.ops.activation import silu_and_mul_reference
from vgraph.ops.kernels.activation import silu_and_mul_triton
from vgraph.ops.kernels.norm import rms_norm_triton
from vgraph.ops.norm import fused_add_rms_norm_reference, rms_norm_reference

from .tolerances import assert_close_rel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 96), (7, 1000), (3, 5, 128), (2, 4096)]


def _inputs(shape, dtype):
    x = torch.randn(shape, dtype=dtype)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    return x, w


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_opcheck_norm(shape):
    x, w = _inputs(shape, torch.float32)
    torch.library.opcheck(torch.ops.vgraph.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.vgraph.fused_add_rms_norm.default, (x, torch.randn_like(x), w, 1e-6))


def test_opcheck_silu_and_mul():
    torch.library.opcheck(torch.ops.vgraph.silu_and_mul.default, (torch.randn(5, 2 * 96),))


def test_rms_norm_reference_matches_hf_formula():
    # Hugging Face's LlamaRMSNorm: upcast, normalize, cast back, then multiply by the weight.
    x, w = _inputs((4, 96), torch.bfloat16)
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(torch.ops.vgraph.rms_norm(x, w, 1e-5), hf)


def test_fused_add_rms_norm_returns_sum_as_residual():
    x, w = _inputs((4, 96), torch.float32)
    r = torch.randn_like(x)
    y, new_r = torch.ops.vgraph.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(new_r, x + r)
    assert torch.equal(y, rms_norm_reference(x + r, w, 1e-6))


def test_silu_and_mul_reference_is_swiglu():
    x = torch.randn(3, 2 * 80)
    assert torch.equal(torch.ops.vgraph.silu_and_mul(x), F.silu(x[:, :80]) * x[:, 80:])


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="gate | up"):
        torch.ops.vgraph.silu_and_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_kernel(kernel_device, shape, dtype):
    x, w = _inputs(shape, dtype)
    out = rms_norm_triton(x.to(kernel_device), w.to(kernel_device), 1e-6)
    assert out.dtype == dtype
    assert_close_rel(out, rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_kernel(kernel_device, shape, dtype):
    x, w = _inputs(shape, dtype)
    r = torch.randn(shape, dtype=dtype)
    r_dev = r.to(kernel_device)
    y, new_r = rms_norm_triton(x.to(kernel_device), w.to(kernel_device), 1e-6, residual=r_dev)
    y_ref, r_ref = fused_add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(r_dev.cpu(), r), "the input residual must not be modified"
    assert_close_rel(new_r, r_ref)
    assert_close_rel(y, y_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 96), (7, 2 * 1000), (3, 5, 2 * 128), (2, 2 * 5000)])
def test_silu_and_mul_kernel(kernel_device, shape, dtype):
    x = torch.randn(shape, dtype=dtype)
    out = silu_and_mul_triton(x.to(kernel_device))
    assert_close_rel(out, silu_and_mul_reference(x))


def test_empty_batch(kernel_device):
    x, w = _inputs((0, 96), torch.float32)
    assert rms_norm_triton(x.to(kernel_device), w.to(kernel_device), 1e-6).shape == (0, 96)
    assert silu_and_mul_triton(torch.randn(0, 8).to(kernel_device)).shape == (0, 4)
