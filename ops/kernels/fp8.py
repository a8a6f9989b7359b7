"""fp8 (e4m3) quantization kernels: static per-tensor scale and dynamic per-token scale.

The dynamic kernel needs a row's absolute maximum before it can quantize any of it. A row no
wider than ``ROW_CHUNK`` is one block, read once; a wider row is walked in chunks twice
(amax, then quantize), since a whole-row block's registers grow with the width.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, ROW_CHUNK, next_pow2, quantize_fp8,
                     row_block, rows_and_width)

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
                                    BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    if WHOLE_ROW:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), axis=0) / fp8_max, min_scale)
        tl.store(scale_ptr + row, s)
        tl.store(out_ptr + base + cols, quantize_fp8(x, s, fp8_max).to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = tl.maximum(tl.max(amax, axis=0) / fp8_max, min_scale)
        tl.store(scale_ptr + row, s)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + base + cols,
                     quantize_fp8(x, s, fp8_max).to(out_ptr.dtype.element_ty), mask=mask)


def static_scaled_fp8_quant_triton(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x, dtype=FP8_DTYPE)
    n = x.numel()
    if n > 0:
        block = min(next_pow2(n), _MAX_BLOCK)
        _static_quant_kernel[(triton.cdiv(n, block),)](x, out, scale, n, FP8_MAX, BLOCK=block,
                                                       num_warps=4 if block >= 1024 else 1)
    return out


def dynamic_per_token_scaled_fp8_quant_triton(
        x: torch.Tensor, max_block: int = ROW_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization with a per-row scale. ``max_block`` caps the block over a row
    (rows wider than it are walked in chunks); tests lower it to reach that path cheaply."""
    x = x.contiguous()
    rows, width = rows_and_width(x)
    out = torch.empty_like(x, dtype=FP8_DTYPE)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if rows > 0 and width > 0:
        block, warps, whole_row = row_block(width, max_block)
        _dynamic_per_token_quant_kernel[(rows,)](x, out, scales, width, FP8_MAX, FP8_MIN_SCALE,
                                                 BLOCK=block, WHOLE_ROW=whole_row, num_warps=warps)
    return out, scales
