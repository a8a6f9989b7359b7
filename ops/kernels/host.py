"""What the Triton launchers share with code that runs without Triton: the fp8 format's
constants and the split-KV launch policy the worker asks on every step. Kept apart from
``common`` (which imports Triton, ~0.2 s) so that a CPU process, which never launches a Triton
kernel, never imports it: the ops load their kernel modules lazily (``kernels.lazy``).
"""
from __future__ import annotations

import functools
import math

import torch

# Rows up to which a 16-bit CUDA projection may take the GEMV kernel (ops/kernels/gemv.py):
# decode batches of one and two (ops/dense_linear.py decides per shape).
GEMV_MAX_ROWS = 2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# A dynamic scale never goes below this, so an all-zero row quantizes to zeros, not NaNs.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, read once per device: launch policies
    (the split-KV count) ask every step, and the property query is not free."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


# A split count is good enough once its last wave is this full, relative to the best count.
_WAVE_EFFICIENCY_SLACK = 0.85
# Programs that already fill this much of one wave are not split at all.
_FULL_WAVE = 0.8


@functools.lru_cache(maxsize=4096)
def wave_efficient_splits(programs: int, slots: int, max_splits: int) -> int:
    """How many ways to split ``programs`` (sequence, kv head) programs over ``slots`` program
    slots (SMs x resident programs per SM), at most ``max_splits``: FlashAttention's
    ``num_splits_heuristic``. No split when the unsplit grid fills most of a wave; otherwise the
    smallest count whose last wave is nearly as full as the best count's, since every split
    also costs a partial-output write and a share of the merge. Cached: the runner asks every
    step with a handful of distinct arguments."""
    if programs <= 0 or slots <= 0 or programs >= _FULL_WAVE * slots or max_splits <= 1:
        return 1

    def efficiency(splits: int) -> float:
        waves = programs * splits / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, max_splits + 1))
    return next(s for s in range(1, max_splits + 1)
                if efficiency(s) >= _WAVE_EFFICIENCY_SLACK * best)
