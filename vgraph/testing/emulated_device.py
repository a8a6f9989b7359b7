"""An emulated asynchronous device, for showing on a CPU what overlapped scheduling does on a GPU.

On a GPU the host launches a step's kernels and is free until it reads the sampled ids; the
device time is spent without the GIL. ``emulated_device`` makes a runner's forward take a fixed
extra time the same way (a sleep, which releases the GIL), so the engine's thread can be seen
working while the "device" is busy, and the step time can be measured as device + host (serial)
against about max(device, host) (overlapped). Used by tests and perf/suites/host_overhead.py.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator


class EmulatedDevice:
    """``busy`` is set while a forward (and its emulated device time) runs."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.busy = threading.Event()
        self.num_forwards = 0


@contextlib.contextmanager
def emulated_device(runner: Any, seconds: float) -> Iterator[EmulatedDevice]:
    """Within the block, each forward of ``runner`` (a ``ModelRunner``) also takes ``seconds``
    without holding the GIL."""
    device = EmulatedDevice(seconds)
    graphs = runner.graphs
    run = graphs.run

    def slow_run(*args: Any, **kwargs: Any) -> Any:
        device.busy.set()
        try:
            rows = run(*args, **kwargs)
            time.sleep(seconds)
            device.num_forwards += 1
            return rows
        finally:
            device.busy.clear()

    graphs.run = slow_run
    try:
        yield device
    finally:
        del graphs.run  # the class's method again
