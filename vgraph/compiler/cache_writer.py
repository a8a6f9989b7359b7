"""The one writer of what a compile produced: each piece's Inductor artifact, the captured
graph, the runnables with the warm index, and the warm load's shortcuts (cache_dir.md).

Why one home: the rungs of the ladder (loaders.py) only read, and the backend only compiles;
everything a later start will load goes through here, so what is saved, when, and on what
condition (the cache on and writable; for the graph and the runnables, a bit-exact check
first) can be read in one place. A failed save never costs the start: it is a warning (or an
info line), and the next start takes a lower rung.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from . import captured_graph as captured
from . import warm_start
from .cache import CompileCache
from .counters import CompileCounters
from .torch_range import unsupported_torch
from .warm_load import WarmLoadSettings

logger = logging.getLogger("vgraph")


class CacheWriter:
    """Saves into ``cache`` (nothing when ``use_cache`` is off), counting in ``counters``."""

    def __init__(self, cache: CompileCache, counters: CompileCounters, use_cache: bool) -> None:
        self.cache = cache
        self.counters = counters
        self.use_cache = use_cache
        self._fingerprint: Optional[str] = None

    def source_fingerprint(self, model: torch.nn.Module) -> str:
        """The name records are saved and found under (captured_graph.py); read once per start."""
        if self._fingerprint is None:
            self._fingerprint = captured.source_fingerprint(model)
        return self._fingerprint

    def artifact(self, artifact: Any, piece_hash: str, label: str, matches: Optional[dict[str, int]]) -> None:
        """A piece Inductor just compiled, tagged with its passes' matches."""
        if self.use_cache and self.cache.save(artifact, piece_hash, label, matches):
            self.counters.cache_saves += 1

    def captured(self, model: torch.nn.Module, split_bytes: bytes, sources: list,
                 records: dict[str, captured.PieceRecord]) -> None:
        """The captured graph, once called directly it gave Dynamo's output bit for bit."""
        if not self.use_cache:
            return
        built_for = {"config_key": self.cache.config_key, "graph_hash": self.cache.graph_hash,
                     "state": captured.state_signature(model, sources)}
        try:
            path = self.cache.captured_path(self.source_fingerprint(model))
            if path is not None:
                captured.save_record(path, split_bytes, sources, records, built_for)
                self.counters.captured_graph = "saved"
        except OSError as exc:
            logger.warning("could not save the captured graph (%s); warm starts will trace again", exc)

    def warm_load(self, settings: Optional[WarmLoadSettings]) -> None:
        """After the first forward worked (loaded or compiled): what the next warm load may
        skip (warm_load.py). Nothing without a writable cache."""
        if not self.use_cache or not self.cache.writable:
            return
        (settings or WarmLoadSettings(self.cache.root)).remember()

    def runnables(self, model: torch.nn.Module, artifacts: dict, matches: dict[str, dict[str, int]],
                  run: Callable[[Callable], torch.Tensor], reference: torch.Tensor) -> Optional[Callable]:
        """After the first forward through Inductor's artifacts worked: each piece saved as a
        runnable and the warm index written, if the forward built from runnables gives
        ``reference`` bit for bit (``run`` calls a forward on the warm-up inputs). Returns
        that forward, for this start to serve with the code later starts will run; None (an
        info line) where there are none: the next start loads through Inductor too."""
        cache = self.cache
        if cache.warm_key is None or not cache.writable or reference.device.type != "cpu":
            return None
        why = unsupported_torch("runnables")
        if why is not None:
            logger.info("no runnables for the fast warm start (%s); warm starts load through Inductor", why)
            return None
        fingerprint = self.source_fingerprint(model)
        path = cache.record_path(fingerprint)
        record = captured.load_record(path) if path is not None else None
        if record is None:
            return None
        try:
            direct, saved, why = warm_start.save_runnables(record, artifacts, matches, cache.folder, model, run,
                                                           reference)
        except Exception as exc:  # never costs the start: the next one loads through Inductor
            direct, saved, why = None, 0, f"{type(exc).__name__}: {exc}"
        if direct is None:
            logger.info("no runnables for the fast warm start (%s); warm starts load through Inductor", why)
            return None
        self.counters.runnable_saves = saved
        warm_start.write_index(cache.root, cache.warm_key, cache.config_key, fingerprint)
        return direct
