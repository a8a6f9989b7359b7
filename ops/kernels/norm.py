"""RMSNorm kernels: plain, with residual add, and with fp8 quantization fused on the output.

One kernel body covers all variants (constexpr switches), so the fused ops compute exactly
what the unfused sequence computes: normalize in fp32, round to the activation dtype,
multiply by the weight, round again, then (if asked) quantize that rounded value to fp8.

A row no wider than ``ROW_CHUNK`` is one block, read once. A wider row is walked in chunks
(``WHOLE_ROW`` false), since a whole-row block's registers grow with the width (see
``ROW_CHUNK``): pass 1 sums the
squares (and writes the new residual), pass 2 normalizes and stores; the dynamic-quant
variant inserts a pass for the row's absolute maximum before it can quantize. Later passes
recompute ``x + residual`` from the inputs rather than reading back the residual this
program just wrote, so no pass depends on the ordering of its own global stores.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import (FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, ROW_CHUNK, cast_rne, pdl_enter, pdl_launch,
                     quantize_fp8, row_block, rows_and_width)

QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC = 0, 1, 2


@triton.jit
def _load_input(x_ptr, res_ptr, res_out_ptr, offs, mask,
                HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr):
    """The normalized input at ``offs`` in fp32: x, or x + residual rounded to the activation
    dtype as torch's add rounds it (stored as the new residual when STORE_RESIDUAL)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = cast_rne(x.to(tl.float32) + r, x_ptr.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(res_out_ptr + offs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _normalize(x, rstd, w_ptr, cols, mask, ACT_TY: tl.constexpr):
    """``weight * (x * rstd)``, rounding to the activation dtype ACT_TY where torch does
    (the weight's dtype may differ); fp32 out."""
    y = cast_rne(x * rstd, ACT_TY).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return cast_rne(y * w, ACT_TY).to(tl.float32)


@triton.jit
def _store_output(out_ptr, offs, mask, y, s, fp8_max, QUANT: tl.constexpr):
    if QUANT == 0:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offs, quantize_fp8(y, s, fp8_max).to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _rms_norm_whole_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, row, base,
                        n_cols, eps, fp8_max, fp8_min_scale,
                        HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = base + cols
    x = _load_input(x_ptr, res_ptr, res_out_ptr, offs, mask, HAS_RESIDUAL, True)
    y = _normalize(x, 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps), w_ptr, cols, mask,
                   x_ptr.dtype.element_ty)
    s = 1.0
    if QUANT == 1:
        s = tl.load(scale_ptr)
    elif QUANT == 2:
        s = tl.maximum(tl.max(tl.abs(y), axis=0) / fp8_max, fp8_min_scale)
        tl.store(scale_ptr + row, s)
    _store_output(out_ptr, offs, mask, y, s, fp8_max, QUANT)


@triton.jit
def _rms_norm_chunked(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, row, base,
                      n_cols, eps, fp8_max, fp8_min_scale,
                      HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr):
    sum_sq = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = _load_input(x_ptr, res_ptr, res_out_ptr, base + cols, cols < n_cols, HAS_RESIDUAL, True)
        sum_sq += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
    s = 1.0
    if QUANT == 1:
        s = tl.load(scale_ptr)
    elif QUANT == 2:
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = _load_input(x_ptr, res_ptr, res_out_ptr, base + cols, mask, HAS_RESIDUAL, False)
            y = _normalize(x, rstd, w_ptr, cols, mask, x_ptr.dtype.element_ty)
            amax = tl.maximum(amax, tl.abs(y))
        s = tl.maximum(tl.max(amax, axis=0) / fp8_max, fp8_min_scale)
        tl.store(scale_ptr + row, s)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = _load_input(x_ptr, res_ptr, res_out_ptr, base + cols, mask, HAS_RESIDUAL, False)
        y = _normalize(x, rstd, w_ptr, cols, mask, x_ptr.dtype.element_ty)
        _store_output(out_ptr, base + cols, mask, y, s, fp8_max, QUANT)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
                     n_cols, eps, fp8_max, fp8_min_scale,
                     HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                     WHOLE_ROW: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols  # int64: rows x width passes 2^31 for long batches of wide rows
    if WHOLE_ROW:
        _rms_norm_whole_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, row, base,
                            n_cols, eps, fp8_max, fp8_min_scale, HAS_RESIDUAL, QUANT, BLOCK)
    else:
        _rms_norm_chunked(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, row, base,
                          n_cols, eps, fp8_max, fp8_min_scale, HAS_RESIDUAL, QUANT, BLOCK)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: Optional[torch.Tensor] = None, quant: int = QUANT_NONE,
                    scale: Optional[torch.Tensor] = None, max_block: int = ROW_CHUNK):
    """Launches the RMSNorm kernel; returns what the matching vgraph op returns.

    ``max_block`` caps the block over a row (rows wider than it are walked in chunks); the
    ops use the default, tests lower it to reach the chunked path on small rows.
    """
    x = x.contiguous()
    rows, width = rows_and_width(x)
    out = torch.empty_like(x, dtype=FP8_DTYPE if quant != QUANT_NONE else x.dtype)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual.contiguous() if residual is not None else x
    if quant == QUANT_DYNAMIC:
        scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    scale_arg = scale if scale is not None else x
    if rows > 0:
        block, warps, whole_row = row_block(width, max_block)
        _rms_norm_kernel[(rows,)](
            x, res_in, weight.contiguous(), out, res_out, scale_arg, width, eps, FP8_MAX, FP8_MIN_SCALE,
            HAS_RESIDUAL=residual is not None, QUANT=quant, BLOCK=block, WHOLE_ROW=whole_row,
            num_warps=warps, **pdl_launch(x.device))
    result = [out]
    if quant == QUANT_DYNAMIC:
        result.append(scale)
    if residual is not None:
        result.append(res_out)
    return result[0] if len(result) == 1 else tuple(result)
