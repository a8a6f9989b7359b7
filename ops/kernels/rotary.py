"""Rotary position embedding of a layer's q and k in one kernel (``vgraph::rotary_qk``).

Why a kernel of its own: written in plain torch, the rotation is left to Inductor, which
emits one kernel for q and one for k (their head counts differ), both outside programmatic
dependent launch. In a batch-1 decode step each is about a microsecond of work behind a
launch gap, twice a layer. Here one program per token rotates every head of q and of k,
launched with PDL like the kernels around it. The math is fp32, rounded once to the
activation dtype, as Inductor's kernels for the plain-torch form compute it
(ops/rotary.py: ``rotary_qk_reference``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast_rne, next_pow2, pdl_enter, pdl_launch


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_t, stride_h, heads, cos, sin, half_offs,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates ``heads`` heads of one token: ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``
    per half, written contiguously ([tokens, heads, 2 * HALF])."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & (half_offs < HALF)[None, :]
    src = x_ptr + token * stride_t + h[:, None].to(tl.int64) * stride_h + half_offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (token * heads + h[:, None].to(tl.int64)) * (2 * HALF) + half_offs[None, :]
    out_ty = out_ptr.dtype.element_ty
    tl.store(dst, cast_rne(x1 * cos - x2 * sin, out_ty), mask=mask)
    tl.store(dst + HALF, cast_rne(x2 * cos + x1 * sin, out_ty), mask=mask)


@triton.jit
def _rotary_qk_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, q_heads, k_heads,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                      HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                      BLOCK_HK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    half_offs = tl.arange(0, BLOCK_HALF)
    in_half = half_offs < HALF
    cos = tl.load(cos_ptr + token * stride_ct + half_offs, mask=in_half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_st + half_offs, mask=in_half, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, q_heads, cos, sin, half_offs, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, k_heads, cos, sin, half_offs, HALF, BLOCK_HK)


def rotary_qk_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] (any token and head strides, unit stride along D)
    rotated by cos/sin [T, D/2] -> new contiguous tensors of their shapes."""
    tokens, q_heads, dim = q.shape
    half = dim // 2
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    block_half, block_hq, block_hk = next_pow2(half), next_pow2(q_heads), next_pow2(k.shape[1])
    elements = (block_hq + block_hk) * block_half  # per program, per half
    _rotary_qk_kernel[(tokens,)](
        q, k, cos, sin, q_out, k_out, q_heads, k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), HALF=half, BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        num_warps=4 if elements >= 2048 else (2 if elements >= 512 else 1), **pdl_launch(q.device))
    return q_out, k_out
