"""``vgraph::reshape_and_cache``: write the step's new K/V rows into the paged KV cache.

The cache for one layer is a pair of ``[num_blocks, block_size, kv_heads, head_dim]`` tensors
allocated once; each step scatters its new tokens into it at flat slots chosen by the block
manager. Writing in place is the point of this op (copying a cache per step is unaffordable),
so it declares ``k_cache`` and ``v_cache`` as mutated and returns nothing.

fp8 KV cache: a cache of ``torch.float8_e4m3fn`` holds K/V quantized with one per-tensor
scale each (``k_scale``, ``v_scale``: one-element float32 tensors, 1.0 when not given, as in
vLLM). Writing stores ``clamp(x / scale, -448, 448)``; the attention ops read back
``x * scale``. The scales are tensors, not Python numbers, so a captured CUDA graph reads
whatever they hold rather than a value baked in at capture.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import Tensor

from .kernels import lazy
from .kernels.host import FP8_DTYPE, FP8_MAX
from .cpu_dispatch import python_kernel
from .native_build import NativeKernel
from .registration import vgraph_op

# Triton kernels, imported on first use (kernels.lazy): CPU calls never need them.
kernels = lazy("kv_cache")

_INDEX_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The quantized cache dtype ``--kv-cache-dtype fp8`` allocates (e4m3, vLLM's "fp8").
FP8_KV_DTYPE = FP8_DTYPE


def is_fp8_cache(cache: Tensor) -> bool:
    """Whether ``cache`` holds quantized K/V (then reads and writes go through the scales)."""
    return cache.dtype == FP8_KV_DTYPE


def check_kv_scale(name: str, scale: Optional[Tensor], cache: Tensor) -> None:
    """A scale, when given, is a one-element float32 tensor on the cache's device."""
    if scale is None:
        return
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != cache.device:
        raise ValueError(f"{name} must be a one-element float32 tensor on {cache.device} (a per-tensor "
                         f"scale), got {scale.dtype} of shape {tuple(scale.shape)} on {scale.device}")


def check_cache_input_dtype(name: str, x: Tensor, cache: Tensor) -> None:
    """K/V (and q) match an unquantized cache's dtype; any float dtype goes into an fp8 cache."""
    if is_fp8_cache(cache):
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} dtype {x.dtype} cannot go through an fp8 KV cache; use one of "
                             f"{_FLOAT_DTYPES}")
    elif x.dtype != cache.dtype:
        raise ValueError(f"{name} dtype {x.dtype} must equal the cache dtype {cache.dtype}")


def quantize_kv(x: Tensor, scale: Optional[Tensor]) -> Tensor:
    """``x`` as fp8 e4m3 at ``scale`` (1.0 when None), saturating at +-448 like vLLM's cache
    write: an outlier beyond the calibrated range clips instead of becoming NaN."""
    xf = x.float() if scale is None else x.float() / scale.reshape(())
    return xf.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: Tensor, scale: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """Cached rows in ``dtype``: fp8 rows times their scale, other rows as they are."""
    if x.dtype != FP8_KV_DTYPE:
        return x if x.dtype == dtype else x.to(dtype)
    xf = x.float() if scale is None else x.float() * scale.reshape(())
    return xf.to(dtype)


def check_kv_cache_pair(k_cache: Tensor, v_cache: Tensor) -> None:
    """Raises ValueError unless the two caches are matching 4-D paged tensors."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} does not match "
                         f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}")


def _check_inputs(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slot_mapping: Tensor, k_scale: Optional[Tensor] = None,
                  v_scale: Optional[Tensor] = None) -> None:
    check_kv_cache_pair(k_cache, v_cache)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [T, kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key rows {tuple(key.shape[1:])} do not fit cache rows "
                         f"{tuple(k_cache.shape[2:])} (kv_heads, head_dim)")
    check_cache_input_dtype("key", key, k_cache)
    check_cache_input_dtype("value", value, v_cache)
    check_kv_scale("k_scale", k_scale, k_cache)
    check_kv_scale("v_scale", v_scale, v_cache)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")


def reshape_and_cache_reference(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                                slot_mapping: Tensor, k_scale: Optional[Tensor] = None,
                                v_scale: Optional[Tensor] = None) -> None:
    """Plain-torch scatter: token t goes to block ``slot // block_size``, row ``slot % block_size``;
    into an fp8 cache quantized at the scales."""
    _check_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    keys, values = key[valid], value[valid]
    if is_fp8_cache(k_cache):
        keys, values = quantize_kv(keys, k_scale), quantize_kv(values, v_scale)
    k_cache[blocks, offsets] = keys
    v_cache[blocks, offsets] = values


@vgraph_op("vgraph::reshape_and_cache", mutates_args=("k_cache", "v_cache"))
def reshape_and_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor, k_scale: Optional[Tensor] = None,
                      v_scale: Optional[Tensor] = None) -> None:
    """Writes key/value [T, Hkv, D] into the paged caches at ``slot_mapping``; -1 = skip.
    An fp8 cache stores them divided by ``k_scale``/``v_scale`` (see the module doc)."""
    reshape_and_cache_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@reshape_and_cache.register_fake
def _(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
      k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    _check_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _native_kernel() -> NativeKernel:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return NativeKernel("kv_cache_cpu", "vgraph_reshape_and_cache",
                        [ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr,
                         ctypes.c_int32, i64, i64, i64, i64, i64, i64], i64,
                        "CPU reshape_and_cache")


_NATIVE = _native_kernel()


def _native_applies(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Row copies need unit-stride head_dim everywhere and one stride set for both caches."""
    return (k_cache.stride() == v_cache.stride() and key.stride(-1) == 1
            and value.stride(-1) == 1 and k_cache.stride(-1) == 1)


@python_kernel("reshape_and_cache", mutates_args=("k_cache", "v_cache"))
def _reshape_and_cache_cpu(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                           k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    _check_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if is_fp8_cache(k_cache):  # quantized first, the native kernel then copies bytes
        key, value = quantize_kv(key, k_scale), quantize_kv(value, v_scale)
    function = _NATIVE.load()
    if function is None or not _native_applies(key, value, k_cache, v_cache):
        reshape_and_cache_reference(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.contiguous()
    failed = function(key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1),
                      value.stride(0), value.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3],
                      slots.data_ptr(), int(slots.dtype == torch.int64), key.shape[0],
                      key.shape[1], key.shape[2], key.element_size(), k_cache.shape[1],
                      k_cache.shape[0])
    if failed:
        token = int(failed) - 1
        raise ValueError(f"slot {int(slots[token])} of token {token} is outside the cache's "
                         f"{k_cache.shape[0] * k_cache.shape[1]} slots")


@reshape_and_cache.register_kernel("cuda")
def _(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
      k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    _check_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    kernels.reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
