"""The compile cache's entries as the operator sees them: what each was made for (model and
key fields), its size, when it was created and last used, the selectors of ``vgraph cache
clear``, and ``vgraph cache prune`` (see cache_dir.md).

Each entry folder holds a ``meta.json`` written once, atomically, when the entry is created
(model name and path, architecture, dtype, quantization, passes, ...); a warm start rewrites
its ``last_used`` (also atomically, a few hundred bytes). Listing never trusts it blindly: an
entry with a missing or unreadable ``meta.json`` is still listed, with what its files say.

Also the helpers every cache file goes through: atomic writes, the checksummed frame of
artifacts, captured records and runnables, and ``report_damaged``, the one warning a repaired
file gets (a damaged file is never repaired silently: that would hide a failing disk).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# The one atomic writer, shared with the kernel files' checksum records (the ops package
# cannot import the runtime, so it lives there); re-exported for the cache's modules.
from vgraph.ops.file_digest import TEMP_PREFIX, remove_quietly, write_atomic  # noqa: F401

logger = logging.getLogger("vgraph")

META_FILE = "meta.json"
WARM_INDEX_FOLDER = "warm"  # the warm start's fast-path index (compiler/warm_start.py)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?\s*$", re.IGNORECASE)
_UNIT_BYTES = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
STRAY_TEMP_SECONDS = 3600.0  # a .tmp-* file this old belongs to a writer that died: prune removes it
_REPORTED: set[tuple[str, str]] = set()  # (file, problem) already warned about in this process


class DamagedFile(ValueError):
    """A cache file that is there but whose bytes are wrong (truncated, flipped, garbage, no
    header): unlike a missing file, which is simply made, it is repaired with a warning
    (``report_damaged``). ``path`` names the file where the raiser knows it."""

    def __init__(self, why: str, path: Optional[Path] = None) -> None:
        super().__init__(why)
        self.path = path


def report_damaged(path: Path, why: str, repair: str) -> None:
    """One WARNING for a damaged cache file and what is done about it, once per file and
    problem per process: the operator learns the disk or a copy damaged it (a repair that
    stays silent hides a failing disk), and a file read many times is not logged many times."""
    if (str(path), why) in _REPORTED:
        return
    _REPORTED.add((str(path), why))
    logger.warning("compile cache file %s is damaged (%s); %s", path, why, repair)


def read_json_record(path: Path, repair: str) -> Optional[dict]:
    """The JSON object in ``path``, or None: quietly when the file is missing or cannot be
    read, with ``report_damaged`` when it is there but not a JSON object (the caller then
    rewrites it, which ``repair`` says)."""
    try:
        text = path.read_bytes()
    except OSError:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:  # not UTF-8 or not JSON
        report_damaged(path, f"not JSON: {exc}", repair)
        return None
    if not isinstance(value, dict):
        report_damaged(path, f"a JSON {type(value).__name__}, not an object", repair)
        return None
    return value


_FRAME_HEADER_LENGTH = struct.Struct(">I")


def pack_framed(magic: bytes, header: dict, body: bytes) -> bytes:
    """The layout of every checksummed cache file (artifacts, captured records, runnables):
    ``magic``, the header's length, the header as JSON with the body's length and sha256
    added, then the body."""
    meta = json.dumps({**header, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()},
                      sort_keys=True).encode()
    return magic + _FRAME_HEADER_LENGTH.pack(len(meta)) + meta + body


def unpack_framed(data: bytes, magic: bytes, what: str) -> tuple[dict, bytes]:
    """The header and body of a ``pack_framed`` file; DamagedFile (a ValueError) unless both
    are whole and the body matches its checksum (``what`` names the file in the message)."""
    start = len(magic) + _FRAME_HEADER_LENGTH.size
    if not data.startswith(magic) or len(data) < start:
        raise DamagedFile(f"not a {what} (no header)")
    (length,) = _FRAME_HEADER_LENGTH.unpack_from(data, len(magic))
    if len(data) < start + length:
        raise DamagedFile(f"truncated: {len(data)} bytes, which end inside the {length}-byte header")
    try:
        header = json.loads(data[start:start + length])
    except ValueError as exc:
        raise DamagedFile(f"damaged: the {what}'s header is not JSON ({exc})") from None
    body = data[start + length:]
    if not isinstance(header, dict) or len(body) != header.get("bytes"):
        raise DamagedFile(f"truncated: {len(body)} bytes after the header, which says "
                          f"{header.get('bytes') if isinstance(header, dict) else '?'}")
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise DamagedFile(f"damaged: the {what} does not match its sha256 checksum")
    return header, body


def write_json_atomic(path: Path, payload: Any) -> None:
    """``payload`` as JSON through ``write_atomic``."""
    write_atomic(path, json.dumps(payload, sort_keys=True).encode("utf-8"))


def read_meta(folder: Path) -> Optional[dict]:
    """The entry's meta.json, or None when it is missing or not a JSON object (quietly:
    listing repairs nothing; the writers below warn when they rewrite a damaged one)."""
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def create_meta(folder: Path, description: dict) -> None:
    """Writes meta.json for a new entry (a present, readable one is left as it is; a damaged
    one is rewritten with a warning)."""
    if read_json_record(folder / META_FILE, "rewritten") is not None:
        return
    now = time.time()
    write_json_atomic(folder / META_FILE, {**description, "created": now, "last_used": now})


def touch_last_used(folder: Path, description: dict) -> None:
    """Records a warm start in meta.json; an unwritable entry is skipped (a debug line): the
    timestamp only serves ``cache clear --older-than`` and must never cost a start."""
    try:
        meta = read_json_record(folder / META_FILE, "rewritten") or {**description, "created": None}
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
    key = m.get("key") if isinstance(m.get("key"), dict) else {}
    return "\n".join([
        f"  {entry.name}",
        f"    model:        {entry.model} ({m.get('architecture') or '?'})",
        f"    dtype:        {m.get('dtype') or '?'}, quantization: {m.get('quantization') or 'none'}, "
        f"linears: {m.get('linears') or '?'}",
        f"    passes:       {_passes(m.get('passes'), key.get('pass_uuids'))}",
        *_key_lines(key),
        f"    artifacts:    {entry.artifacts} ({format_size(entry.bytes)} in all)",
        f"    created:      {_when(m.get('created'), now)}",
        f"    last used:    {_when(m.get('last_used'), now)}",
    ])


def _passes(names: Any, uuids: Any) -> str:
    """Pass names, each with its uuid when the entry recorded them."""
    if not isinstance(names, list) or not names:
        return "none"
    uuids = uuids if isinstance(uuids, dict) else {}
    return ", ".join(f"{n} (uuid {uuids[n]})" if uuids.get(n) else str(n) for n in names)


def _key_lines(key: dict) -> list[str]:
    """What the entry's key was made of (entries from before key fields were recorded: none)."""
    if not key:
        return []
    device = " ".join(str(key[k]) for k in ("device", "gpu", "machine") if key.get(k))
    compile_ = key.get("compile") if isinstance(key.get("compile"), dict) else {}
    return [
        f"    key:          vgraph {key.get('vgraph')}, torch {key.get('torch')}, triton {key.get('triton')}, "
        f"python {key.get('python')}, {device or '?'}, rank {key.get('rank')} of {key.get('world_size')}",
        f"    model config: {key.get('model_type') or '?'} {key.get('model_config')}, layout {key.get('layout')}",
        f"    compile:      sizes {compile_.get('compile_sizes')}, custom ops {compile_.get('custom_ops')}, "
        f"fusion {compile_.get('enable_fusion')}, split at {', '.join(compile_.get('splitting_ops') or [])}",
    ]


