"""The on-disk compile cache (see cache_dir.md).

Layout: ``<VGRAPH_CACHE_DIR>/compile/<config key>-<graph hash>/<piece hash>-<size>.bin``. The
config key covers everything outside the graph that changes generated code (versions, model
config, dtype, quantization, compile config, pass uuids, device); the graph hash covers the
captured graph itself; a piece hash covers one piece's structure, so identical decoder
layers share one artifact. Writes are atomic (write to a temp name, then rename); an
unreadable entry is recompiled with a warning; an unwritable directory degrades to compiling
in memory with a warning, never to a crash.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("vgraph")


def stable_hash(payload: Any, length: int = 16) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def environment_fingerprint(device: torch.device) -> dict:
    """Versions and the device: generated code is only valid for these."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from vgraph import __version__
    info = {"vgraph": __version__, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "device": device.type, "machine": platform.machine()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
    return info


class CompileCache:
    """Saves and loads Inductor ``CompiledArtifact``s for one config key."""

    def __init__(self, root: Optional[Path], config_key: str) -> None:
        self.root = root
        self.config_key = config_key
        self.folder: Optional[Path] = None
        self._writable = root is not None
        self._errors = 0  # unreadable entries and failed saves since the last take_errors()

    def take_errors(self) -> int:
        errors, self._errors = self._errors, 0
        return errors

    def bind_graph(self, graph_hash: str) -> None:
        if self.root is not None:
            self.folder = self.root / "compile" / f"{self.config_key}-{graph_hash}"

    def _path(self, piece_hash: str, size: str) -> Optional[Path]:
        return self.folder / f"{piece_hash}-{size}.bin" if self.folder else None

    def load(self, piece_hash: str, size: str) -> Optional[Callable]:
        path = self._path(piece_hash, size)
        if path is None or not path.exists():
            return None
        try:
            from torch._inductor import CompiledArtifact
            return CompiledArtifact.load(path=str(path), format="binary")
        except Exception as exc:  # a truncated or foreign file: recompile, never crash
            self._errors += 1
            logger.warning("compile cache entry %s is unreadable (%s: %s); recompiling it",
                           path, type(exc).__name__, exc)
            return None

    def save(self, artifact: Any, piece_hash: str, size: str) -> bool:
        path = self._path(piece_hash, size)
        if path is None or not self._writable:
            return False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".bin")
            os.close(fd)
            artifact.save(path=tmp, format="binary")
            os.replace(tmp, path)
            self._write_meta()
            return True
        except OSError as exc:
            self._errors += 1
            self._writable = False
            logger.warning("compile cache %s is not writable (%s); compiling in memory only",
                           path.parent, exc)
            _remove_quietly(locals().get("tmp"))
            return False

    def captured_path(self, source_fingerprint: str) -> Optional[Path]:
        """Where this graph's captured record goes (see captured_graph.py); None without a cache."""
        if self.folder is None or not self._writable:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder / f"captured-{source_fingerprint}.pkl"

    def find_captured(self, source_fingerprint: str) -> Optional[Path]:
        """A warm start's captured record for this config and source, binding its graph folder
        (the graph hash is not known without tracing); the newest if several match."""
        if self.root is None:
            return None
        found = list((self.root / "compile").glob(f"{self.config_key}-*/captured-{source_fingerprint}.pkl"))
        if not found:
            return None
        path = max(found, key=lambda p: p.stat().st_mtime)
        self.folder = path.parent
        return path

    def write_pass_matches(self, matches: dict[str, dict[str, int]]) -> None:
        """Pass matches per piece graph from the cold compile, for warm starts (which run no pass)."""
        if self.folder is None or not self._writable:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / ".pass_matches.json.tmp"
            tmp.write_text(json.dumps(matches))
            os.replace(tmp, self.folder / "pass_matches.json")
        except OSError as exc:
            logger.warning("could not record pass matches in %s (%s)", self.folder, exc)

    def read_pass_matches(self) -> dict[str, dict[str, int]]:
        try:
            return json.loads((self.folder / "pass_matches.json").read_text()) if self.folder else {}
        except (OSError, ValueError):
            return {}

    def _write_meta(self) -> None:
        meta = self.folder / "meta.json"
        if not meta.exists():
            meta.write_text(json.dumps({"created": time.time(), "config_key": self.config_key}))


def _remove_quietly(path: Optional[str]) -> None:
    if path:
        try:
            os.remove(path)
        except OSError:
            pass


def list_entries(root: Path) -> list[dict]:
    """Each compile-cache folder with its size in bytes and number of artifacts."""
    base = root / "compile"
    entries = []
    for folder in sorted(base.iterdir()) if base.is_dir() else []:
        files = [f for f in folder.iterdir() if f.suffix == ".bin"]
        entries.append({"name": folder.name, "artifacts": len(files),
                        "bytes": sum(f.stat().st_size for f in files), "path": str(folder)})
    return entries


def clear_entries(root: Path) -> int:
    base = root / "compile"
    count = len(list_entries(root))
    if base.is_dir():
        shutil.rmtree(base)
    return count
