"""Pooling for embedding requests: each prefill chunk's share of a prompt's pooled hidden state.

A pooling request is prefill only. Its prompt may run in several chunks (chunked prefill), so
the pool is accumulated on the request: ``mean`` keeps a float32 running sum and the token
count, ``last`` keeps the last row of the chunk that ends the prompt. A chunk that starts at
position 0 resets the state, which is what a preempted request's recompute does, so nothing
is counted twice. The runner computes the chunks' reductions on the device in the same
forward as the rest of the batch; the launched step copies them to the host with its other
results, once per step, and reads them when it is finished.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core.outputs import PooledChunk
from .runner_requests import RunnerStep


@dataclass(frozen=True)
class PendingPooled:
    """A step's pooling chunks, their reductions still on the device (read when the step is
    finished, with its other results: ``launched.py``)."""

    chunks: dict[str, PooledChunk]  # value None until read
    reduced: list[str]  # the request ids whose chunk has a value, in ``values``' row order
    values: Optional[torch.Tensor]  # [len(reduced), H] float32 on the device, None when empty

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.values is None else [self.values]

    def read(self, host: list[torch.Tensor]) -> dict[str, PooledChunk]:
        """The chunks with their values, from ``tensors()`` read on the host."""
        for request_id, value in zip(self.reduced, host[0] if host else ()):
            self.chunks[request_id].value = value
        return self.chunks


def pooled_chunks(hidden: torch.Tensor, step: RunnerStep) -> Optional[PendingPooled]:
    """Each pooling request's chunk reduction, from the step's final hidden states
    (``hidden``: the scheduled rows in batch order, padding dropped), stacked for one copy to
    the host for the whole step; None when the step has no pooling request."""
    chunks: dict[str, PooledChunk] = {}
    reduced: list[tuple[str, torch.Tensor]] = []  # request id -> its chunk's value, on the device
    offset = 0
    for item in step.chunks:
        request, n, start = item.request, item.num_new_tokens, item.start_position
        if request.pooling_type is not None:
            chunks[request.request_id] = PooledChunk(start, n, None)
            if request.pooling_type == "mean":
                reduced.append((request.request_id, hidden[offset:offset + n].float().sum(dim=0)))
            elif start + n >= request.num_prompt_tokens:  # "last", in the chunk that ends the prompt
                reduced.append((request.request_id, hidden[offset + n - 1].float()))
        offset += n
    if not chunks:
        return None
    values = torch.stack([value for _, value in reduced]) if reduced else None
    return PendingPooled(chunks, [request_id for request_id, _ in reduced], values)
