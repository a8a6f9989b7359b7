"""An optional per-step trace of the engine loop: ``VGRAPH_STEP_TRACE=/path/file.jsonl``.

Why: a stream's inter-token gap seen by an HTTP client is the sum of the engine step that made
the token and everything after it (the transport, the output processor, the SSE write, the
client's own loop). One line per step with wall-clock times (``time.time()``, comparable across
processes) shows which steps were long and what they carried, so a client-side stall can be laid
next to the engine's steps. Off unless the variable is set; when on, it costs one small dict per
step, buffered and written every ``FLUSH_EVERY`` steps and at the end.
"""
from __future__ import annotations

import gc
import json
import os
import time
from typing import Any, Optional

ENV = "VGRAPH_STEP_TRACE"
FLUSH_EVERY = 256


class StepTrace:
    """Collects one record per step and appends them to the file named by ``VGRAPH_STEP_TRACE``."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self._records: list[dict[str, Any]] = []
        self._gc_start: Optional[float] = None
        self._gc_pauses: list[tuple[float, float, int]] = []  # (start, seconds, generation) since the last step
        if path:
            gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls) -> "StepTrace":
        return cls(os.environ.get(ENV) or None)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def record(self, start: float, end: float, step: Any, num_commands: int) -> None:
        """One step: its wall-clock start and end, what it produced and the engine's state after."""
        if not self.enabled:
            return
        prefills = sum(1 for t in step.timings if t.queue_time is not None)
        self._records.append({"start": start, "end": end, "deltas": len(step.deltas), "first_scheduled": prefills,
                              "running": step.stats.num_running, "waiting": step.stats.num_waiting,
                              "commands": num_commands, "gc": self._gc_pauses})
        self._gc_pauses = []
        if len(self._records) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self.enabled or not self._records:
            return
        with open(self.path, "a") as out:
            out.writelines(json.dumps(r) + "\n" for r in self._records)
        self._records = []

    def _on_gc(self, phase: str, info: dict) -> None:
        """Garbage-collector pauses of this process, attributed to the step they fell in."""
        if phase == "start":
            self._gc_start = time.time()
        elif self._gc_start is not None:
            self._gc_pauses.append((self._gc_start, time.time() - self._gc_start, info.get("generation", -1)))
            self._gc_start = None
