"""``vgraph::reshape_and_cache``: write the step's new K/V rows into the paged KV cache.

The cache for one layer is a pair of ``[num_blocks, block_size, kv_heads, head_dim]`` tensors
allocated once; each step scatters its new tokens into it at flat slots chosen by the block
manager. Writing in place is the point of this op (copying a cache per step is unaffordable),
so it declares ``k_cache`` and ``v_cache`` as mutated and returns nothing.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .kernels import lazy
from .native_build import NativeKernel
from .registration import vgraph_op

# Triton kernels, imported on first use (kernels.lazy): CPU calls never need them.
kernels = lazy("kv_cache")

_INDEX_DTYPES = (torch.int32, torch.int64)


def check_kv_cache_pair(k_cache: Tensor, v_cache: Tensor) -> None:
    """Raises ValueError unless the two caches are matching 4-D paged tensors."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} does not match "
                         f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}")


def _check_inputs(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slot_mapping: Tensor) -> None:
    check_kv_cache_pair(k_cache, v_cache)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [T, kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key rows {tuple(key.shape[1:])} do not fit cache rows "
                         f"{tuple(k_cache.shape[2:])} (kv_heads, head_dim)")
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(f"key/value dtypes {key.dtype}/{value.dtype} must equal the cache "
                         f"dtype {k_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")


def reshape_and_cache_reference(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                                slot_mapping: Tensor) -> None:
    """Plain-torch scatter: token t goes to block ``slot // block_size``, row ``slot % block_size``."""
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[valid]
    v_cache[blocks, offsets] = value[valid]


@vgraph_op("vgraph::reshape_and_cache", mutates_args=("k_cache", "v_cache"))
def reshape_and_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    """Writes key/value [T, Hkv, D] into the paged caches at ``slot_mapping``; -1 = skip."""
    reshape_and_cache_reference(key, value, k_cache, v_cache, slot_mapping)


@reshape_and_cache.register_fake
def _(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)


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


@reshape_and_cache.register_kernel("cpu")
def _(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)
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
def _(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)
    kernels.reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)
