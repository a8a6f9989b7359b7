"""How many torch threads a CPU forward runs with: all of them, or one, per step size, by
measurement.

Why: a small step (a decode of a few sequences of a small model) is mostly parallel regions of
a few microseconds each: Inductor's norm, RoPE and SiLU loops, which always fork, and the
attention. Each region wakes the idle OpenMP team: a few microseconds while it still spins,
tens once it sleeps, and it sleeps at once under the passive wait policy that vgraph picks
beside a busy neighbour (``omp_policy``). Measured on the demo model, 2 cores, one decode step:
at batch 1, 0.59 / 0.64 ms on 2 / 1 threads with the short spin and 1.94 / 0.66 ms passive; at
16 sequences 1.11 / 1.46 ms (spin) and 3.08 / 1.40 ms (passive). A model with larger weights
gains from every thread at any batch. Which side wins depends on the model, the step and the
machine's load, so it is measured where it runs: each size class (the step's token count, by
its bit length) alternates between all threads and one until each has ``TRIALS`` forwards
after a first one (which pays first touches of fresh memory), takes one thread only if its
median is at least ``MARGIN`` faster, and measures again after ``RETRY_EVERY`` steps of the
class (a neighbour may have come or gone). A class larger than one that chose every thread
takes every thread too, unmeasured. Steps of more than ``MAX_MEASURED_TOKENS`` tokens always
take every thread: their regions are long enough to repay the wake-ups, and a noisy
measurement there would cost most (a prefill on one thread takes up to twice as long). Outputs
do not depend on the thread count (every kernel sums each output in one fixed order), so the
choice changes timing only.

Only for a single-rank CPU engine with more than one torch thread: ranks of a parallel group
wait on each other, so one rank's timing would measure the others. ``VGRAPH_CPU_STEP_THREADS=all``
keeps every step on all threads (to measure the difference).
"""
from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

logger = logging.getLogger("vgraph")

TRIALS = 4  # forwards per side before a size class chooses (after one not counted)
MARGIN = 0.9  # one thread is chosen only when its median forward is at most this fraction of all threads' one
MAX_MEASURED_TOKENS = 256  # larger steps always run on all threads
RETRY_EVERY = 512  # steps of a size class between two measurements
ENV = "VGRAPH_CPU_STEP_THREADS"  # "all": no measuring, every step on all threads


@dataclass(slots=True)
class _SizeClass:
    """One size class's choice, or its measurement in progress (``samples``: seconds per side)."""

    choice: Optional[int] = None
    measuring: bool = True
    steps: int = 0  # since the last choice
    samples: dict[int, list[float]] = field(default_factory=dict)


class StepThreads:
    """Chooses each CPU forward's thread count (``forward``); ``threads`` is the engine's count."""

    def __init__(self, threads: int) -> None:
        if threads < 2:
            raise ValueError(f"StepThreads chooses between several threads and one, got {threads}")
        self.threads = threads
        self._classes: dict[int, _SizeClass] = {}

    @classmethod
    def for_engine(cls, device: torch.device, ranks: int, fixed_threads: bool = False) -> Optional["StepThreads"]:
        """The chooser for a runner on ``device`` in a group of ``ranks``; None where nothing is
        to choose (a GPU, one thread, several ranks, ``VGRAPH_CPU_STEP_THREADS=all``) or where
        the thread count must stay as it is (``fixed_threads``: the forward guards on it)."""
        threads = torch.get_num_threads()
        if (device.type != "cpu" or threads < 2 or ranks > 1 or fixed_threads
                or os.environ.get(ENV, "").lower() == "all"):
            return None
        return cls(threads)

    def threads_for(self, num_tokens: int) -> int:
        """The thread count for the next forward of ``num_tokens`` tokens."""
        if num_tokens > MAX_MEASURED_TOKENS or self._smaller_class_took_all(num_tokens.bit_length()):
            return self.threads
        size = self._classes.setdefault(num_tokens.bit_length(), _SizeClass())
        if not size.measuring:
            size.steps += 1
            if size.steps <= RETRY_EVERY:
                return size.choice
            size.measuring, size.samples = True, {}
        many, one = (len(size.samples.get(t, ())) for t in (self.threads, 1))
        return self.threads if many <= one else 1

    def _smaller_class_took_all(self, bits: int) -> bool:
        """Whether a class of fewer tokens than ``bits`` chose every thread: a larger step has
        longer parallel regions, so it gains at least as much from them, and is not measured.
        Why: measuring alternates, so half of a class's trial forwards run on one thread; for
        steps that come rarely (a lone prompt's prefill between the decodes of a served batch)
        the trials never end, and each costs up to twice its forward. Served (``perf run
        serving-vllm``, 4 paired rounds): every step on all threads made 24.45 req/s against the
        chooser's 23.43 without this rule, 24.97 against 24.39 with it."""
        return any(c.choice == self.threads for b, c in self._classes.items() if b < bits)

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A forward's time; the size class chooses once both sides have ``TRIALS`` (each
        side's first forward is dropped)."""
        size = self._classes.get(num_tokens.bit_length()) if num_tokens <= MAX_MEASURED_TOKENS else None
        if size is None or not size.measuring:
            return
        size.samples.setdefault(threads, []).append(seconds)
        if len(size.samples) == 2 and all(len(s) > TRIALS for s in size.samples.values()):
            medians = {t: statistics.median(s[1:]) for t, s in size.samples.items()}
            choice = 1 if medians[1] <= MARGIN * medians[self.threads] else self.threads
            if choice != size.choice:
                logger.debug("CPU steps of %d-%d tokens: %d thread(s) (median forward %.3f ms on %d, %.3f ms on 1)",
                             1 << max(0, num_tokens.bit_length() - 1), (1 << num_tokens.bit_length()) - 1, choice,
                             medians[self.threads] * 1e3, self.threads, medians[1] * 1e3)
            size.choice, size.measuring, size.steps, size.samples = choice, False, 0, {}

    @contextlib.contextmanager
    def forward(self, num_tokens: int) -> Iterator[None]:
        """Runs the block (one forward) on the chosen threads, times it, restores the count."""
        threads = self.threads_for(num_tokens)
        if threads != self.threads:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            if threads != self.threads:
                torch.set_num_threads(self.threads)
        self.record(num_tokens, threads, seconds)