def format_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


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
        # rglob: the runnables' kernel libraries live in the entry's kernels/ folder
        files = [f for f in folder.rglob("*") if f.is_file() and not f.name.startswith(TEMP_PREFIX)]
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


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5GiB``, ``100k``, ``4096`` in bytes (units are powers of 1024);
    ValueError names what is accepted."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"--max-size {text!r}: expected a number and an optional unit, e.g. 500M, 2G "
                         "(units: K, M, G, T; powers of 1024)")
    return int(float(match.group(1)) * _UNIT_BYTES[(match.group(2) or "").lower()])


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
    return sum(1 for entry in entries if _remove(entry))


def _remove(entry: CacheEntry) -> bool:
    try:
        shutil.rmtree(entry.path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove compile cache entry %s (%s)", entry.path, exc)
        return False
    return True


@dataclass
class PruneResult:
    """What ``prune`` did: the entries removed, those kept because a process was compiling
    into them, and what is left."""

    removed: list[CacheEntry]
    busy: list[CacheEntry]
    left: int
    left_bytes: int


def prune(root: Path, older_than: Optional[float] = None, max_size: Optional[int] = None,
          now: Optional[float] = None) -> PruneResult:
    """Removes the entries last used more than ``older_than`` seconds ago, then the least
    recently used ones until the rest take at most ``max_size`` bytes. An entry whose
    configuration a process is compiling now (its lock is held) is kept: it is in use.
    Also removes temporary files left by dead writers and lock files of keys with no entry."""
    entries = list_entries(root)
    busy = [e for e in entries if _compiling(root, e)]
    busy_names = {e.name for e in busy}
    idle = sorted((e for e in entries if e.name not in busy_names), key=lambda e: e.last_used or 0.0)
    doomed = select_entries(idle, older_than=older_than, now=now) if older_than is not None else []
    total = sum(e.bytes for e in entries) - sum(e.bytes for e in doomed)
    for entry in idle:
        if max_size is None or total <= max_size:
            break
        if entry not in doomed:
            doomed.append(entry)
            total -= entry.bytes
    removed = [e for e in doomed if _remove(e)]
    _remove_strays(root, now)
    left = [e for e in entries if e not in removed]
    return PruneResult(removed, busy, len(left), sum(e.bytes for e in left))


def _config_key(entry_name: str) -> str:
    return entry_name.split("-", 1)[0]


def _compiling(root: Path, entry: CacheEntry) -> bool:
    from .cache_lock import is_held, lock_path
    return is_held(lock_path(root, _config_key(entry.name)))


def _remove_strays(root: Path, now: Optional[float]) -> None:
    """Temporary files older than STRAY_TEMP_SECONDS (a killed writer's), and lock files no
    process holds whose key has no entry left."""
    from .cache_lock import LOCK_SUFFIX, is_held
    base = root / "compile"
    cutoff = (time.time() if now is None else now) - STRAY_TEMP_SECONDS
    keys = {_config_key(e.name) for e in list_entries(root)}
    try:
        temps = [p for pattern in (f"*/{TEMP_PREFIX}*", f"*/*/{TEMP_PREFIX}*") for p in base.glob(pattern)
                 if p.stat().st_mtime < cutoff]
        locks = [p for p in base.glob(f"*{LOCK_SUFFIX}")
                 if p.name[:-len(LOCK_SUFFIX)] not in keys and not is_held(p)]
    except OSError:
        return
    for path in temps + locks:
        remove_quietly(str(path))


def clear_all(root: Path) -> int:
    """Removes ``<root>/compile`` whole (stray temporary files included) and the warm start's
    index into it; returns the number of entries it held."""
    count = len(list_entries(root))
    for folder in (root / "compile", root / WARM_INDEX_FOLDER):
        if folder.is_dir():
            shutil.rmtree(folder)
    return count


