"""The torch releases whose Inductor internals the warm path was written against.

Why: besides Inductor's public entry points (``standalone_compile``, ``CompiledArtifact``),
the warm path reads Inductor's internals: the wrapper source and kernel libraries inside a
compiled artifact and the tensor data-pointer helper its kernels look up (runnable.py), and
the vector-ISA probe functions (warm_load.py). They move between torch releases without
notice, and vgraph must run on torch 2.11 and later. So each reader asks here first; outside
the range it was checked on, it declines (one line in the log) and the start takes the next
rung of the ladder (build.py), which uses only the public entry points: slower, never wrong.
Widen the range after running tests/compiler on the new release.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class TorchRange:
    """Releases ``oldest`` to ``newest`` (major, minor), both included."""

    oldest: tuple[int, int]
    newest: tuple[int, int]

    def covers(self, release: Optional[tuple[int, int]]) -> bool:
        return release is not None and self.oldest <= release <= self.newest

    def describe(self) -> str:
        return f"torch {self.oldest[0]}.{self.oldest[1]} to {self.newest[0]}.{self.newest[1]}"


#: Where runnable.py's and warm_load.py's reading of Inductor was checked.
INDUCTOR_INTERNALS = TorchRange(oldest=(2, 11), newest=(2, 13))


def running_torch() -> str:
    """The version string of the torch in this process (a function, so tests can change it)."""
    return str(torch.__version__)


def release(version: str) -> Optional[tuple[int, int]]:
    """``2.13.0+cpu`` -> (2, 13); None for a string that does not start with a release."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def unsupported_torch(reader: str, supported: TorchRange = INDUCTOR_INTERNALS) -> Optional[str]:
    """None where this torch is in ``supported``; else the reason ``reader`` (what reads the
    internals, e.g. "runnables") declines, for its one log line."""
    version = running_torch()
    if supported.covers(release(version)):
        return None
    return f"{reader} read Inductor internals checked on {supported.describe()}, not torch {version}"
