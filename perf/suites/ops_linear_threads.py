"""Where the packed CPU GEMM should start using every thread: one thread vs torch's thread
count on the same call, over work sizes from a decode row of a small model to prefill chunks.

The kernel (ops/csrc/linear_cpu.cpp) splits its panel groups across the OpenMP team only for
calls of at least ``kParallelWork`` multiply-adds; below that a parallel region (microseconds
to wake the team, far more when another process holds a core) costs more than it saves. This
sweep is that constant's evidence: per shape, the time at 1 thread and at N, and the smallest
work at which N threads won.
"""
from __future__ import annotations

import torch

from vgraph.ops.linear import pack_weight

PARALLEL_WORK = 1 << 18  # mirrors kParallelWork in linear_cpu.cpp
# (rows, out_features, in_features): decode rows of the perf Llama (hidden 512) and of a
# Qwen2.5-0.5B-shaped model (hidden 896), up to prefill chunks.
SHAPES = [(m, n, k) for n, k in ((512, 512), (1024, 512), (2816, 512), (1152, 896), (9728, 896))
          for m in (1, 2, 4, 8, 32, 128)]
QUICK_SHAPES = [(m, 1024, 512) for m in (1, 8, 64)]


def _variants(m: int, n: int, k: int, threads: int) -> dict:
    x, packed = torch.randn(m, k), pack_weight(torch.randn(n, k))

    def at(count: int):
        def call():
            torch.set_num_threads(count)
            try:
                torch.ops.vgraph.packed_linear(x, packed, None, n)
            finally:
                torch.set_num_threads(threads)
        return call
    return {"1_thread": at(1), f"{threads}_threads": at(threads)}


def sweep(quick: bool) -> dict:
    """Each shape timed at 1 and N threads (interleaved); the cut-off where N first wins."""
    from ..timing import time_variants

    threads = torch.get_num_threads()
    rows = []
    for m, n, k in (QUICK_SHAPES if quick else SHAPES):
        t = time_variants(_variants(m, n, k, threads), "cpu", reps=5 if quick else 11)
        one, many = t["1_thread"]["median_s"], t[f"{threads}_threads"]["median_s"]
        rows.append({"rows": m, "out_features": n, "in_features": k, "macs": m * n * k,
                     "one_thread_us": one * 1e6, "all_threads_us": many * 1e6, "speedup": one / many})
    wins = sorted(r["macs"] for r in rows if r["speedup"] > 1.05)
    losses = sorted(r["macs"] for r in rows if r["speedup"] < 0.95 and r["macs"] >= PARALLEL_WORK)
    return {"threads": threads, "kernel_parallel_work": PARALLEL_WORK, "rows": rows,
            "smallest_work_where_threads_win": wins[0] if wins else None,
            "parallel_calls_slower_than_one_thread": losses}


def summarize(result: dict | None) -> list[str]:
    if not result:
        return []
    lines = [f"packed GEMM, 1 vs {result['threads']} threads (the kernel goes parallel from "
             f"{result['kernel_parallel_work']} multiply-adds):",
             f"  {'rows':>5} {'out':>6} {'in':>5} {'MACs':>11} {'1 thread us':>12} {'N threads us':>13} {'speedup':>8}"]
    for r in result["rows"]:
        lines.append(f"  {r['rows']:>5} {r['out_features']:>6} {r['in_features']:>5} {r['macs']:>11} "
                     f"{r['one_thread_us']:>12.1f} {r['all_threads_us']:>13.1f} {r['speedup']:>8.2f}")
    lines.append(f"  smallest work where threads won (>5%): {result['smallest_work_where_threads_win']}; "
                 f"parallel calls slower than one thread: {result['parallel_calls_slower_than_one_thread']}")
    return lines
