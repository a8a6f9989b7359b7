"""The compile cache's entries as the operator sees them: what each was made for, when it was
created and last used, and the selectors of ``vgraph cache clear`` (see cache_dir.md).

Each entry folder holds a ``meta.json`` written once, atomically, when the entry is created
(model name and path, architecture, dtype, quantization, passes, ...); a warm start rewrites
its ``last_used`` (also atomically, a few hundred bytes). Listing never trusts it blindly: an
entry with a missing or unreadable ``meta.json`` is still listed, with what its files say.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("vgraph")

META_FILE = "meta.json"
TEMP_PREFIX = ".tmp-"  # half-written files of a running (or killed) writer; never read
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


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
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload: Any) -> None:
    """``payload`` as JSON through ``write_atomic``."""
    write_atomic(path, json.dumps(payload, sort_keys=True).encode("utf-8"))


def read_meta(folder: Path) -> Optional[dict]:
    """The entry's meta.json, or None when it is missing or not a JSON object."""
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def create_meta(folder: Path, description: dict) -> None:
    """Writes meta.json for a new entry (a present, readable one is left as it is)."""
    if read_meta(folder) is not None:
        return
    now = time.time()
    write_json_atomic(folder / META_FILE, {**description, "created": now, "last_used": now})


def touch_last_used(folder: Path, description: dict) -> None:
    """Records a warm start in meta.json; an unwritable entry is skipped (a debug line): the
    timestamp only serves ``cache clear --older-than`` and must never cost a start."""
    try:
        meta = read_meta(folder) or {**description, "created": None}
        meta["last_used"] = time.time()
        write_json_atomic(folder / META_FILE, meta)
    except OSError as exc:
        logger.debug("could not record the last use of %s (%s)", folder, exc)


@dataclass
class CacheEntry:
    """One compile-cache folder as listed by ``vgraph cache list``."""

    name: str
    path: Path
    artifacts: int
    bytes: int
    meta: dict = field(default_factory=dict)

    @property
    def model(self) -> str:
        return str(self.meta.get("model") or "?")

    @property
    def last_used(self) -> Optional[float]:
        """The last warm start, else the creation, else the folder's modification time."""
        for key in ("last_used", "created"):
            if isinstance(self.meta.get(key), (int, float)):
                return float(self.meta[key])
        try:
            return self.path.stat().st_mtime
        except OSError:
            return None

    def made_for(self, model: str) -> bool:
        """Whether the entry was created for ``model``: the name recorded then, the same local
        directory (a relative path or ``~`` resolved here), or a hub id whose download
        (``models--ORG--NAME`` in the Hugging Face cache) the entry was made from."""
        recorded = [v for v in (self.meta.get("model"), self.meta.get("model_path")) if v]
        if model in recorded or os.path.abspath(os.path.expanduser(model)) in recorded:
            return True
        hub_folder = "models--" + model.replace("/", "--")
        return any(hub_folder in Path(v).parts for v in recorded)


def describe_entry(entry: CacheEntry, now: Optional[float] = None) -> str:
    """The entry's block in ``vgraph cache list``."""
    m = entry.meta
    passes = ", ".join(map(str, m["passes"])) if isinstance(m.get("passes"), list) and m["passes"] else "none"
    return "\n".join([
        f"  {entry.name}",
        f"    model:        {entry.model} ({m.get('architecture') or '?'})",
        f"    dtype:        {m.get('dtype') or '?'}, quantization: {m.get('quantization') or 'none'}, "
        f"linears: {m.get('linears') or '?'}",
        f"    passes:       {passes}",
        f"    artifacts:    {entry.artifacts} ({entry.bytes / 2**20:.1f} MiB in all)",
        f"    created:      {_when(m.get('created'), now)}",
        f"    last used:    {_when(m.get('last_used'), now)}",
    ])


def _when(stamp: Any, now: Optional[float]) -> str:
    if not isinstance(stamp, (int, float)):
        return "unknown"
    ago = max(0.0, (time.time() if now is None else now) - stamp)
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if ago >= seconds:
            return f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(stamp))} ({ago / seconds:.0f}{unit} ago)"
    return f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(stamp))} ({ago:.0f}s ago)"


def list_entries(root: Path) -> list[CacheEntry]:
    """Every entry folder under ``<root>/compile``, by name; none when it cannot be read."""
    base = root / "compile"
    try:
        folders = sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    except OSError:
        return []
    return [_entry(folder) for folder in folders]


def _entry(folder: Path) -> CacheEntry:
    files = []
    try:
        files = [f for f in folder.iterdir() if f.is_file() and not f.name.startswith(TEMP_PREFIX)]
    except OSError:
        pass
    artifacts = sum(1 for f in files if f.suffix == ".bin")
    size = 0
    for f in files:
        try:
            size += f.stat().st_size
        except OSError:  # removed meanwhile by another process
            pass
    return CacheEntry(folder.name, folder, artifacts, size, read_meta(folder) or {})


def parse_duration(text: str) -> float:
    """``30s``, ``30m``, ``12h``, ``7d``, ``2w`` in seconds; ValueError names what is accepted."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"--older-than {text!r}: expected a number and a unit, e.g. 30m, 12h, 7d "
                         "(units: s, m, h, d, w)")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def find_entry(entries: list[CacheEntry], name: str) -> CacheEntry:
    """The entry called ``name``, or the only one whose name starts with it; ValueError when
    none or several do (the message lists the candidates, so the operator can type more)."""
    exact = [e for e in entries if e.name == name]
    if exact:
        return exact[0]
    matches = [e for e in entries if e.name.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(f"no compile cache entry named {name!r} (see `vgraph cache list`)")
    raise ValueError(f"{name!r} matches {len(matches)} compile cache entries: "
                     f"{', '.join(e.name for e in matches)}; give more of the name")


def select_entries(entries: list[CacheEntry], name: Optional[str] = None, model: Optional[str] = None,
                   older_than: Optional[float] = None, now: Optional[float] = None) -> list[CacheEntry]:
    """The entries every given selector accepts: the named one, those made for ``model``,
    those last used more than ``older_than`` seconds ago."""
    chosen = [find_entry(entries, name)] if name is not None else list(entries)
    if model is not None:
        chosen = [e for e in chosen if e.made_for(model)]
    if older_than is not None:
        cutoff = (time.time() if now is None else now) - older_than
        chosen = [e for e in chosen if e.last_used is not None and e.last_used < cutoff]
    return chosen


def remove_entries(entries: list[CacheEntry]) -> int:
    """Deletes the entries' folders; returns how many went (one removed meanwhile still counts
    as gone, one that cannot be removed is logged and not counted)."""
    removed = 0
    for entry in entries:
        try:
            shutil.rmtree(entry.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove compile cache entry %s (%s)", entry.path, exc)
            continue
        removed += 1
    return removed


def clear_all(root: Path) -> int:
    """Removes ``<root>/compile`` whole (stray temporary files included); returns the number
    of entries it held."""
    count = len(list_entries(root))
    base = root / "compile"
    if base.is_dir():
        shutil.rmtree(base)
    return count


def remove_quietly(path: Optional[str]) -> None:
    """Removes a temporary file if it is still there; cleanup must not mask the real error."""
    if path:
        try:
            os.remove(path)
        except OSError:
            pass
