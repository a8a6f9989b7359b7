"""Pooling for embedding requests: each prefill chunk's share of a prompt's pooled hidden state.

A pooling request is prefill only. Its prompt may run in several chunks (chunked prefill), so
the pool is accumulated on the request: ``mean`` keeps a float32 running sum and the token
count, ``last`` keeps the last row of the chunk that ends the prompt. A chunk that starts at
position 0 resets the state, which is what a preempted request's recompute does, so nothing
is counted twice. The runner computes the chunks' reductions on the device in the same
forward as the rest of the batch and copies them to the host once per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core.scheduler import SchedulerOutput
from ..pooling_params import POOLING_TYPES


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


def pooled_chunks(hidden: torch.Tensor, sched: SchedulerOutput) -> dict[str, PooledChunk]:
    """Each pooling request's chunk reduction, from the step's final hidden states
    (``hidden``: the scheduled rows in batch order, padding dropped), copied to the host in
    one go for the whole step."""
    chunks: dict[str, PooledChunk] = {}
    reduced: list[tuple[str, torch.Tensor]] = []  # request id -> its chunk's value, on the device
    offset = 0
    for item in sched.scheduled:
        request, n, start = item.request, item.num_new_tokens, item.start_position
        state = request.pooling
        if state is not None:
            chunks[request.request_id] = PooledChunk(start, n, None)
            if state.pooling_type == "mean":
                reduced.append((request.request_id, hidden[offset:offset + n].float().sum(dim=0)))
            elif start + n >= request.num_prompt_tokens:  # "last", in the chunk that ends the prompt
                reduced.append((request.request_id, hidden[offset + n - 1].float()))
        offset += n
    if reduced:
        host = torch.stack([value for _, value in reduced]).cpu()
        for (request_id, _), value in zip(reduced, host):
            chunks[request_id].value = value
    return chunks
