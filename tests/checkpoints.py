"""Shared tiny checkpoints for tests (plain functions; no pytest dependency).

Building a checkpoint costs about a second (HF model init + tokenizer training), and many
tests want the same few, so each (directory, arch) is built once per process. With no
directory given they go in one process-wide temp dir that is removed at exit.
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from vgraph.models.demo import build_tiny_checkpoint

TINY_ARCHS = ("llama", "qwen2", "qwen3")


@functools.lru_cache(maxsize=1)
def process_tmp_dir() -> str:
    """One temp dir for the whole test process, cleaned up at interpreter exit."""
    path = tempfile.mkdtemp(prefix="vgraph-test-checkpoints-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.lru_cache(maxsize=None)
def _build(root: str, arch: str) -> str:
    return build_tiny_checkpoint(Path(root) / f"tiny-{arch}", arch, seed=0)


def tiny_checkpoint(tmp_dir: Optional[str | os.PathLike] = None, arch: str = "llama") -> str:
    """Path of the tiny ``arch`` checkpoint ("llama", "qwen2", "qwen3") under ``tmp_dir``
    (default: the process temp dir), built on first request. Treat it as read-only."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    root = os.fspath(tmp_dir) if tmp_dir is not None else process_tmp_dir()
    return _build(os.path.abspath(root), arch)
