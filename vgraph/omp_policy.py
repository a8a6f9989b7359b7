"""How torch's idle OpenMP threads wait between parallel regions: vgraph's default, chosen on
``import vgraph`` before torch loads (libgomp reads it once, when the library initializes).

Why vgraph chooses: libgomp's default is to poll ~300,000 times (a few ms) between parallel
regions. On a quiet machine that saves a wake-up per region; beside any other busy process it
is ruinous: the spinning team members hold the cores that a descheduled member needs to reach
the barrier, and a decode step is hundreds of regions (issue 33: 0.35x of quiet throughput
with one spinning neighbour on 2 cores; on this shared VM 10x slower). The serving processes
share their cores by design (the HTTP server, the engine-core process, the clients), so
``vgraph serve`` meets the same problem.

The choice, measured by ``python -m perf run busy-neighbour`` (figures: docs/performance):
- other threads already runnable on this machine when vgraph loads (``/proc/loadavg``'s
  running count, the fewest of a few reads, at least half the machine's CPUs: the count is
  machine-wide, so it is weighed against all of them): ``OMP_WAIT_POLICY=PASSIVE``,
  which keeps the most throughput beside busy neighbours. The process that started this one
  is no neighbour and is not counted: a launcher is busy for a moment starting its children
  (a benchmark harness importing its HTTP client while ``vgraph serve`` imports vgraph) and
  then waits. Counted, such a blip made a whole server wait passively for its lifetime: 16.7
  against 20.8 req/s spinning on a quiet 2-core machine (``perf run serving-vllm``);
- otherwise ``GOMP_SPINCOUNT=1000`` (a ~10 us spin, then sleep): within ~8% of libgomp's spin
  on a quiet machine, and no collapse when a neighbour starts later.

A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` always wins, and nothing is set once
torch is imported (too late to matter: the process chose when torch loaded).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

SPIN_COUNT = "1000"
USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SAMPLES, SAMPLE_INTERVAL_S = 3, 0.002


def apply_default(environ: Optional[dict] = None) -> Optional[dict[str, str]]:
    """Sets the policy ``choose`` picks unless the user chose one or torch is loaded; returns
    what it set (None: nothing)."""
    env = os.environ if environ is None else environ
    if any(key in env for key in USER_KEYS) or "torch" in sys.modules:
        return None
    policy = choose(os.cpu_count() or 1, other_runnable())
    env.update(policy)
    return policy


def choose(cores: int, others: int) -> dict[str, str]:
    """Passive waiting when ``others`` runnable threads hold at least half of the ``cores``,
    else a short spin (see the module doc)."""
    if others >= max(1, cores // 2):
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def other_runnable(proc: str = "/proc", launcher: Optional[int] = None) -> int:
    """Threads runnable right now besides this one and its ``launcher`` (the parent process
    by default): the fewest over ``SAMPLES`` reads (a passing blip is not a neighbour); 0
    where the kernel does not say."""
    launcher = os.getppid() if launcher is None else launcher
    counts = []
    for i in range(SAMPLES):
        try:
            with open(f"{proc}/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        counts.append(max(0, running - 1 - running_threads(launcher, proc)))
        if i + 1 < SAMPLES:
            time.sleep(SAMPLE_INTERVAL_S)
    return min(counts)


def running_threads(pid: int, proc: str = "/proc") -> int:
    """How many of process ``pid``'s threads are running or runnable (state R); 0 when it
    cannot be read (gone, another user's on a hardened kernel, no /proc)."""
    try:
        tasks = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        try:
            with open(f"{proc}/{pid}/task/{task}/stat") as f:
                # "pid (comm) S ...": the state follows the command name, which may hold spaces.
                count += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return count
