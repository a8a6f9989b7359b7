"""What a model step hands the scheduler, and the per-request state it folds in: plain data
owned by ``core/``, which the worker produces and the scheduler consumes whole (``Scheduler.update``).

``PoolingState`` lives here too: it is a request's accumulator (the pool of its prompt so far,
chunk by chunk), carried on the ``Request`` like its output tokens, not worker state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..pooling_params import POOLING_TYPES


@dataclass
class ModelRunnerOutput:
    """One step's results, by request id."""

    sampled: dict[str, int]  # the new token id of each request that sampled one
    logprobs: Optional[dict[str, dict[int, float]]] = None  # its top logprobs, chosen token first (when asked)
    # The prompt tokens this step scored (requests with prompt_logprobs only).
    prompt_logprobs: Optional[dict[str, "PromptLogprobs"]] = None
    # Each pooling request's chunk's share of the pooled hidden state.
    pooled: Optional[dict[str, "PooledChunk"]] = None
    # Speculative decoding: each verifying request's accepted guesses, which come before its
    # ``sampled`` token (the target's own next token after them).
    accepted_drafts: Optional[dict[str, list[int]]] = None


@dataclass
class PromptLogprobs:
    """Entries for prompt tokens ``first .. first + len(entries) - 1`` of one request."""

    first: int
    entries: list[dict[int, float]]


@dataclass
class PooledChunk:
    """One chunk's contribution: positions ``start .. start + num_tokens`` of the prompt."""

    start: int
    num_tokens: int
    value: Optional[torch.Tensor]  # mean: the rows' float32 sum; last: the prompt's last row, else None


class PoolingState:
    """The pool of one prompt so far (lives on its ``Request``)."""

    def __init__(self, pooling_type: str, normalize: bool) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}")
        self.pooling_type = pooling_type
        self.normalize = normalize
        self.count = 0  # prompt positions folded in
        self._value: Optional[torch.Tensor] = None

    def add(self, chunk: PooledChunk) -> None:
        if chunk.start == 0:  # the first chunk, or a recompute after preemption
            self.count, self._value = 0, None
        if chunk.start != self.count:
            raise RuntimeError(f"pooling chunk starts at {chunk.start} but {self.count} positions are pooled")
        self.count += chunk.num_tokens
        if chunk.value is None:
            return
        if self.pooling_type == "mean" and self._value is not None:
            self._value = self._value + chunk.value
        else:
            self._value = chunk.value

    def embedding(self) -> list[float]:
        """The pooled vector (L2-normalized when asked), once the whole prompt is in."""
        if self._value is None or self.count == 0:
            raise RuntimeError("the prompt has not been pooled yet")
        vector = self._value / self.count if self.pooling_type == "mean" else self._value
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        return vector.tolist()
