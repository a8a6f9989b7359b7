"""The Ray executor's cost per step against the mp executor's, TP=2 on the perf model.

Both executors drive the same ranks (worker.run_rank) over one connection per rank: a pipe to a
spawned process (mp), a TCP connection to a Ray actor (ray). So the question is only what the
transport and Ray's supervision add to each step; the target is under 1 ms per step.

Measured in one process, both engines alive (compiled, fp32 on CPU, one torch thread per rank),
the Ray one on a local Ray instance it starts itself, interleaved rounds, medians:

- **round trip**: the engine -> every rank -> engine exchange with no model work (the
  compile-counters query), ``ROUND_TRIPS`` times per round: the floor of the per-step cost.
- **steps**: one offline batch (``REQUESTS`` prompts of ``PROMPT_LEN`` tokens, ``NEW_TOKENS``
  greedy tokens each) through ``LLM.step``, each step timed; decode steps (every request
  decoding) and prefill steps apart. Tokens must be equal.

The per-step cost of Ray is each median minus mp's. The load average before and after is in the
file: the 2-core machine is shared, and a busy neighbour moves every figure.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

ROUNDS = 5
ROUND_TRIPS = 200
REQUESTS, PROMPT_LEN, NEW_TOKENS = 8, 64, 64
QUICK = dict(rounds=1, round_trips=30, requests=4, prompt_len=32, new_tokens=8)
SYSTEMS = ("mp", "ray")
# Every rank runs one torch thread already (2 ranks on 2 cores): a threads-1 rerun would repeat it.
THREADS_1_BUILT_IN = True


def _workload(quick: bool) -> dict:
    if quick:
        return dict(QUICK)
    return dict(rounds=ROUNDS, round_trips=ROUND_TRIPS, requests=REQUESTS, prompt_len=PROMPT_LEN,
                new_tokens=NEW_TOKENS)


def run(device: str, quick: bool = False) -> dict:
    from vgraph import LLM
    from vgraph.testing.checkpoints import build_perf_checkpoint

    from .compile import git_state
    from .tensor_parallel import _prompts, _round_trip_s, _run_batch

    w = _workload(quick)
    load_before = os.getloadavg()
    git = git_state()
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-ray-") as tmp:
        path = build_perf_checkpoint(os.path.join(tmp, "ckpt"), seed=0)
        kw = dict(dtype="bfloat16" if device == "cuda" else "float32", device=device, max_model_len=1024,
                  num_gpu_blocks=512, tensor_parallel_size=2)
        llms, builds = {}, {}
        for name in SYSTEMS:
            t0 = time.perf_counter()
            llms[name] = LLM(path, distributed_executor_backend=name, **kw)
            builds[name] = time.perf_counter() - t0
        prompts = _prompts(w, llms["mp"].engine.vocab_size)
        runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
        trips: dict[str, list[float]] = {name: [] for name in SYSTEMS}
        for r in range(w["rounds"]):
            for name in (SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))):
                runs[name].append(_run_batch(llms[name], prompts, w["new_tokens"]))
                trips[name].append(_round_trip_s(llms[name].engine.runner, w["round_trips"]))
        counters = {name: [c.as_dict() if c is not None else None
                           for c in llms[name].engine.runner.collect_compile_counters()] for name in SYSTEMS}
        for llm in llms.values():
            llm.close()
    return _result(device, w, runs, trips, builds, counters, load_before, git)


def _result(device: str, w: dict, runs: dict, trips: dict, builds: dict, counters: dict, load_before: Any,
            git: Any) -> dict:
    systems = {}
    for name, rs in runs.items():
        systems[name] = {
            "round_trip_ms": 1e3 * statistics.median(trips[name]),
            "round_trip_samples_ms": [1e3 * t for t in trips[name]],
            "decode_step_ms": 1e3 * statistics.median(s for r in rs for s in r["decode_step_s"]),
            "prefill_step_ms": 1e3 * statistics.median(s for r in rs for s in r["prefill_step_s"]),
            "median_wall_s": statistics.median(r["wall_s"] for r in rs),
            "decode_steps_per_round": len(rs[0]["decode_step_s"]), "build_s": builds[name]}
    mp, ray = systems["mp"], systems["ray"]
    return {
        "suite": "ray-executor",
        "config": {**w, "device": device, "checkpoint": "build_perf_checkpoint(seed=0)", "compiled": True,
                   "tensor_parallel_size": 2, "torch_threads_per_rank": max(1, (os.cpu_count() or 1) // 2),
                   "ray_cluster": "a local Ray instance started by the executor (one node)",
                   "loadavg_before_after": [load_before, os.getloadavg()], "git": git,
                   "compile_counters": counters},
        "systems": systems,
        "tokens_equal": all(a["tokens"] == b["tokens"] for a, b in zip(runs["mp"], runs["ray"])),
        "ray_minus_mp_ms": {"round_trip": ray["round_trip_ms"] - mp["round_trip_ms"],
                            "decode_step": ray["decode_step_ms"] - mp["decode_step_ms"],
                            "prefill_step": ray["prefill_step_ms"] - mp["prefill_step_ms"]},
        "target": "ray adds < 1 ms per step over mp",
    }


def summarize(result: dict) -> str:
    c, s, d = result["config"], result["systems"], result["ray_minus_mp_ms"]
    load = c["loadavg_before_after"]
    lines = [f"ray-executor ({c['device']}): TP=2, {c['requests']} prompts x {c['prompt_len']} tokens, "
             f"{c['new_tokens']} new each, compiled, median of {c['rounds']} interleaved rounds; load average "
             f"{load[0][0]:.2f} before, {load[1][0]:.2f} after",
             f"  {'system':<8}{'round trip ms':>15}{'decode ms':>11}{'prefill ms':>12}{'wall s':>9}{'build s':>9}"]
    for name, x in s.items():
        lines.append(f"  {name:<8}{x['round_trip_ms']:>15.3f}{x['decode_step_ms']:>11.2f}{x['prefill_step_ms']:>12.2f}"
                     f"{x['median_wall_s']:>9.2f}{x['build_s']:>9.1f}")
    lines.append(f"  ray - mp per step: round trip {d['round_trip']:+.3f} ms, decode step {d['decode_step']:+.2f} ms, "
                 f"prefill step {d['prefill_step']:+.2f} ms (target < 1 ms); tokens equal: {result['tokens_equal']}")
    return "\n".join(lines)


def headline_figures(result: dict) -> dict[str, float]:
    s, d = result["systems"], result["ray_minus_mp_ms"]
    return {"mp round trip ms": s["mp"]["round_trip_ms"], "ray round trip ms": s["ray"]["round_trip_ms"],
            "mp decode step ms": s["mp"]["decode_step_ms"], "ray decode step ms": s["ray"]["decode_step_ms"],
            "ray - mp decode step ms": d["decode_step"]}
