"""The model's forward under ``torch.compile`` with vgraph's backend.

Dynamo traces ``forward(input_ids, positions)`` once with the token dimension dynamic. The
traced, split graph is then called directly (captured_graph.py), with no Dynamo frame in between,
once it has reproduced Dynamo's output exactly; a warm start loads that graph from the compile
cache and runs no Dynamo at all. (On CPU a warm start usually never gets here: the runner takes
warm_start.py's fast path, which needs neither Dynamo nor Inductor; this class then serves as
its fallback, and after its first forward it saves the runnables that path loads.) If the
graph cannot be called directly, calls go through Dynamo's frame with guard evaluation skipped
(the compiled code serves every token count), and a recompile raises instead of silently
compiling again: during serving it is a bug.

The compile cache never stops a start: if anything read from it fails while loading or on the
first (warm-up) call, that is one warning and the forward is compiled again from scratch,
without reading the cache, whose files the new compile then overwrites.

Processes starting at once on one cache: a warm entry is loaded without any lock (files are
whole and checksummed); on a miss, the trace and compile run under the configuration's lock
(cache_lock.py), and a process that had to wait for it looks in the cache again first, so
that only one of them compiles and the others load its result.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from .backend import VgraphBackend
from .cache import CompileCache
from .counters import CompileCounters
from .warm_start import check_rows

logger = logging.getLogger("vgraph")

# Every engine in a process traces the same ``forward`` code object once, and Dynamo keeps
# one cache entry per trace; these limits allow that many engines (tests, benchmarks).
_ENGINES_PER_PROCESS = 64


class CompiledForward:
    """Callable like ``model.forward``. Call it under ``torch.inference_mode()`` with
    inference tensors, as the runner does: Dynamo guards on that, so mixing in ordinary
    tensors would be a recompile (which raises)."""

    def __init__(self, model: torch.nn.Module, backend: VgraphBackend) -> None:
        self.model = model
        self.backend = backend
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, _ENGINES_PER_PROCESS)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * _ENGINES_PER_PROCESS)
        # Dynamo's wrapper, made when a trace needs it: a warm start that loads the captured
        # graph never does, so it sets up no Dynamo frame (cheap once Inductor's loader has
        # been imported: a few ms; the modules it imports are mostly the loader's too).
        self._compiled: Optional[Callable] = None
        self.traced = False
        self._direct: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None

    @property
    def counters(self) -> CompileCounters:
        return self.backend.counters

    @property
    def cache(self) -> CompileCache:
        return self.backend.cache

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        check_rows(input_ids)
        if self._direct is not None:
            return self._direct(input_ids, positions)
        if not self.traced:
            return self._first_call(input_ids, positions)
        with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
            return self._compiled(input_ids, positions)

    def _compile(self) -> Callable:
        """A fresh Dynamo wrapper. Dynamo keeps a traced frame per backend object, so the
        wrapper around a new lambda traces anew instead of reusing a frame that failed."""
        backend = self.backend
        return torch.compile(self.model.forward, backend=lambda gm, inputs: backend(gm, inputs),
                             fullgraph=True, dynamic=False)

    def _first_call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self._warm_call(input_ids, positions)
        if out is None:
            with self.backend.cache.compile_lock() as waited:
                if waited:  # another process just compiled: its entry is most likely there now
                    self.backend.forget_misses()
                    out = self._warm_call(input_ids, positions)
                if out is None:
                    out = self._compile_first(input_ids, positions)
        self.backend.remember_warm_load()
        if self._direct is not None:
            # Serve with the code the next warm start will run (checked equal to this output).
            self._direct = self.backend.save_runnables(self.model, input_ids, positions, out) or self._direct
        return out

    def _compile_first(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Traces and compiles (loading what artifacts the cache has); once more without the
        cache if something read from it fails."""
        try:
            return self._trace(input_ids, positions)
        except Exception as exc:
            if not self.backend.used_disk:
                raise
            self._distrust_cache(exc)
            self._compiled = self._compile()
            return self._trace(input_ids, positions)

    def _warm_call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """The loaded graph's output, or None when there is none or it failed (then warned)."""
        try:
            direct = self.backend.load_capture(self.model)
            out = direct(input_ids, positions) if direct is not None else None
        except Exception as exc:
            self._distrust_cache(exc)
            return None
        if out is not None:
            self._direct, self.traced = direct, True
        return out

    def _distrust_cache(self, exc: Exception) -> None:
        logger.warning("the compile cache entry failed (%s: %s); compiling the model again without it",
                       type(exc).__name__, exc)
        self.backend.counters.cache_errors += 1
        self.backend.counters.captured_graph = ""
        self.backend.stop_reading_disk()

    def _trace(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        self.backend.dynamo_started = time.perf_counter()
        self.backend.capture_context = (self.model, {"input_ids": input_ids, "positions": positions})
        try:
            if self._compiled is None:
                self._compiled = self._compile()
            out = self._compiled(input_ids, positions)
        finally:
            self.backend.capture_context = None
        self.traced = True
        self._direct = self.backend.adopt_capture(self.model, input_ids, positions, out)
        return out
