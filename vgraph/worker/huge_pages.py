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

The pool is an anonymous ``mmap``: the kernel hands it out zeroed and maps pages only when
they are first touched, as ``torch.zeros`` does for large tensors, so startup pays nothing
for it (zeroing a 256 MiB pool up front cost 0.3 s of the demo model's warm start). The
advice is best effort: where it is refused (THP "never") the memory is the same, on small
pages; without ``MADV_HUGEPAGE`` (not Linux) the pool is ``torch.zeros``.
"""
from __future__ import annotations

import contextlib
import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, in its own anonymous mapping advised
    for huge pages. Tensors under one huge page are plain ``torch.zeros``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # One huge page more than needed, so that the tensor can start on a 2 MiB boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP compiled out or refused: the same memory, small pages
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping until it is freed
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start:start + nbytes].view(dtype).view(shape)
