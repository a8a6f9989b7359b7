"""An emulated asynchronous device, for showing on a CPU what overlapped scheduling does on a GPU.

On a GPU the host enqueues a step's kernels and is free until it reads the sampled ids; the
device works through its queue meanwhile. ``emulated_device`` gives a ``ModelRunner`` such a
queue: each launched step also occupies the "device" for a fixed time after the one before it
(``launch`` returns at once), and reading a step's ids (``finish``) waits, without the GIL, until
the device is done with it. The engine's thread can then be seen working while the device is
busy, and the step time measured as device + host (serial loop) against about max(device,
host) (overlapped). Used by tests and perf/suites/host_overhead.py.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator


class EmulatedDevice:
    """The device's queue: when it will be free, and when each launched step is done."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.free_at = 0.0
        self.done_at: dict[int, float] = {}  # id(LaunchedStep) -> when its ids are ready
        self.num_steps = 0

    def busy(self) -> bool:
        return time.monotonic() < self.free_at

    def enqueue(self, launched: Any) -> None:
        self.free_at = max(self.free_at, time.monotonic()) + self.seconds
        self.done_at[id(launched)] = self.free_at
        self.num_steps += 1

    def wait(self, launched: Any) -> None:
        ready = self.done_at.pop(id(launched), None)
        if ready is not None:
            time.sleep(max(0.0, ready - time.monotonic()))


@contextlib.contextmanager
def emulated_device(runner: Any, seconds: float) -> Iterator[EmulatedDevice]:
    """Within the block, each step ``runner`` launches also takes ``seconds`` of device time."""
    device = EmulatedDevice(seconds)
    launch, finish = runner.launch, runner.finish

    def launch_on_device(*args: Any, **kwargs: Any) -> Any:
        launched = launch(*args, **kwargs)
        device.enqueue(launched)
        return launched

    def finish_on_device(launched: Any) -> Any:
        device.wait(launched)
        return finish(launched)

    runner.launch, runner.finish = launch_on_device, finish_on_device
    try:
        yield device
    finally:
        del runner.launch, runner.finish  # the class's methods again
