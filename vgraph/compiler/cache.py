"""The on-disk compile cache (see cache_dir.md).

Layout: ``<VGRAPH_CACHE_DIR>/compile/<config key>-<graph hash>/<piece hash>-<size>.bin``. The
config key covers everything outside the graph that changes generated code (versions, model
config and the module layout it was built with, dtype, quantization, compile config, pass
uuids, device); the graph hash covers the captured graph itself; a piece hash covers one
piece's structure and input signature, so identical decoder layers share one artifact.

Every artifact file starts with a tag saying what it was compiled for (config key, piece
hash, size) and the sha256 and length of the Inductor payload after it: a file under the
wrong name (swapped, copied from another entry) or whose payload does not match its checksum
(truncated, bytes flipped by a bad disk or a copy) is caught before Inductor sees it, logged,
removed and recompiled, never loaded. Writes are atomic (a uniquely named temporary file,
fsynced, then a rename); one process at a time compiles a configuration (cache_lock.py); an
unwritable directory degrades to compiling in memory with one warning, never to a crash.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from . import cache_entries, cache_lock
from .cache_entries import TEMP_PREFIX

logger = logging.getLogger("vgraph")

ARTIFACT_MAGIC = b"vgraph-artifact\n"
ARTIFACT_FORMAT = 2  # 2: the header holds the payload's sha256 and length


def stable_hash(payload: Any, length: int = 16) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def environment_fingerprint(device: torch.device) -> dict:
    """Versions and the device: generated code is only valid for these. Triton's version is
    read from its package metadata (the same string as ``triton.__version__``): importing it
    costs ~0.2 s that a CPU warm start otherwise never spends."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    from vgraph import __version__
    info = {"vgraph": __version__, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "device": device.type, "machine": platform.machine()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
    return info


@dataclass(frozen=True)
class ArtifactTag:
    """What an artifact file was compiled for, written at its head and checked on load."""

    config_key: str
    piece_hash: str
    size: str  # "dynamic" or a compile size


def pack_artifact(tag: ArtifactTag, inductor_bytes: bytes,
                  pass_matches: Optional[dict[str, int]] = None) -> bytes:
    """The tagged file: ``pass_matches`` (the passes' matches on this piece's graph, from the
    compile that made it) travel in the header, so a warm start that runs no pass still
    reports them, and no other file can be lost or race for them."""
    header = {"format": ARTIFACT_FORMAT, **asdict(tag), "pass_matches": pass_matches or {}}
    return cache_entries.pack_framed(ARTIFACT_MAGIC, header, inductor_bytes)


def unpack_artifact(data: bytes) -> tuple[ArtifactTag, bytes]:
    """The tag and Inductor's bytes, checked against the header's length and sha256;
    ValueError for a file that is not a whole tagged artifact (truncated, damaged, foreign,
    or written by a vgraph before checksums)."""
    tag, _, payload = _unpack(data)
    return tag, payload


def _unpack(data: bytes) -> tuple[ArtifactTag, dict, bytes]:
    header, payload = cache_entries.unpack_framed(data, ARTIFACT_MAGIC, "vgraph artifact")
    try:
        tag = ArtifactTag(header["config_key"], header["piece_hash"], header["size"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"unreadable artifact tag ({exc})") from None
    if header.get("format") != ARTIFACT_FORMAT:
        raise ValueError(f"artifact format {header.get('format')!r}, expected {ARTIFACT_FORMAT}")
    return tag, header, payload


def _load_inductor(inductor_bytes: bytes) -> Callable:
    """Inductor's ``CompiledArtifact`` from its binary format (it loads only from a path)."""
    from torch._inductor import CompiledArtifact
    with tempfile.NamedTemporaryFile(prefix="vgraph-artifact-", suffix=".bin") as f:
        f.write(inductor_bytes)
        f.flush()
        return CompiledArtifact.load(path=f.name, format="binary")


class CompileCache:
    """Saves and loads Inductor ``CompiledArtifact``s for one config key.

    ``description`` (model, architecture, dtype, quantization, passes, ...) goes into a new
    entry's meta.json, for ``vgraph cache list`` and ``clear --model``. ``warm_key``: the key
    the warm start's fast path finds this configuration by (warm_start.py), None where it has
    no fast path.
    """

    def __init__(self, root: Optional[Path], config_key: str, description: Optional[dict] = None,
                 warm_key: Optional[str] = None) -> None:
        self.root = root
        self.config_key = config_key
        self.description = dict(description or {})
        self.warm_key = warm_key
        self.folder: Optional[Path] = None
        self.graph_hash: Optional[str] = None
        self._writable = root is not None
        self._ready: Optional[Path] = None  # the folder whose meta.json this run has written
        self._errors = 0  # unreadable entries and failed saves since the last take_errors()
        #: Piece hash -> pass -> matches, from the headers of the dynamic artifacts loaded.
        self.loaded_matches: dict[str, dict[str, int]] = {}

    def take_errors(self) -> int:
        errors, self._errors = self._errors, 0
        return errors

    @property
    def writable(self) -> bool:
        """False once a write failed: the run goes on compiling in memory."""
        return self._writable and self.folder is not None

    def bind_graph(self, graph_hash: str) -> None:
        self.graph_hash = graph_hash
        if self.root is not None:
            self.folder = self.root / "compile" / f"{self.config_key}-{graph_hash}"

    def _path(self, piece_hash: str, size: str) -> Optional[Path]:
        return self.folder / f"{piece_hash}-{size}.bin" if self.folder else None

    def load(self, piece_hash: str, size: str) -> Optional[Callable]:
        """The artifact compiled for this piece and size, or None (missing, unreadable, or
        compiled for something else: each of the last two logged as one warning)."""
        path = self._path(piece_hash, size)
        if path is None or not path.is_file():
            return None
        try:
            tag, header, inductor_bytes = _unpack(path.read_bytes())
        except (OSError, ValueError) as exc:
            return self._unusable(path, f"unreadable ({exc})")
        expected = ArtifactTag(self.config_key, piece_hash, size)
        if tag != expected:
            return self._unusable(path, f"compiled for another piece or entry ({_tag_difference(tag, expected)})")
        try:
            loaded = _load_inductor(inductor_bytes)
        except Exception as exc:  # an incompatible or damaged Inductor payload: recompile, never crash
            return self._unusable(path, f"unreadable ({type(exc).__name__}: {exc})")
        if size == "dynamic" and isinstance(header.get("pass_matches"), dict):
            self.loaded_matches[piece_hash] = header["pass_matches"]
        return loaded

    def _unusable(self, path: Path, why: str) -> None:
        """Logs, and removes the file: a damaged artifact is never loaded, not even by a
        process that starts before this one has rewritten it."""
        self._errors += 1
        logger.warning("compile cache entry %s is %s; removed, recompiling it", path, why)
        cache_entries.remove_quietly(str(path))
        return None

    def save(self, artifact: Any, piece_hash: str, size: str,
             pass_matches: Optional[dict[str, int]] = None) -> bool:
        """Writes the artifact, tagged (with the passes' matches on its graph), under its name;
        False when it is kept in memory only."""
        path = self._path(piece_hash, size)
        if path is None or not self.ensure_folder():
            return False
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=".bin")
            os.close(fd)
            artifact.save(path=tmp, format="binary")  # Inductor writes only to a path
            data = Path(tmp).read_bytes()
            tag = ArtifactTag(self.config_key, piece_hash, size)
            cache_entries.write_atomic(path, pack_artifact(tag, data, pass_matches))
            return True
        except OSError as exc:
            self._disable(exc)
            return False
        except Exception as exc:  # Inductor could not serialize this piece: serve it from memory
            self._errors += 1
            logger.warning("could not save the compiled piece %s (%s: %s); it is compiled again on "
                           "the next start", path.name, type(exc).__name__, exc)
            return False
        finally:
            cache_entries.remove_quietly(tmp)  # Inductor's unpacked output

    def ensure_folder(self) -> bool:
        """Creates the entry folder and its meta.json on the first write; False (after one
        warning for the whole run) when the cache cannot be written."""
        if not self.writable:
            return False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)  # again each time: `cache clear` may run meanwhile
            if self._ready != self.folder:
                cache_entries.create_meta(self.folder, {**self.description, "config_key": self.config_key,
                                                        "graph_hash": self.graph_hash})
                self._ready = self.folder
            return True
        except OSError as exc:
            self._disable(exc)
            return False

    def _disable(self, exc: OSError) -> None:
        self._errors += 1
        if self._writable:
            logger.warning("compile cache %s is not writable (%s); compiling in memory only, serving "
                           "goes on", self.folder or self.root, exc)
        self._writable = False

    @contextlib.contextmanager
    def compile_lock(self) -> Iterator[bool]:
        """Held while this process traces and compiles into the cache (cache_lock.py); yields
        whether another process held it first. No lock without a writable cache."""
        if self.root is None or not self._writable:
            yield False
            return
        with cache_lock.compile_lock(cache_lock.lock_path(self.root, self.config_key)) as waited:
            yield waited

    def captured_path(self, source_fingerprint: str) -> Optional[Path]:
        """Where this graph's captured record goes (see captured_graph.py); None without a
        writable cache."""
        if not self.ensure_folder():
            return None
        return self.folder / f"captured-{source_fingerprint}.pkl"

    def record_path(self, source_fingerprint: str) -> Optional[Path]:
        """The bound entry's captured record for this source, if it is on disk."""
        path = self.folder / f"captured-{source_fingerprint}.pkl" if self.folder is not None else None
        return path if path is not None and path.is_file() else None

    def find_captured(self, source_fingerprint: str) -> Optional[Path]:
        """A warm start's captured record for this config and source, binding its graph folder
        (the graph hash is not known without tracing); the newest if several match."""
        if self.root is None:
            return None
        try:
            found = list((self.root / "compile").glob(f"{self.config_key}-*/captured-{source_fingerprint}.pkl"))
            path = max(found, key=lambda p: p.stat().st_mtime) if found else None
        except OSError:  # an unreadable root, or a record removed meanwhile: trace
            return None
        if path is not None:
            self.folder = path.parent
            self.graph_hash = path.parent.name[len(self.config_key) + 1:]
        return path

    def touch(self) -> None:
        """A warm start used this entry: its ``last_used`` in meta.json moves to now."""
        if self.folder is not None and self._writable:
            cache_entries.touch_last_used(self.folder, {**self.description, "config_key": self.config_key,
                                                        "graph_hash": self.graph_hash})


def _tag_difference(found: ArtifactTag, expected: ArtifactTag) -> str:
    found_d, expected_d = asdict(found), asdict(expected)
    return ", ".join(f"{k} {found_d[k]!r} instead of {expected_d[k]!r}"
                     for k in found_d if found_d[k] != expected_d[k])
