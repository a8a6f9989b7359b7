"""The Inductor artifacts one start holds, by (piece hash, size): read from the compile cache
or compiled in this process.

Why one home: the captured-graph rung and the Dynamo trace (build.py's ladder) both look for
the same pieces; an artifact one of them loaded is not read again by the other, and a file
found missing or removed as damaged is not looked for (nor warned about) twice. Reading stops
for the rest of the start once an entry read from the cache has failed: every piece from
then on is compiled, and the saves overwrite the entry's files, which repairs it.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from .cache import CompileCache
from .counters import CompileCounters

Key = tuple[str, str]  # (piece hash, "dynamic" or a compile size)


class ArtifactStore:
    """``get`` a piece's artifact (memory, then the cache's file), ``keep`` one compiled here.
    ``not_reading``: why the cache's files are not read this start ('' when they are)."""

    def __init__(self, cache: CompileCache, counters: CompileCounters, not_reading: str) -> None:
        self.cache = cache
        self.counters = counters
        self._not_reading = not_reading
        self._held: dict[Key, Callable] = {}
        self._missing: set[Key] = set()

    @property
    def reading(self) -> bool:
        """Whether pieces may still come from the cache's files this start."""
        return not self._not_reading

    @property
    def not_reading(self) -> str:
        return self._not_reading

    @property
    def held(self) -> dict[Key, Callable]:
        """Every artifact in hand (the runnables are made from these)."""
        return dict(self._held)

    def get(self, piece_hash: str, label: str) -> Optional[Callable]:
        """The artifact from memory or from the cache; None when neither has it (then the
        caller compiles it)."""
        key = (piece_hash, label)
        if key in self._held or key in self._missing or self._not_reading:
            return self._held.get(key)
        start = time.perf_counter()
        loaded = self.cache.load(piece_hash, label)
        self.counters.cache_errors += self.cache.take_errors()
        if loaded is None:
            self._missing.add(key)
            return None
        self.counters.cache_loads += 1
        self.counters.cache_load_seconds += time.perf_counter() - start
        self._held[key] = loaded
        return loaded

    def keep(self, piece_hash: str, label: str, artifact: Callable) -> None:
        self._held[(piece_hash, label)] = artifact

    def forget_misses(self) -> None:
        """Another process filled the cache meanwhile: look on disk again for what was missing."""
        self._missing.clear()

    def stop_reading(self, why: str) -> None:
        """Forgets what was read and reads nothing more this start (after an entry read from
        the cache failed, say: every piece is then compiled, and its save repairs the entry)."""
        self._not_reading = why
        self._held.clear()
        self._missing.clear()
