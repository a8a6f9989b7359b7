"""The Ray executor's cost per step against the mp executor's, TP=2 on the perf model.

Both executors drive the same ranks (worker.run_rank) over one connection per rank: a pipe to a
spawned process (mp), a TCP connection to a Ray actor (ray). So the question is only what the
transport and Ray's supervision add to each step; the target is under 1 ms per step.

Measured in one process, both engines alive (compiled, fp32 on CPU, one torch thread per rank),
the Ray one on a local Ray instance it starts itself, interleaved rounds, medians:

- **round trip**: the engine -> every rank -> engine exchange with no model work (the
  compile-counters query), ``ROUND_TRIPS`` times per round: the floor of the per-step cost;
  and the same query carrying ``PAYLOAD_BYTES`` (which the ranks ignore), the size of a large
  prefill's plan, where a transport's buffering shows (a TCP connection with Nagle's algorithm
  on stalled ~40 ms here).
- **steps**: one offline batch (``REQUESTS`` prompts of ``PROMPT_LEN`` tokens, ``NEW_TOKENS``
  greedy tokens each) through both engines in lockstep: one ``LLM.step`` of mp, then the same
  step of ray (the order alternating by round), each timed; decode steps (every request
  decoding) and prefill steps apart. Tokens must be equal.

The per-step cost of Ray is the median of the paired differences (ray's step minus mp's same
step, taken a few milliseconds apart, so a busy neighbour hits both alike), beside each
system's medians. The load average before and after is in the file: the 2-core machine is
shared, and a busy neighbour moves every absolute figure.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

ROUNDS = 5
ROUND_TRIPS = 200
PAYLOAD_BYTES = 64 * 1024
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
    from .tensor_parallel import _prompts, _round_trip_s

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
        big_trips: dict[str, list[float]] = {name: [] for name in SYSTEMS}
        for r in range(w["rounds"]):
            order = SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))
            for name, run_ in _lockstep({n: llms[n] for n in order}, prompts, w["new_tokens"]).items():
                runs[name].append(run_)
            for name in order:
                trips[name].append(_round_trip_s(llms[name].engine.runner, w["round_trips"]))
                big_trips[name].append(_payload_round_trip_s(llms[name].engine.runner, w["round_trips"]))
        counters = {name: [c.as_dict() if c is not None else None
                           for c in llms[name].engine.runner.collect_compile_counters()] for name in SYSTEMS}
        for llm in llms.values():
            llm.close()
    return _result(device, w, runs, trips, big_trips, builds, counters, load_before, git)


def _payload_round_trip_s(executor: Any, reps: int) -> float:
    """Median seconds of the compile-counters exchange with ``PAYLOAD_BYTES`` riding along
    (the ranks answer it the same; the payload only crosses the transport)."""
    from vgraph.distributed.worker import COUNTERS

    payload = bytes(PAYLOAD_BYTES)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        executor._broadcast((COUNTERS, payload))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _lockstep(llms: dict[str, Any], prompts: list[list[int]], new_tokens: int) -> dict[str, dict]:
    """The batch through every engine, one step of each in turn (same step index, same batch),
    each step timed; a step is a prefill step when any request still has prompt to run."""
    from vgraph import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    runs = {name: {"tokens": {}, "decode_step_s": [], "prefill_step_s": [], "wall_s": 0.0} for name in llms}
    for name, llm in llms.items():
        for i, p in enumerate(prompts):
            llm.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while any(llm.engine.has_unfinished_requests() for llm in llms.values()):
        for name, llm in llms.items():
            engine, run_ = llm.engine, runs[name]
            if not engine.has_unfinished_requests():
                continue
            prefilling = engine.scheduler.num_waiting > 0 or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
            t0 = time.perf_counter()
            out = llm.step()
            elapsed = time.perf_counter() - t0
            run_["wall_s"] += elapsed
            (run_["prefill_step_s"] if prefilling else run_["decode_step_s"]).append(elapsed)
            run_["tokens"].update((o.request_id, o.outputs[0].token_ids) for o in out.outputs if o.finished)
    for run_ in runs.values():
        run_["tokens"] = [run_["tokens"][f"r{i}"] for i in range(len(prompts))]
    return runs


def _paired_ms(runs: dict, kind: str) -> float:
    """Median over every step of (ray's time - mp's time for the same step), in ms."""
    diffs = [b - a for ra, rb in zip(runs["mp"], runs["ray"])
             for a, b in zip(ra[f"{kind}_step_s"], rb[f"{kind}_step_s"])]
    return 1e3 * statistics.median(diffs)


def _result(device: str, w: dict, runs: dict, trips: dict, big_trips: dict, builds: dict, counters: dict,
            load_before: Any, git: Any) -> dict:
    systems = {}
    for name, rs in runs.items():
        systems[name] = {
            "round_trip_ms": 1e3 * statistics.median(trips[name]),
            "round_trip_samples_ms": [1e3 * t for t in trips[name]],
            "round_trip_64k_ms": 1e3 * statistics.median(big_trips[name]),
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
                            "round_trip_64k": ray["round_trip_64k_ms"] - mp["round_trip_64k_ms"],
                            "decode_step": _paired_ms(runs, "decode"),
                            "prefill_step": _paired_ms(runs, "prefill")},
        "ray_minus_mp_note": "round trip: difference of medians; steps: median of paired per-step differences",
        "target": "ray adds < 1 ms per step over mp",
    }


def summarize(result: dict) -> str:
    c, s, d = result["config"], result["systems"], result["ray_minus_mp_ms"]
    load = c["loadavg_before_after"]
    lines = [f"ray-executor ({c['device']}): TP=2, {c['requests']} prompts x {c['prompt_len']} tokens, "
             f"{c['new_tokens']} new each, compiled, median of {c['rounds']} interleaved rounds; load average "
             f"{load[0][0]:.2f} before, {load[1][0]:.2f} after",
             f"  {'system':<8}{'round trip ms':>15}{'64 KiB trip ms':>16}{'decode ms':>11}{'prefill ms':>12}"
             f"{'wall s':>9}{'build s':>9}"]
    for name, x in s.items():
        lines.append(f"  {name:<8}{x['round_trip_ms']:>15.3f}{x['round_trip_64k_ms']:>16.3f}{x['decode_step_ms']:>11.2f}"
                     f"{x['prefill_step_ms']:>12.2f}{x['median_wall_s']:>9.2f}{x['build_s']:>9.1f}")
    lines.append(f"  ray - mp per step: round trip {d['round_trip']:+.3f} ms (64 KiB: {d['round_trip_64k']:+.3f}), "
                 f"decode step {d['decode_step']:+.2f} ms, "
                 f"prefill step {d['prefill_step']:+.2f} ms (target < 1 ms); tokens equal: {result['tokens_equal']}")
    return "\n".join(lines)


def headline_figures(result: dict) -> dict[str, float]:
    s, d = result["systems"], result["ray_minus_mp_ms"]
    return {"mp round trip ms": s["mp"]["round_trip_ms"], "ray round trip ms": s["ray"]["round_trip_ms"],
            "mp decode step ms": s["mp"]["decode_step_ms"], "ray decode step ms": s["ray"]["decode_step_ms"],
            "ray - mp decode step ms": d["decode_step"]}
