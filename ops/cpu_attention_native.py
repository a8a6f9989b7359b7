"""The in-place C++ CPU attention: ``csrc/paged_attention_cpu.cpp`` for short query segments,
``csrc/prefill_attention_cpu.cpp`` for long ones.

A decode row reads its sequence's K/V rows straight from the paged cache, once, through the
block table; the torch path (``cpu_attention.attend_group``) first gathers them into a padded
copy and then reads that copy in SDPA. At decode the KV cache is the bulk of the bytes a step
moves besides the weights, so this halves them or better. ``cpu_attention`` sends segments of
at most ``MAX_QUERY_ROWS`` rows to the first kernel and longer ones to the second, which
runs every prefill of a batch in one GEMM-shaped parallel loop instead of one SDPA call per
prompt from Python.

Both take the same argument struct (``csrc/paged_attention_common.h``). The kernels are built
on first use (``native_build``). Without a working compiler the op keeps the torch path
(SDPA) for everything, with one warning; ``VGRAPH_CPU_ATTENTION=torch`` forces that path (to
compare the two, or to rule the kernels out).

An fp8 (e4m3) cache is read like the 16-bit ones, each row converted to float32 as it is
read, times its cache's per-tensor scale (``k_scale``/``v_scale``, passed by value: on CPU
there are no graphs to keep a pointer valid for).
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from .native_build import NativeBuildError, NativeKernel

# Longest query segment the short-segment kernel takes: every query vector of a (segment, KV
# head) pair is scored against each K row while it is in L1. Past a few rows the prefill
# kernel's GEMM-shaped tiles are faster.
MAX_QUERY_ROWS = 16
MAX_HEAD_DIM = 1024
_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}
ENV_SWITCH = "VGRAPH_CPU_ATTENTION"


class _Args(ctypes.Structure):
    """Mirror of ``PagedAttentionArgs`` in the C++ source, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("k_strides", ctypes.c_int64 * 3), ("v_strides", ctypes.c_int64 * 3),
        ("block_table", ctypes.c_void_p), ("block_table_stride", ctypes.c_int64),
        ("segments", ctypes.c_void_p), ("num_segments", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("q_heads", ctypes.c_int32), ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32), ("cache_dtype", ctypes.c_int32),
        ("block_table_is_int64", ctypes.c_int32), ("num_threads", ctypes.c_int32),
        ("scale", ctypes.c_float), ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float),
    ]


def _kernel(library: str, purpose: str) -> NativeKernel:
    function = f"vgraph_{library.removesuffix('_cpu')}"

    def struct_problem(lib: ctypes.CDLL) -> str | None:
        if getattr(lib, f"{function}_args_size")() != ctypes.sizeof(_Args):
            return "the C++ argument struct and its ctypes mirror differ"
        return None

    return NativeKernel(library, function, [ctypes.POINTER(_Args)], ctypes.c_int64, purpose,
                        struct_problem)


_KERNEL = _kernel("paged_attention_cpu", "CPU decode attention (in place)")
_PREFILL_KERNEL = _kernel("prefill_attention_cpu", "CPU prefill attention (in place)")


def enabled() -> bool:
    """Whether short segments go to the C++ kernel (it builds on the first call)."""
    if os.environ.get(ENV_SWITCH, "").lower() == "torch":
        return False
    return _KERNEL.load() is not None


def prefill_enabled() -> bool:
    """Whether long segments go to the C++ prefill kernel (it builds on the first call)."""
    if os.environ.get(ENV_SWITCH, "").lower() == "torch":
        return False
    return _PREFILL_KERNEL.load() is not None


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Inputs the kernel takes: CPU tensors in a supported dtype with unit-stride head_dim."""
    return (q.device.type == "cpu" and k_cache.dtype in _CACHE_DTYPES
            and k_cache.shape[-1] <= MAX_HEAD_DIM and k_cache.stride(-1) == 1)


def _scale_value(scale: Optional[Tensor]) -> float:
    return 1.0 if scale is None else float(scale.reshape(()))


def attend_segments(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                    segments: Sequence[tuple[int, int, int, int]] | Tensor, scale: float,
                    out: Tensor, long_segments: bool = False,
                    kv_scales: tuple[Optional[Tensor], Optional[Tensor]] = (None, None)) -> None:
    """Writes the attention of ``segments`` ((sequence, first row, rows, seq_len) each, or
    those rows as an int64 [n, 4] tensor) into their rows of ``out`` (float32, contiguous,
    same shape as q). ``long_segments``: use the prefill kernel (any length) instead of the
    short-segment one (at most ``MAX_QUERY_ROWS`` rows each). ``kv_scales``: an fp8 cache's
    (k_scale, v_scale), None for 1.0."""
    kernel = _PREFILL_KERNEL if long_segments else _KERNEL
    function = kernel.load()
    if function is None:
        raise NativeBuildError(kernel.unavailable or "the C++ attention kernel is not loaded")
    if len(segments) == 0:
        return
    q32 = q.to(torch.float32).contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    seg = (segments.contiguous() if isinstance(segments, Tensor)
           else torch.tensor(segments, dtype=torch.int64))
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    args = _Args(
        q=q32.data_ptr(), out=out.data_ptr(), k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(), k_strides=(ctypes.c_int64 * 3)(*k_cache.stride()[:3]),
        v_strides=(ctypes.c_int64 * 3)(*v_cache.stride()[:3]),
        block_table=table.data_ptr(), block_table_stride=table.stride(0),
        segments=seg.data_ptr(), num_segments=len(segments), num_blocks=k_cache.shape[0],
        q_heads=q.shape[1], kv_heads=k_cache.shape[2], head_dim=k_cache.shape[3],
        block_size=k_cache.shape[1], cache_dtype=_CACHE_DTYPES[k_cache.dtype],
        block_table_is_int64=int(table.dtype == torch.int64),
        num_threads=torch.get_num_threads(), scale=scale, k_scale=_scale_value(kv_scales[0]),
        v_scale=_scale_value(kv_scales[1]))
    failed = function(ctypes.byref(args))
    if failed:
        seq = int(failed) - 1
        raise ValueError(f"sequence {seq}: its block table points outside the cache's "
                         f"{k_cache.shape[0]} blocks")
