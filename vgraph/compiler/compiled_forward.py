"""The model's forward under ``torch.compile`` with vgraph's backend.

Dynamo traces ``forward(input_ids, positions)`` once with the token dimension dynamic. The
traced, split graph is then called directly (captured_graph.py), with no Dynamo frame in between,
once it has reproduced Dynamo's output exactly; a warm start loads that graph from the compile
cache and runs no Dynamo at all. If the graph cannot be called directly, calls go through
Dynamo's frame with guard evaluation skipped (the compiled code serves every token count), and
a recompile raises instead of silently compiling again: during serving it is a bug.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from .backend import VgraphBackend

logger = logging.getLogger("vgraph")

# Every engine in a process traces the same ``forward`` code object once, and Dynamo keeps
# one cache entry per trace; these limits allow that many engines (tests, benchmarks).
_ENGINES_PER_PROCESS = 64

# Dynamo specializes a dynamic dim on sizes 0 and 1, so the compiled forward serves two rows
# and more; the runner's batch builder pads one-token batches (vgraph/worker/dispatch.py).
MIN_TOKENS = 2


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
        self._compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)
        self.traced = False
        self._direct: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] < MIN_TOKENS:
            raise ValueError(f"the compiled forward takes at least {MIN_TOKENS} rows, got "
                             f"{input_ids.shape[0]}: pad the batch (the runner's batch builder does)")
        if self._direct is not None:
            return self._direct(input_ids, positions)
        if not self.traced:
            return self._first_call(input_ids, positions)
        with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
            return self._compiled(input_ids, positions)

    def _first_call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self._direct = self.backend.load_capture(self.model)
        if self._direct is not None:
            self.traced = True
            return self._direct(input_ids, positions)
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        self.backend.dynamo_started = time.perf_counter()
        self.backend.capture_context = (self.model, {"input_ids": input_ids, "positions": positions})
        out = self._compiled(input_ids, positions)
        self.backend.capture_context = None
        self.traced = True
        self._direct = self.backend.adopt_capture(self.model, input_ids, positions, out)
        return out
