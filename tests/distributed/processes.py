"""Process checks shared by the tensor-parallel tests: every spawned rank must be gone after."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID still exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
