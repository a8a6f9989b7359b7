"""Steps submitted now and collected later, in order: on a worker thread, or at once.

Overlapped scheduling needs the model's step to run while the engine's thread schedules the
next one. A GPU runs its kernels asynchronously, but the host still blocks reading the sampled
ids; a CPU computes on the calling thread. One worker thread covers both: the step (batch
build, forward, sampling, the read of the ids) runs there, and torch's kernels release the GIL
while they compute, so the engine's Python runs beside them. Without the thread, ``submit``
runs the step at once and ``collect`` hands back its result: one interface for both.

Every call that touches the runner's state (a step, loading an adapter) goes through the same
single thread, in order, so none races another.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch


class StepQueue:
    """FIFO of submitted steps' results (``Future``s)."""

    def __init__(self, threaded: bool, device: Optional[torch.device] = None) -> None:
        self._pending: deque[Future] = deque()
        self._pool: Optional[ThreadPoolExecutor] = None
        if threaded:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="vgraph-step",
                                            initializer=_bind_device, initargs=(device,))

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._pending.append(self._run(fn, *args))

    def collect(self) -> Any:
        """The oldest submitted step's result; its exception if it raised."""
        if not self._pending:
            raise RuntimeError("no step was submitted to collect")
        return self._pending.popleft().result()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn`` after the steps already submitted, and returns its result."""
        return self._run(fn, *args).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _run(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001  (raised again by collect, like the thread's)
            future.set_exception(exc)
        return future


def _bind_device(device: Optional[torch.device]) -> None:
    """The worker thread's current CUDA device is its own setting (per thread)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
