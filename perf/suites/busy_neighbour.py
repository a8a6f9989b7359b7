"""Offline throughput on a quiet machine and beside a busy neighbour, per OpenMP wait policy.

Why: torch's CPU kernels run on an OpenMP team (libgomp) with one thread per core. Between
parallel regions an idle team thread spins (by default for ~300,000 iterations) before it
sleeps. On a quiet machine that saves the wake-up latency of every region; when another process
holds one of the cores, the spinning threads and the descheduled one cost every barrier a
scheduler time slice, and throughput collapses (issue 33: 0.35x of quiet on 2 cores). The wait
policy is read once, when the OpenMP runtime loads, so each policy runs in a fresh process.

What runs: ``LLM.generate`` of the perf Llama (``cpu-peers``' ``llama-24m``, fp32, compiled),
``PROMPTS`` prompts of ``PROMPT_LEN`` random token ids, ``MAX_TOKENS`` new tokens each, greedy,
EOS ignored; each child builds the engine, warms up with one full run, then times ``REPS`` runs
and reports the best (the least disturbed by the machine's other tenants). Busy: a child process
spinning in pure Python, pinned to the last core, started before the engine child and stopped
after it. Policies x {quiet, busy} are interleaved per round, the order reversed every other
round, and the load average is recorded with each measurement.

The ``vgraph-default`` row sets nothing: it is what a user gets from ``import vgraph`` before
torch (``vgraph/omp_policy.py``: passive waiting when other threads are runnable as it loads,
else ``GOMP_SPINCOUNT=1000``; each sample records what it chose). The other rows set the policy
explicitly, which vgraph leaves alone. ``VGRAPH_BUSY_POLICIES=a,b`` runs only those rows.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

THREADS_1_BUILT_IN = True  # each child runs at every core; one thread is a policy row of its own
PROMPTS, PROMPT_LEN, MAX_TOKENS = 32, 32, 64
REPS = 3
ROUNDS = 2
CHILD_TIMEOUT_S = 900
OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
# name -> environment; "vgraph-default" is vgraph's own choice (nothing set).
POLICIES: dict[str, dict[str, str]] = {
    "vgraph-default": {},
    "libgomp-default": {"GOMP_SPINCOUNT": "300000"},
    "spincount-10000": {"GOMP_SPINCOUNT": "10000"},
    "spincount-1000": {"GOMP_SPINCOUNT": "1000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def spinner(core: int) -> subprocess.Popen:
    """A neighbour that keeps one core busy: a pure-Python loop pinned to ``core``, which ends
    by itself when this process is gone (a killed suite leaves no spinner behind)."""
    code = (f"import os\nparent = os.getppid()\nos.sched_setaffinity(0, {{{core}}})\n"
            "while os.getppid() == parent:\n    for _ in range(1_000_000):\n        pass\n")
    return subprocess.Popen([sys.executable, "-c", code])


def child_env(policy: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OMP_KEYS and k != "TRITON_INTERPRET"}
    env.update(policy)
    return env


def measure_once(checkpoint: str, policy: str, busy: bool) -> dict:
    """One child run of ``policy``, quiet or beside the spinner; its JSON result."""
    neighbour = spinner((os.cpu_count() or 1) - 1) if busy else None
    load = os.getloadavg()
    try:
        proc = subprocess.run([sys.executable, "-m", "perf.suites.busy_neighbour", checkpoint],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=child_env(POLICIES[policy]))
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{policy} ({'busy' if busy else 'quiet'}) failed: {proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**out, "load_avg_before": load, "load_avg_after": os.getloadavg()}


def child(checkpoint: str) -> dict:
    """In the child: build, warm up, time ``REPS`` runs; tokens/s of the best."""
    import random

    import torch
    from perf.suites.offline import Requests, VgraphSystem
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    requests = Requests(prompts, [MAX_TOKENS] * PROMPTS)
    system = VgraphSystem(checkpoint, "cpu", [requests], compiled=True)
    system.generate(requests)
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        system.generate(requests)
        times.append(time.perf_counter() - start)
    return {"tok_s": requests.generated_tokens / min(times), "seconds": times, "torch_threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in OMP_KEYS}}


def run(device: str, quick: bool = False) -> dict:
    if device != "cpu":
        raise ValueError("busy-neighbour is a CPU suite: --device cpu")
    from .compile import git_state
    from .serving_vllm import _checkpoint
    load_before, git = os.getloadavg(), git_state()
    checkpoint = _checkpoint()
    names = [p for p in os.environ.get("VGRAPH_BUSY_POLICIES", "").split(",") if p] or list(POLICIES)
    names = names if not quick else names[:2]
    cells = [(p, busy) for p in names for busy in (False, True)]
    samples: dict[str, dict[str, list[dict]]] = {p: {"quiet": [], "busy": []} for p in names}
    for r in range(1 if quick else ROUNDS):
        for policy, busy in (cells if r % 2 == 0 else list(reversed(cells))):
            out = measure_once(checkpoint, policy, busy)
            samples[policy]["busy" if busy else "quiet"].append(out)
            print(f"  round {r} {policy:16s} {'busy ' if busy else 'quiet'} {out['tok_s']:7.0f} tok/s "
                  f"(load {out['load_avg_before'][0]:.2f})", flush=True)
    return {"suite": "busy-neighbour", "policies": {p: policy_summary(s) for p, s in samples.items()},
            "samples": samples,
            "config": {"checkpoint": checkpoint, "prompts": PROMPTS, "prompt_len": PROMPT_LEN, "max_tokens": MAX_TOKENS,
                       "reps_per_child": REPS, "policy_env": {p: POLICIES[p] for p in names},
                       "neighbour": "pure-Python busy loop pinned to the last core", "git": git,
                       "load_avg_before": load_before, "load_avg_after": os.getloadavg()}}


def policy_summary(cells: dict[str, list[dict]]) -> dict:
    quiet = statistics.median(s["tok_s"] for s in cells["quiet"])
    busy = statistics.median(s["tok_s"] for s in cells["busy"])
    return {"quiet_tok_s": quiet, "busy_tok_s": busy, "busy_over_quiet": busy / quiet}


def summarize(result: dict) -> str:
    lines = [f"{'policy':18s} {'quiet tok/s':>11s} {'busy tok/s':>11s} {'busy/quiet':>10s} {'vs best quiet':>13s}"]
    best_quiet = max(p["quiet_tok_s"] for p in result["policies"].values())
    for name, p in result["policies"].items():
        lines.append(f"{name:18s} {p['quiet_tok_s']:11.0f} {p['busy_tok_s']:11.0f} {p['busy_over_quiet']:10.2f} "
                     f"{p['quiet_tok_s'] / best_quiet:13.2f}")
    lines.append(f"(medians over rounds of each child's best of {REPS}; {PROMPTS} prompts x {MAX_TOKENS} tokens)")
    return "\n".join(lines)


def headline(result: dict, policy: Optional[str] = "vgraph-default") -> dict:
    return result["policies"][policy]


if __name__ == "__main__":
    import vgraph  # noqa: F401  (first: its OpenMP default applies only before torch loads)
    print(json.dumps(child(sys.argv[1])))
