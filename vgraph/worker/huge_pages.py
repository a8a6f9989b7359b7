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
import ctypes
import logging
import math
import mmap
import sys
import threading
import time
from typing import Optional, Sequence

import torch

logger = logging.getLogger("vgraph")

HUGE_PAGE_BYTES = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without writing them
PREFAULT_CHUNK_BYTES = 64 << 20  # one madvise call's share: the thread stops between calls


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


def prefault_in_background(tensors: Sequence[torch.Tensor]) -> Optional[threading.Thread]:
    """Maps every page of ``tensors`` (a lazily mapped pool) in a daemon thread, so that the
    steps never wait for a first touch: in this VM a fresh 2 MiB page cost ~4.6 ms, and a step
    whose blocks reach a new page in every layer's K and V waited ~100 ms. ``madvise`` with
    ``MADV_POPULATE_WRITE`` faults the pages in without writing them (safe beside steps that do
    write), called through ctypes, which releases the GIL. None where there is no such call
    (not Linux); a kernel before 5.14 refuses it and the pool stays lazily mapped."""
    if not sys.platform.startswith("linux") or not tensors:
        return None
    regions = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    thread = threading.Thread(target=_prefault, args=(list(tensors), regions), name="vgraph-kv-prefault",
                              daemon=True)
    thread.start()
    return thread


def _prefault(keep_alive: list[torch.Tensor], regions: list[tuple[int, int]]) -> None:
    """Populates ``regions`` (address, bytes) chunk by chunk; ``keep_alive`` holds their memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start, total = time.perf_counter(), sum(n for _, n in regions)
    page = mmap.PAGESIZE
    for address, nbytes in regions:
        first = address - address % page
        end = address + nbytes
        for chunk in range(first, end, PREFAULT_CHUNK_BYTES):
            if libc.madvise(ctypes.c_void_p(chunk), min(PREFAULT_CHUNK_BYTES, end - chunk), MADV_POPULATE_WRITE):
                logger.info("KV cache prefault stopped: madvise(MADV_POPULATE_WRITE) failed (errno %d); "
                            "its pages are mapped on first touch", ctypes.get_errno())
                return
    logger.info("KV cache prefaulted: %.2f GiB in %.2f s", total / 2**30, time.perf_counter() - start)
