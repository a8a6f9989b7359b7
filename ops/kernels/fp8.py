"""fp8 (e4m3) quantization kernels: static per-tensor scale and dynamic per-token scale."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP8_DTYPE, quantize_fp8, FP8_MAX, FP8_MIN_SCALE, next_pow2, row_block, rows_and_width

_MAX_BLOCK = 4096


@triton.jit
def _static_quant_kernel(x_ptr, out_ptr, scale_ptr, n, fp8_max, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = quantize_fp8(x, tl.load(scale_ptr), fp8_max)
    tl.store(out_ptr + offs, q.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dynamic_per_token_quant_kernel(x_ptr, out_ptr, scale_ptr, n_cols, fp8_max, min_scale,
                                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0) / fp8_max, min_scale)
    tl.store(scale_ptr + row, s)
    q = quantize_fp8(x, s, fp8_max)
    tl.store(out_ptr + row * n_cols + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


def static_scaled_fp8_quant_triton(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x, dtype=FP8_DTYPE)
    n = x.numel()
    if n > 0:
        block = min(next_pow2(n), _MAX_BLOCK)
        _static_quant_kernel[(triton.cdiv(n, block),)](x, out, scale, n, FP8_MAX, BLOCK=block,
                                                       num_warps=4 if block >= 1024 else 1)
    return out


def dynamic_per_token_scaled_fp8_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    rows, width = rows_and_width(x)
    out = torch.empty_like(x, dtype=FP8_DTYPE)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if rows > 0 and width > 0:
        block, warps = row_block(width)
        _dynamic_per_token_quant_kernel[(rows,)](x, out, scales, width, FP8_MAX, FP8_MIN_SCALE,
                                                 BLOCK=block, num_warps=warps)
    return out, scales
