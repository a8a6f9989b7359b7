"""Small helpers shared by the Triton launchers."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .host import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, sm_count  # noqa: F401  (the launchers import them here)

# The interpreter is chosen once, when triton is imported, from this variable.
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Under the interpreter, tl.dot on bf16 operands gives garbage (seen with triton 3.9), so the
# attention kernels upcast their dot operands to fp32 there. Compiled kernels keep bf16/fp16.
DOT_UPCAST: bool = INTERPRETED



# Programmatic dependent launch (PDL, sm_90 and later), on unless VGRAPH_PDL=0, read once
# here. Why: a decode step at batch 1 is hundreds of small kernels (about 12 a layer), and on a
# plain stream each one is scheduled only once the one before has finished, so every boundary
# adds a launch's latency to the step (the 0.5B shape's step on an H200 was bound by exactly
# that: ~400 kernels of 1-8 us). A kernel launched with PDL may be scheduled while the one
# before is still running; it waits (``pdl_enter``) until that one has finished and its
# writes are visible before it touches memory, so only the scheduling overlaps, never the
# data. Captured into CUDA graphs as programmatic edges. Measured on an H200 (2026-11-28,
# perf/results/env-ab-cuda-pdl.json): the batch-1 step 0.862 -> 0.747 ms on the 0.5B shape,
# 4.588 -> 4.448 ms on the 8B; every GPU kernel, graph and overlap test passes with it on.
PDL_REQUESTED: bool = os.environ.get("VGRAPH_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: Optional[int]) -> bool:
    """An NVIDIA GPU of sm_90 or later (a ROCm build reports its own capability numbers, and
    PDL is NVIDIA's)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


_PDL_ON = {"USE_PDL": True, "launch_pdl": True}
_PDL_OFF = {"USE_PDL": False}


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for launching a kernel that begins with ``pdl_enter``: PDL on where
    it was asked for and the device has it (never under the interpreter), else off. Shared
    dicts, only ever unpacked: an eager step launches dozens of kernels."""
    if PDL_REQUESTED and not INTERPRETED and device.type == "cuda" and _pdl_capable(device.index):
        return _PDL_ON
    return _PDL_OFF


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Under PDL, wait until the kernel before it in the stream has finished and its writes
    are visible, then let the next kernel be scheduled. A kernel's first statement, or
    preceded only by index arithmetic and loads of what no kernel of a step writes (the
    GEMVs' first weight tile): this kernel may read what that one wrote, or write what it
    reads. Every program runs it, before any early return."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def kv_scale_args(k_cache: torch.Tensor, k_scale: Optional[torch.Tensor],
                  v_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k_scale, v_scale, is_fp8) for a kernel launch over this cache: an fp8 cache's scale
    tensors (1.0 where one is not given: a new tensor, which only a caller outside the engine
    gets, never a captured graph, since the engine always passes its own); for any other
    cache the kernels never read them, so the cache itself stands in as the pointer."""
    if k_cache.dtype != FP8_DTYPE:
        return k_cache, k_cache, False
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=k_cache.device)
        k_scale, v_scale = (one if k_scale is None else k_scale), (one if v_scale is None else v_scale)
    return k_scale, v_scale, True


def rows_and_width(x: torch.Tensor) -> tuple[int, int]:
    """A tensor as a 2-D [rows, last-dim] problem (leading dims flattened)."""
    width = x.shape[-1]
    return (x.numel() // width if width else 0), width


# Row-wise kernels (RMSNorm, per-token quant) hold at most this many elements of a row per
# block; wider rows are walked in chunks (a later pass re-reads the row, from L2). Why: the
# registers of a whole-row block grow with the width. Compiled for sm_90 (ptxas, bf16, 8
# warps), fused add+RMSNorm+quant as one block takes 64 registers at 8192 wide, 128 at 16384
# and 254 at 32768 (one 256-thread program per SM, at the spill limit); in 8192-wide chunks
# it takes 90 at any width. Rows up to 8192 (most hidden sizes) keep their single read.
ROW_CHUNK = 8192


def row_block(width: int, max_block: int = ROW_CHUNK) -> tuple[int, int, bool]:
    """(block, warps, whole_row) for a row-wise kernel of this width: the block over a row
    (capped at ``max_block``, a power of two), its warp count, and whether one block holds
    the whole row (one pass) or the kernel loops over chunks (two or three passes)."""
    block = min(next_pow2(width), next_pow2(max_block))
    warps = 1 if block <= 256 else 4 if block <= 2048 else 8
    return block, warps, width <= block


# Two interpreter casts are wrong (seen with triton 3.9): fp32 -> e4m3 drops the carry when
# rounding crosses a power of two (31.86 becomes 16, not 32), and fp32 -> bf16 truncates
# instead of rounding to nearest even. Interpreted kernels therefore round to the target
# grid in fp32 first, after which the cast is exact. Compiled kernels use the hardware cast.
PREROUND_CASTS = tl.constexpr(INTERPRETED)


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even, also under the interpreter."""
    if PREROUND_CASTS:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _round_to_e4m3_grid(x):
    ax = tl.abs(x)
    bits = ax.to(tl.uint32, bitcast=True)
    # normal range: round the 23-bit mantissa to 3 bits, ties to even
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20
    # subnormal range (|x| < 2^-6): multiples of 2^-9, via the fp32 add-subtract trick
    sub = (ax + 16384.0) - 16384.0
    r = tl.where(ax < 0.015625, sub, normal.to(tl.float32, bitcast=True))
    return tl.where(x < 0, -r, r)


@triton.jit
def quantize_fp8(x, inv_or_scale, fp8_max):
    """``clamp(x / scale, -max, max)`` ready to store into an e4m3 pointer."""
    q = tl.clamp(x / inv_or_scale, -fp8_max, fp8_max)
    if PREROUND_CASTS:
        q = _round_to_e4m3_grid(q)
    return q
