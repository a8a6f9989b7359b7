"""One process at a time compiles a configuration into the compile cache (see cache_dir.md).

Why a lock when every write is already atomic and every file checksummed: without it, N
engines started at once on a cold cache each trace and compile the whole model (N times the
work, on the same cores, so each start takes about N times as long) and overwrite each other's
files with equivalent ones. With it, the first compiles while the others wait, then load what
it saved: every process comes up with the same artifacts, and only one paid for them.

The lock is ``fcntl.flock`` on ``<root>/compile/<config key>.lock``: per config key rather
than in the entry folder, because the folder's name also holds the hash of the graph Dynamo
captures, known only once the trace (the work being serialized) has run. The kernel releases
a flock when its holder dies, ``kill -9`` included, so a crashed compile never blocks the
next start; the file holds the holder's pid for the log line of those waiting. It is never
deleted while it may be in use (a process could lock a deleted file while another locks a
new one); ``vgraph cache prune`` removes lock files of keys that have no entry left and that
nobody holds.

A lock that cannot be taken (an unwritable root, a filesystem without flock) is a debug line
and the compile goes on unlocked: atomic writes keep the cache valid either way. A holder that
does not finish within ``wait_seconds`` (a hung process) is one warning, then this process
compiles too.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("vgraph")

LOCK_SUFFIX = ".lock"
WAIT_SECONDS = 30 * 60.0  # longer than any cold compile we know of; then compile anyway
_POLL_SECONDS = 0.1


def lock_path(root: Path, config_key: str) -> Path:
    return root / "compile" / f"{config_key}{LOCK_SUFFIX}"


@contextlib.contextmanager
def compile_lock(path: Path, wait_seconds: float = WAIT_SECONDS) -> Iterator[bool]:
    """Holds the exclusive lock at ``path`` for the block; yields whether another process held
    it first (then it has probably just filled the cache: look again before compiling)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        logger.debug("compile lock %s unavailable (%s); compiling without it", path, exc)
        yield False
        return
    try:
        waited, held = _acquire(fd, path, wait_seconds)
        if held:
            _write_pid(fd)
        yield waited
    finally:
        os.close(fd)  # closing releases the flock


def _acquire(fd: int, path: Path, wait_seconds: float) -> tuple[bool, bool]:
    """(waited, held): polls, so a hung holder costs at most ``wait_seconds``."""
    deadline = time.monotonic() + wait_seconds
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return waited, True
        except BlockingIOError:
            pass
        except OSError as exc:  # no flock on this filesystem
            logger.debug("cannot lock %s (%s); compiling without the lock", path, exc)
            return waited, False
        if not waited:
            logger.info("another process (pid %s) is compiling this model into the cache; waiting for it "
                        "to finish, then loading its result (lock %s)", _read_pid(fd), path)
            waited = True
        if time.monotonic() >= deadline:
            logger.warning("the process compiling this model into the cache (pid %s) has not finished "
                           "after %.0f s; compiling here too", _read_pid(fd), wait_seconds)
            return waited, False
        time.sleep(_POLL_SECONDS)


def _write_pid(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError:
        pass


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def is_held(path: Path) -> bool:
    """Whether a process holds the lock at ``path`` now (False when there is no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
