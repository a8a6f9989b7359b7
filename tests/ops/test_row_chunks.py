"""Row-wise kernels on rows wider than one block: RMSNorm, fused add+RMSNorm, the fused
norm+fp8 quant kernels and the per-token fp8 quant walk such rows in chunks (two or three
passes). Widths sit below, at and above the chunk size, mostly not powers of two, with the
production chunk (ROW_CHUNK) and with a small one that makes many ragged chunks cheaply."""
from __future__ import annotations

import pytest
import torch

from vgraph.ops import fused_quant as fq
from vgraph.ops.fp8 import dynamic_per_token_scaled_fp8_quant_reference
from vgraph.ops.kernels.common import ROW_CHUNK, row_block
from vgraph.ops.kernels.fp8 import dynamic_per_token_scaled_fp8_quant_triton
from vgraph.ops.kernels.norm import QUANT_DYNAMIC, QUANT_STATIC, rms_norm_triton
from vgraph.ops.norm import fused_add_rms_norm_reference, rms_norm_reference

from .tolerances import assert_close_rel, assert_fp8_within_one_step

# (width, max_block): below / at / above the production chunk, then many small ragged chunks.
WIDTHS = [
    pytest.param(ROW_CHUNK - 96, ROW_CHUNK, id="below"),
    pytest.param(ROW_CHUNK, ROW_CHUNK, id="at"),
    pytest.param(ROW_CHUNK + 1, ROW_CHUNK, id="one-past"),
    pytest.param(2 * ROW_CHUNK + 40, ROW_CHUNK, id="three-chunks"),
    pytest.param(1000, 128, id="small-chunks-ragged"),
    pytest.param(96, 32, id="small-chunks-exact"),
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("width,max_block,expected", [
    (8100, 8192, (8192, 8, True)), (8192, 8192, (8192, 8, True)), (8193, 8192, (8192, 8, False)),
    (16424, 8192, (8192, 8, False)), (96, 8192, (128, 1, True)), (1000, 128, (128, 1, False)),
    (1000, 100, (128, 1, False)),  # a cap that is not a power of two rounds up
])
def test_row_block(width, max_block, expected):
    assert row_block(width, max_block) == expected


def _inputs(width: int, dtype: torch.dtype, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    x = (2 * torch.randn(rows, width)).to(dtype)
    x[1, -1] = 40.0  # the row maximum in the last (partial) chunk
    return x, (1 + 0.1 * torch.randn(width)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,max_block", WIDTHS)
def test_rms_norm(kernel_device, width, max_block, dtype):
    x, w = _inputs(width, dtype)
    out = rms_norm_triton(x.to(kernel_device), w.to(kernel_device), 1e-6, max_block=max_block)
    assert_close_rel(out, rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,max_block", WIDTHS)
def test_fused_add_rms_norm(kernel_device, width, max_block, dtype):
    x, w = _inputs(width, dtype)
    r = torch.randn_like(x)
    y, new_r = rms_norm_triton(x.to(kernel_device), w.to(kernel_device), 1e-6,
                               residual=r.to(kernel_device), max_block=max_block)
    y_ref, r_ref = fused_add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(new_r.cpu(), r_ref), "the new residual is x + residual, rounded once"
    assert_close_rel(y, y_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,max_block", WIDTHS)
def test_fused_add_rms_norm_static_quant(kernel_device, width, max_block, dtype):
    x, w = _inputs(width, dtype)
    r, s = torch.randn_like(x), torch.tensor([0.02])
    q, new_r = rms_norm_triton(x.to(kernel_device), w.to(kernel_device), 1e-6,
                               residual=r.to(kernel_device), quant=QUANT_STATIC,
                               scale=s.to(kernel_device), max_block=max_block)
    q_ref, r_ref = fq.fused_add_rms_norm_static_fp8_quant_reference(x, r, w, s, 1e-6)
    assert torch.equal(new_r.cpu(), r_ref)
    assert_fp8_within_one_step(q, q_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,max_block", WIDTHS)
def test_rms_norm_dynamic_quant(kernel_device, width, max_block, dtype):
    x, w = _inputs(width, dtype)
    q, s = rms_norm_triton(x.to(kernel_device), w.to(kernel_device), 1e-6, quant=QUANT_DYNAMIC,
                           max_block=max_block)
    q_ref, s_ref = fq.rms_norm_dynamic_per_token_fp8_quant_reference(x, w, 1e-6)
    assert_fp8_within_one_step(q, q_ref, s, s_ref, input_dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,max_block", WIDTHS)
def test_dynamic_per_token_quant(kernel_device, width, max_block, dtype):
    x, _ = _inputs(width, dtype)
    q, s = dynamic_per_token_scaled_fp8_quant_triton(x.to(kernel_device), max_block=max_block)
    q_ref, s_ref = dynamic_per_token_scaled_fp8_quant_reference(x)
    assert_fp8_within_one_step(q, q_ref, s, s_ref, input_dtype=dtype)
    assert torch.equal(s.cpu()[1], s_ref[1]), "the maximum in the last chunk sets the scale"
