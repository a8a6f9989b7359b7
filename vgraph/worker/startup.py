"""What the runner's startup did, phase by phase: the engine and the CLI read this, never the
runner's internals."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..models.loader import format_bytes
from .cuda_graphs import CaptureReport
from .kv_sizing import MemoryProfile


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

    def timeline(self) -> str:
        return (f"load {self.load_seconds:.2f} s ({format_bytes(self.weights_bytes)} of weights), "
                f"KV cache {self.kv_seconds:.2f} s ({self.num_blocks} blocks, {format_bytes(self.kv_bytes)}), "
                f"compile + warm-up {self.compile_seconds:.2f} s, graph capture {self.capture.seconds:.2f} s "
                f"({self.capture.full_graphs + self.capture.piecewise_graphs} graphs)")
