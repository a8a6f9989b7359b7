"""RMSNorm kernels: plain, with residual add, and with fp8 quantization fused on the output.

One kernel body covers all variants (constexpr switches), so the fused ops compute exactly
what the unfused sequence computes: normalize in fp32, round to the activation dtype,
multiply by the weight, round again, then (if asked) quantize that rounded value to fp8.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import FP8_DTYPE, quantize_fp8, cast_rne, FP8_MAX, FP8_MIN_SCALE, row_block, rows_and_width

QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC = 0, 1, 2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
                     n_cols, eps, fp8_max, fp8_min_scale,
                     HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    act_ty = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = cast_rne(x + r, act_ty)
        tl.store(res_out_ptr + offs, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = cast_rne(x * (1.0 / tl.sqrt(var + eps)), act_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = cast_rne(y * w, act_ty)
    if QUANT == 0:
        tl.store(out_ptr + offs, y, mask=mask)
    else:
        y = y.to(tl.float32)
        if QUANT == 1:
            s = tl.load(scale_ptr)
        else:
            s = tl.maximum(tl.max(tl.abs(y), axis=0) / fp8_max, fp8_min_scale)
            tl.store(scale_ptr + row, s)
        q = quantize_fp8(y, s, fp8_max)
        tl.store(out_ptr + offs, q.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: Optional[torch.Tensor] = None, quant: int = QUANT_NONE,
                    scale: Optional[torch.Tensor] = None):
    """Launches the RMSNorm kernel; returns what the matching vgraph op returns."""
    x = x.contiguous()
    rows, width = rows_and_width(x)
    out = torch.empty_like(x, dtype=FP8_DTYPE if quant != QUANT_NONE else x.dtype)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual.contiguous() if residual is not None else x
    if quant == QUANT_DYNAMIC:
        scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    scale_arg = scale if scale is not None else x
    if rows > 0:
        block, warps = row_block(width)
        _rms_norm_kernel[(rows,)](
            x, res_in, weight.contiguous(), out, res_out, scale_arg, width, eps, FP8_MAX, FP8_MIN_SCALE,
            HAS_RESIDUAL=residual is not None, QUANT=quant, BLOCK=block, num_warps=warps)
    result = [out]
    if quant == QUANT_DYNAMIC:
        result.append(scale)
    if residual is not None:
        result.append(res_out)
    return result[0] if len(result) == 1 else tuple(result)
