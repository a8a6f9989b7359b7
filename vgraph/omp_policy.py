"""How long torch's idle OpenMP threads spin before they sleep: vgraph's default, set before
torch loads (libgomp reads it once, when the library initializes).

Why vgraph sets one: libgomp's default is to poll ~300,000 times (a few ms) between parallel
regions. On a quiet machine that saves a wake-up per region; beside any other busy process it
is ruinous: the spinning team members hold the cores that a descheduled member needs to reach
the barrier, and a decode step is hundreds of regions (issue 33: 0.35x of quiet throughput
with one spinning neighbour on 2 cores). The serving processes share their cores by design
(the HTTP server, the engine-core process, the load's clients), so ``vgraph serve`` has the
same problem. ``GOMP_SPINCOUNT=SPIN_COUNT`` (a ~10 us spin, then sleep) was measured by
``python -m perf run busy-neighbour`` against the libgomp default, longer spins and
``OMP_WAIT_POLICY=PASSIVE`` on quiet and shared machines (figures: docs/performance).

A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` always wins, and nothing is set once
torch is imported (too late to matter, and a process that imported torch first chose already).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

SPIN_COUNT = "1000"
USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_default(environ: Optional[dict] = None) -> Optional[str]:
    """Sets ``GOMP_SPINCOUNT`` unless the user chose a policy or torch is loaded; returns what
    it set (None: nothing)."""
    env = os.environ if environ is None else environ
    if any(key in env for key in USER_KEYS) or "torch" in sys.modules:
        return None
    env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return SPIN_COUNT
