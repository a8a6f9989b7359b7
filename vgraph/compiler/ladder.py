"""The compiled forward as the runner sees it: on its first call (the warm-up) it climbs the
ladder of loaders that build.py orders, and serves with the first forward that loads and runs.

A rung that declines says why (one info line). A forward that loads but fails on its first
call is one warning and the next rung: when the failure may be the compile cache's (a rung
that read it), the rung's ``failed`` hook undoes what it counted and stops reading what
failed; a compile that read nothing from the cache fails the start, as a compile error must.
The rungs that trace
run under the configuration's compile lock (cache_lock.py): a process that had to wait for it
first tries again the rungs that only read, since the process it waited for most likely just
filled the cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch

from .counters import CompileCounters

logger = logging.getLogger("vgraph")

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Loader(Protocol):
    """One rung (loaders.py has them all)."""

    name: str  # as the log names it
    reason: str  # why it declined, after a ``load`` that returned None
    traces: bool  # runs Dynamo: under the compile lock
    then: str  # what happens after its forward failed, for the warning

    @property
    def cache(self) -> Any: ...  # the CompileCache it serves from

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[Forward]: ...

    def blames_cache(self, before: CompileCounters) -> bool: ...

    def failed(self, before: CompileCounters) -> None: ...

    def settle(self, forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor,
               out: torch.Tensor) -> Forward: ...


class LadderForward:
    """Callable like ``model.forward``; ``counters`` and, once served, ``cache`` and
    ``served_by`` (the rung's name) say how the forward was obtained."""

    def __init__(self, loaders: Sequence[Loader], counters: CompileCounters,
                 lock: Callable[[], ContextManager[bool]]) -> None:
        self.loaders = tuple(loaders)
        self.counters = counters
        self._lock = lock
        self._served: Optional[Loader] = None
        self._forward: Optional[Forward] = None

    @property
    def cache(self) -> Any:
        return self._served.cache if self._served is not None else None

    @property
    def served_by(self) -> str:
        return self._served.name if self._served is not None else ""

    @property
    def backend(self) -> Any:
        """The backend that compiled or loaded the pieces (the pass lab reads its passes and
        piece hashes); None before serving, or when the runnables served."""
        return getattr(self._served, "backend", None)

    @property
    def forward(self) -> Optional[Forward]:
        """What serves every call after the first (a captured graph's direct call, say)."""
        return self._forward

    @property
    def guards_global_state(self) -> bool:
        """Whether Dynamo's frame serves (the direct call was declined): it guards on global
        state such as torch's thread count, so changing that between calls would recompile."""
        # Not imported here: a warm start imports no Dynamo, and then nothing traced either.
        traced = sys.modules.get(f"{__package__}.compiled_forward")
        return traced is not None and isinstance(self._forward, traced.CompiledForward)

    @property
    def min_rows(self) -> int:
        """The fewest token rows a call may have: two while Dynamo's frame serves (its trace
        guards on two rows or more, so one row would recompile, which raises:
        compiled_forward.py), else one (the direct call, the runnables)."""
        return 2 if self.guards_global_state else 1

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._forward is not None:
            return self._forward(input_ids, positions)
        return self._climb(input_ids, positions)

    def _climb(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with contextlib.ExitStack() as held:
            locked = False
            for loader in self.loaders:
                if loader.traces and not locked:
                    locked = True
                    if held.enter_context(self._lock()):  # waited: another process just compiled
                        out = self._retry_reading(input_ids, positions)
                        if out is not None:
                            return out
                out = self._try(loader, input_ids, positions)
                if out is not None:
                    return out
        raise RuntimeError("every rung of the compile ladder declined: " +
                           "; ".join(f"{l.name}: {l.reason}" for l in self.loaders))

    def _retry_reading(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        for loader in self.loaders:
            if loader.traces:
                return None
            out = self._try(loader, input_ids, positions)
            if out is not None:
                return out
        return None

    def _try(self, loader: Loader, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """The first output of ``loader``'s forward, or None (declined, or failed and warned)."""
        before = dataclasses.replace(self.counters)
        try:
            forward = loader.load(input_ids, positions)
            out = forward(input_ids, positions) if forward is not None else None
        except Exception as exc:
            if not loader.blames_cache(before):
                raise
            logger.warning("compile ladder: the %s failed (%s: %s); %s", loader.name, type(exc).__name__,
                           exc, loader.then)
            loader.failed(before)
            self.counters.cache_errors += 1
            return None
        if forward is None:
            logger.info("compile ladder: the %s rung declined: %s", loader.name, loader.reason)
            return None
        self._forward = loader.settle(forward, input_ids, positions, out)
        self._served = loader
        self.counters.rung = loader.name
        logger.info("compile ladder: served by the %s rung", loader.name)
        return out
