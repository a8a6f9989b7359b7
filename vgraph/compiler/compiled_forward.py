"""The model's forward traced by Dynamo with vgraph's backend: the two tracing rungs of the
compile ladder (loaders.py) serve with it.

Dynamo traces ``forward(input_ids, positions)`` once with the token dimension dynamic. The
traced, split graph is then called directly (captured_graph.py), with no Dynamo frame in
between, once it has reproduced Dynamo's output exactly; the cache writer saves it, so that
a warm start loads it and runs no Dynamo at all. If the graph cannot be called directly,
calls go through Dynamo's frame with guard evaluation skipped (the compiled code serves
every token count), and a recompile raises instead of silently compiling again: during
serving it is a bug.

The trace is size-oblivious (``backed_size_oblivious``): Dynamo otherwise specializes a
dynamic dimension on 0 and 1, and the graph would serve two rows and more, so a batch of one
ran padded to two. On CUDA the padding row cost little (the weights are read once either way)
but kept a decode step of one sequence off the one-row GEMV kernels (ops/kernels/gemv.py),
which beat the library on every projection of the 8B shape (H200: 121.5 -> 108.9 us a layer,
perf/results/decode-kernels-cuda.json). The trace still guards on two rows or more (a fake
tensor's stride computation, ``2 <= input_ids.size(0)``), so one row is served by the direct
call only: through Dynamo's frame (the direct call declined) a one-row forward would
recompile, and raise, so there the runner pads one-row batches to two and captures no bucket
of one (``LadderForward.min_rows``). Dynamo's frame also guards on torch's thread count, so
the CPU step-thread chooser stays off there (``LadderForward.guards_global_state``);
tests/compiler/test_cudagraph_emulated.py runs the graphs and one sequence through the frame.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.fx.experimental._config as fx_config

from .backend import VgraphBackend
from .cache import CompileCache
from .counters import CompileCounters

# Every engine in a process traces the same ``forward`` code object once, and Dynamo keeps
# one cache entry per trace; these limits allow that many engines (tests, benchmarks).
_ENGINES_PER_PROCESS = 64

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CompiledForward:
    """Callable like ``model.forward``; its first call traces. Call it under
    ``torch.inference_mode()`` with inference tensors, as the runner does: Dynamo guards on
    that, so mixing in ordinary tensors would be a recompile (which raises)."""

    def __init__(self, model: torch.nn.Module, backend: VgraphBackend) -> None:
        self.model = model
        self.backend = backend
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, _ENGINES_PER_PROCESS)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * _ENGINES_PER_PROCESS)
        self._compiled: Optional[Callable] = None  # Dynamo's wrapper, made when a trace needs it
        self.traced = False
        self._direct: Optional[Forward] = None

    @property
    def counters(self) -> CompileCounters:
        return self.backend.counters

    @property
    def cache(self) -> CompileCache:
        return self.backend.cache

    @property
    def direct(self) -> Optional[Forward]:
        """The captured graph called directly, once it reproduced Dynamo's output; else None."""
        return self._direct

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._direct is not None:
            return self._direct(input_ids, positions)
        if not self.traced:
            return self._trace(input_ids, positions)
        with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
            return self._compiled(input_ids, positions)

    def restart(self) -> None:
        """The next call traces anew, through a fresh Dynamo wrapper: Dynamo keeps a traced
        frame per backend object, so a new lambda traces instead of reusing a frame that failed."""
        self._compiled = None
        self.traced = False
        self._direct = None

    def _compile(self) -> Callable:
        backend = self.backend
        return torch.compile(self.model.forward, backend=lambda gm, inputs: backend(gm, inputs),
                             fullgraph=True, dynamic=False)

    def _trace(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        self.backend.dynamo_started = time.perf_counter()
        self.backend.capture_context = (self.model, {"input_ids": input_ids, "positions": positions})
        try:
            if self._compiled is None:
                self._compiled = self._compile()
            with fx_config.patch(backed_size_oblivious=True):  # one graph for every row count
                out = self._compiled(input_ids, positions)
        finally:
            self.backend.capture_context = None
        self.traced = True
        self._direct = self.backend.adopt_capture(self.model, input_ids, positions, out)
        return out
