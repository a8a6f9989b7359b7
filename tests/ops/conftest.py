"""Fixtures shared by the op tests."""
from __future__ import annotations

import types

import pytest

from vgraph.ops import native_build


@pytest.fixture
def compiles(monkeypatch):
    """Counts compiler invocations that build something (``-o``), not ``--version`` probes."""
    calls = []
    real_run = native_build.subprocess.run

    def run(argv, *args, **kwargs):
        if "-o" in argv:
            calls.append(list(argv))
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(native_build, "subprocess", types.SimpleNamespace(run=run))
    return calls
