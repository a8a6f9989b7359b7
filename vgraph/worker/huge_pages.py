"""Zeroed CPU tensors backed by 2 MiB pages, for the KV cache.

A CPU decode step streams every running sequence's K/V rows from memory, block by block, and
the blocks of one sequence lie wherever the pool had them free. On 4 KiB pages each block
run costs TLB misses (nested paging doubles their price in a VM) and restarts the hardware
prefetcher at every page. Asking Linux for transparent huge pages on the KV pool alone
(``madvise(MADV_HUGEPAGE)``, which works in THP's default "madvise" mode) took the CPU
attention of the offline suite's prefill-heavy workload from 0.60-0.66 s to 0.58-0.59 s
(128-token blocks, two runs each, cProfile), and Inductor's elementwise loops from ~0.25 s to
~0.11 s (fewer TLB misses after each attention). torch's own switch (``THP_MEM_ALLOC_ENABLE=1``)
does it for every large allocation; there the GEMMs lost 0.2-0.3 s to the huge-page faults
of fresh activations, more than the attention gained.

The advice is best effort: where it is refused (THP "never", not Linux) the memory is the
same zeroed tensor on small pages.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from functools import lru_cache
from typing import Optional

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@lru_cache(maxsize=1)
def _madvise() -> Optional[ctypes._CFuncPtr]:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    function = libc.madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, starting on a 2 MiB boundary, with the
    kernel asked to back it with huge pages before the zeros first touch it. Tensors under one
    huge page are plain ``torch.zeros``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)  # untouched: no page mapped yet
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    madvise(raw.data_ptr() + start, nbytes, _MADV_HUGEPAGE)  # refused: small pages, same memory
    return raw[start:start + nbytes].view(dtype).view(shape).zero_()
