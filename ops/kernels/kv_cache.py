"""Triton kernel that writes new K/V rows into the paged KV cache.

The cache is ``[num_blocks, block_size, kv_heads, head_dim]``; a flat slot ``s`` means block
``s // block_size``, offset ``s % block_size``. Slot ``-1`` marks a padding token: its
program exits before touching memory, so padded CUDA-graph batches leave the cache intact.
All strides are passed in, so ``key``/``value`` may be views (e.g. slices of a fused QKV
projection) and nothing is copied before the write.

An fp8 (e4m3) cache gets ``clamp(x / scale, -448, 448)``, the scale read from its one-element
tensor on the device (so a captured graph follows a scale changed in place), rounded to
nearest even (``quantize_fp8``: also right under the interpreter).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import FP8_MAX, kv_scale_args, next_pow2, pdl_enter, pdl_launch, quantize_fp8

# Elements one program moves at most (heads x padded head_dim); more heads -> more programs.
_MAX_TILE = 4096


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                              k_scale_ptr, v_scale_ptr,
                              num_heads, head_dim, block_size,
                              stride_kt, stride_kh, stride_kd,
                              stride_vt, stride_vh, stride_vd,
                              stride_cb, stride_cs, stride_ch, stride_cd,
                              BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                              QUANT: tl.constexpr, FP8_LIMIT: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
                mask=mask)
    if QUANT:
        k = quantize_fp8(k.to(tl.float32), tl.load(k_scale_ptr), FP8_LIMIT)
        v = quantize_fp8(v.to(tl.float32), tl.load(v_scale_ptr), FP8_LIMIT)
    k = k.to(k_cache_ptr.dtype.element_ty)
    v = v.to(v_cache_ptr.dtype.element_ty)
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :] * stride_cd
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                             k_scale: Optional[torch.Tensor] = None,
                             v_scale: Optional[torch.Tensor] = None) -> None:
    """Writes ``key``/``value`` [T, Hkv, D] into the caches at ``slot_mapping`` [T], in place;
    an fp8 cache gets them quantized at ``k_scale``/``v_scale`` (module doc).

    Both caches must share one layout (same strides), which is how they are allocated.
    """
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have identical strides")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_scale_t, v_scale_t, quant = kv_scale_args(k_cache, k_scale, v_scale)
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, _MAX_TILE // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping.contiguous(), k_scale_t, v_scale_t,
        num_heads, head_dim, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(),
        BLOCK_H=block_h, BLOCK_D=block_d, QUANT=quant, FP8_LIMIT=FP8_MAX,
        num_warps=4 if block_h * block_d >= 1024 else 1, **pdl_launch(key.device))
