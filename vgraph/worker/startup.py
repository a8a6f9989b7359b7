"""What the runner's startup did, phase by phase: the engine and the CLI read this, never the
runner's internals. The engine adds what happened before the runner (the process's imports,
config and tokenizer) and logs the whole timeline as one ``startup:`` line."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..models.loader import format_bytes
from .cuda_graphs import CaptureReport
from .kv_sizing import MemoryProfile


def process_age() -> Optional[float]:
    """Seconds since this process started (Linux: from /proc), None where that is unknown.
    Why: on a warm start most of the wait is before the engine exists (Python, torch,
    transformers and Inductor imports), and an operator should see it in the same line."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class StartupReport:
    load_seconds: float  # model build + weights (and the CPU kernels' build or load)
    weights_bytes: int
    kv_seconds: float  # memory profile (CUDA), sizing and allocating the KV cache
    num_blocks: int
    kv_bytes: int
    profile: Optional[MemoryProfile]  # the profiled step (CUDA, KV sized from memory), else None
    compile_seconds: float  # compile or cache load, and the warm-up step (0 work when eager)
    capture: CaptureReport  # empty where nothing is captured (CPU, graphs off); its
    # estimated_bytes is what the KV sizing left free for capture
    compile_source: str = ""  # "loaded from the compile cache", "compiled", or "" (eager)

    def timeline(self) -> str:
        source = f" ({self.compile_source})" if self.compile_source else ""
        return (f"load {self.load_seconds:.2f} s ({format_bytes(self.weights_bytes)} of weights), "
                f"KV cache {self.kv_seconds:.2f} s ({self.num_blocks} blocks, {format_bytes(self.kv_bytes)}), "
                f"compile + warm-up {self.compile_seconds:.2f} s{source}, graph capture {self.capture.seconds:.2f} s "
                f"({self.capture.full_graphs + self.capture.piecewise_graphs} graphs)")


def engine_timeline(before_engine: Optional[float], config_and_tokenizer: float, runner: StartupReport,
                    ready_after_start: Optional[float]) -> str:
    """The ``startup:`` line: each phase from process start to a ready engine, in order."""
    head = f"{before_engine:.2f} s before the engine (Python, imports), " if before_engine is not None else ""
    tail = f"; ready {ready_after_start:.2f} s after process start" if ready_after_start is not None else ""
    return f"{head}config + tokenizer {config_and_tokenizer:.2f} s, {runner.timeline()}{tail}"
