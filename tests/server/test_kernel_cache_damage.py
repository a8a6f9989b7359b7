"""A damaged C++ kernel cache must not wedge ``vgraph serve``.

The issue: truncating a built kernel (``$VGRAPH_CACHE_DIR/kernels/linear_cpu-<key>.so``) to
half its size made the engine-core process die with SIGBUS at startup (flipped bytes: SIGILL),
the server exit 1, and every restart on that cache crash the same way until someone deleted
the cache by hand. Here a real server (the default layout: the engine in its own engine-core
process) serves a greedy completion on a private cache, then every kernel library in that
cache is truncated to half, then (after a start that repaired them) flipped in the middle;
each restart on the same cache must start, warn once per library, and serve the same text.
"""
from __future__ import annotations

import os
from pathlib import Path

from tests.server.conftest import EAGER_ARGS, ServerProcess
from vgraph.ops import native_build

LIBRARIES = sorted(p.stem for p in native_build.CSRC.glob("*.cpp"))
COMPLETION = dict(model="demo-model-v1", prompt="Once upon a time", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})


def _serve(root: Path) -> tuple[str, str]:
    """Starts ``vgraph serve`` on the demo model with ``root`` as its cache, asks for the
    greedy completion, stops it; returns the text and the server's log."""
    proc = ServerProcess(*EAGER_ARGS, env={"VGRAPH_CACHE_DIR": str(root)})
    try:
        proc.wait_ready()
        proc.engine_pid()  # the engine runs in its own process, where the crash used to happen
        text = proc.client().completions.create(**COMPLETION).choices[0].text
        assert proc.terminate() == 0, proc.log()
        return text, proc.log()
    finally:
        proc.close()


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def test_a_server_restarts_on_a_damaged_kernel_cache_and_serves_the_same_text(tmp_path):
    root = tmp_path / "cache"
    first, _ = _serve(root)
    libraries = sorted((root / "kernels").glob("*.so"))
    assert sorted(p.name.rsplit("-", 1)[0] for p in libraries) == LIBRARIES, "every kernel was built"
    for damage, why in ((_truncate, "truncated"), (_flip, "damaged")):
        for library in libraries:
            damage(library)
        text, log = _serve(root)
        assert text == first, log
        for library in libraries:
            assert log.count(f"the cached C++ kernel {library} is {why}") == 1, log
        assert "falls back to its torch implementation" not in log and "Traceback" not in log, log
