"""SiLU-and-mul kernel, optionally with a static fp8 quantization fused on its output."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import FP8_DTYPE, quantize_fp8, cast_rne, FP8_MAX, next_pow2, pdl_enter, pdl_launch, rows_and_width

_MAX_BLOCK = 4096


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, scale_ptr, d, fp8_max,
                         QUANT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    # Rounds to the activation dtype exactly where torch's silu(gate) * up does, so the fused
    # op is bit-compatible with the unfused sequence before quantization.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0)
    act_ty = gate.dtype
    g = gate.to(tl.float32)
    silu = cast_rne(g / (1.0 + tl.exp(-g)), act_ty).to(tl.float32)
    y = cast_rne(silu * up.to(tl.float32), act_ty)
    if QUANT:
        q = quantize_fp8(y.to(tl.float32), tl.load(scale_ptr), fp8_max)
        tl.store(out_ptr + row * d + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * d + cols, y, mask=mask)


def silu_and_mul_triton(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]``; quantized to fp8 with ``scale`` when given."""
    x = x.contiguous()
    rows, width = rows_and_width(x)
    d = width // 2
    out = torch.empty((*x.shape[:-1], d), dtype=FP8_DTYPE if scale is not None else x.dtype,
                      device=x.device)
    if rows > 0 and d > 0:
        block = min(next_pow2(d), _MAX_BLOCK)
        grid = (rows, triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](x, out, scale if scale is not None else x, d, FP8_MAX,
                                   QUANT=scale is not None, BLOCK=block, num_warps=4 if block >= 1024 else 1,
                                   **pdl_launch(x.device))
    return out
