"""A sha256 record beside a cached file (``<file>.sha256``), written after the file and
checked before it is used.

Why: a shared library is mapped, not read, so a truncated or bit-flipped ``.so`` does not fail
to load; it crashes the process later (SIGBUS on a page past the end, SIGILL on a flipped
instruction), before any Python handler can run. Only a check of the bytes before
``ctypes.CDLL`` keeps such a file from ever being loaded. The compile cache's own files carry
their checksum in a header (``vgraph/compiler/cache_entries.py``); a library cannot, so it
gets a sidecar. This module is the ``ops`` package's (which imports no vgraph runtime code).

The record is JSON, ``{"bytes": N, "sha256": "<hex>"}``: the length tells a truncated file
from a damaged one in the message an operator reads.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

SUFFIX = ".sha256"


def record_path(path: Path) -> Path:
    """Where ``path``'s digest record lives: ``<path>.sha256`` beside it."""
    return path.with_name(path.name + SUFFIX)


def _describe(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_record(path: Path) -> None:
    """Records ``path``'s length and sha256 beside it, atomically (``write_atomic``). Call it
    once ``path`` itself is in place (and durable), so that a record never describes bytes
    that are not there."""
    write_atomic(record_path(path), json.dumps(_describe(path), sort_keys=True).encode())


# Half-written files of a running (or killed) writer: never read, swept by the compile cache.
TEMP_PREFIX = ".tmp-"


def write_atomic(path: Path, data: bytes) -> None:
    """A temporary file with a unique name in the same folder, written and fsynced, then
    renamed over ``path`` (and the folder fsynced): readers see the old file or the new one,
    never a part, whatever other writers do at the same time, and after a power cut the name
    does not point at data that never reached the disk."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Makes a rename durable; best effort (some filesystems refuse to fsync a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path: Optional[str]) -> None:
    """Removes a temporary file if it is still there; cleanup must not mask the real error."""
    if path:
        with contextlib.suppress(OSError):
            os.remove(path)


def fsync_file(path: Path) -> None:
    """Forces ``path``'s bytes to disk, so that after a power cut the name never points at a
    file shorter than the one its record describes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def problem(path: Path) -> Optional[str]:
    """None when ``path`` matches its record; else why it must not be used: truncated,
    damaged, without a record (written before records existed), or with an unreadable one."""
    try:
        recorded = json.loads(record_path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"without a sha256 record ({record_path(path).name} is missing: an older vgraph built it)"
    except (OSError, ValueError) as exc:
        return f"with an unreadable sha256 record {record_path(path).name} ({exc})"
    if not isinstance(recorded, dict) or not isinstance(recorded.get("sha256"), str):
        return f"with an unreadable sha256 record {record_path(path).name} (not a digest record)"
    try:
        found = _describe(path)
    except OSError as exc:
        return f"unreadable ({exc})"
    if found["bytes"] != recorded.get("bytes"):
        how = "truncated" if isinstance(recorded.get("bytes"), int) and found["bytes"] < recorded["bytes"] else "damaged"
        return f"{how} ({found['bytes']} bytes, its record says {recorded.get('bytes')})"
    if found["sha256"] != recorded["sha256"]:
        return "damaged (its bytes do not match their recorded sha256)"
    return None
