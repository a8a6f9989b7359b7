"""Data parallelism: request throughput of ``vgraph serve --data-parallel-size 2`` vs one engine,
on the serving suite's workload (streaming ``/v1/completions``, distinct ~48-token prompts,
greedy, ``ignore_eos``, a fixed number of new tokens, closed loop at each concurrency).

The servers run side by side (an idle one only waits on its queues) and are measured
interleaved, in alternating order per round, so drift and other processes' load hit all alike;
medians over the rounds are reported. Each is the default compiled server, its engine in an
engine-core process unless said otherwise:

- ``dp1``: one engine at torch's default threads (one per core), as users run it;
- ``dp1_1thread``: one engine at one thread (``OMP_NUM_THREADS=1``): the control, because
- ``dp2``: two replicas (engine-core processes) splitting the cores, ``cores // 2`` threads
  each: on a 2-core machine one thread each, so a comparison with ``dp1`` alone would mix the
  replicas' gain with the OpenMP thread team's (on a shared machine a 2-thread team waits at
  every barrier for a descheduled thread; see perf/README.md);
- ``dp2_threads``: the same two replicas as threads of the server process
  (``--engine-in-process``), sharing its GIL.

What to expect on CPU: one engine already uses every core for its matmuls, so a second replica
wins only what one engine leaves idle (the scheduler's and the HTTP thread's Python time, the
small batches' poor thread scaling) and pays the GIL its two step loops share. The figures are
the request throughput ratios ``dp2 / dp1`` and ``dp2 / dp1_1thread`` at each concurrency.
"""
from __future__ import annotations

import asyncio
import os
import statistics
from typing import Any

from .serving import ServerUnderTest, _closed_level

# name -> (server flags, extra environment)
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "dp1": (["--data-parallel-size", "1"], {}),
    "dp1_1thread": (["--data-parallel-size", "1"], {"OMP_NUM_THREADS": "1"}),
    "dp2": (["--data-parallel-size", "2"], {}),
    "dp2_threads": (["--data-parallel-size", "2", "--engine-in-process"], {}),
}
CONCURRENCY = (8, 32)
THREADS_1_BUILT_IN = True  # the DP=2 server sets its own thread split; a threads-1 rerun means nothing


def run(device: str, quick: bool = False) -> dict:
    from .compile import git_state
    load_before, git = os.getloadavg(), git_state()
    rounds, max_tokens = (1, 16) if quick else (3, 64)
    servers = {name: ServerUnderTest(device, eager=False, max_num_seqs=max(CONCURRENCY), extra_env=env,
                                     extra_args=flags)
               for name, (flags, env) in VARIANTS.items()}
    samples: dict[str, dict[int, list[dict[str, Any]]]] = {v: {c: [] for c in CONCURRENCY} for v in VARIANTS}
    try:
        startup = {name: server.wait_ready() for name, server in servers.items()}
        for server in servers.values():  # warm-up: first-request effects
            asyncio.run(_closed_level(server.url, 4, 8, 8, offset=10_000))
        offset = 0
        for r in range(rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for c in CONCURRENCY:
                n = c if quick else max(32, 4 * c)
                for name in order:
                    level = asyncio.run(_closed_level(servers[name].url, c, n, max_tokens, offset))
                    offset += n
                    samples[name][c].append({k: level[k] for k in ("request_throughput", "output_tokens_per_s",
                                                                   "wall_s", "ttft_ms", "tpot_ms")})
    finally:
        exit_codes = {name: server.stop() for name, server in servers.items()}
    medians = {name: {f"c{c}": _medians(samples[name][c]) for c in CONCURRENCY} for name in VARIANTS}

    def ratio(a: str, b: str) -> dict[str, float]:
        return {f"c{c}": medians[a][f"c{c}"]["request_throughput"] / medians[b][f"c{c}"]["request_throughput"]
                for c in CONCURRENCY}

    return {"suite": "serving-dp",
            "config": {"model": "demo model (served as demo-model-v1), compiled",
                       "variants": {name: {"flags": flags, "env": env} for name, (flags, env) in VARIANTS.items()},
                       "concurrency": list(CONCURRENCY), "max_tokens": max_tokens, "rounds": rounds,
                       "requests_per_level": "C" if quick else "max(32, 4C)", "prompt_tokens": "~48, distinct",
                       "server_flags": "--max-num-seqs 32 --kv-cache-gib 0.25 (per replica), plus each variant's",
                       "cpu_count": os.cpu_count(), "git": git,
                       "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
            "startup_to_ready_s": startup, "exit_code_after_sigterm": exit_codes, "medians": medians,
            "dp2_over_dp1_request_throughput": ratio("dp2", "dp1"),
            "dp2_over_dp1_1thread_request_throughput": ratio("dp2", "dp1_1thread"),
            "dp2_threads_over_dp1_1thread_request_throughput": ratio("dp2_threads", "dp1_1thread"),
            "samples": {name: {f"c{c}": samples[name][c] for c in CONCURRENCY} for name in VARIANTS}}


def _medians(levels: list[dict[str, Any]]) -> dict[str, float]:
    return {"request_throughput": statistics.median(x["request_throughput"] for x in levels),
            "output_tokens_per_s": statistics.median(x["output_tokens_per_s"] for x in levels),
            "ttft_p50_ms": statistics.median(x["ttft_ms"]["p50"] for x in levels),
            "tpot_p50_ms": statistics.median(x["tpot_ms"]["p50"] for x in levels)}


def headline_figures(result: dict) -> dict[str, float]:
    out = {}
    for c in result["dp2_over_dp1_request_throughput"]:
        for name in VARIANTS:
            out[f"{name} req/s {c}"] = result["medians"][name][c]["request_throughput"]
        out[f"dp2/dp1 {c}"] = result["dp2_over_dp1_request_throughput"][c]
        out[f"dp2/dp1_1thread {c}"] = result["dp2_over_dp1_1thread_request_throughput"][c]
        out[f"dp2_threads/dp1_1thread {c}"] = result["dp2_threads_over_dp1_1thread_request_throughput"][c]
    return out


def summarize(result: dict) -> str:
    ratios = {"dp2/dp1": "dp2_over_dp1_request_throughput", "dp2/dp1_1t": "dp2_over_dp1_1thread_request_throughput",
              "dp2_threads/dp1_1t": "dp2_threads_over_dp1_1thread_request_throughput"}
    lines = [f"{'streams':>8}" + "".join(f"{name + ' req/s':>18}" for name in VARIANTS)
             + "".join(f"{label:>20}" for label in ratios)]
    for c in result["dp2_over_dp1_request_throughput"]:
        m = result["medians"]
        lines.append(f"{c[1:]:>8}" + "".join(f"{m[name][c]['request_throughput']:>18.2f}" for name in VARIANTS)
                     + "".join(f"{result[key][c]:>20.2f}" for key in ratios.values()))
    lines.append("TPOT p50 (ms): " + "; ".join(
        f"{name} " + " / ".join(f"{result['medians'][name][c]['tpot_p50_ms']:.1f}" for c in result["medians"][name])
        for name in VARIANTS))
    lines.append(f"load average before {result['config']['load_avg_before']}, after {result['config']['load_avg_after']}")
    return "\n".join(lines)
