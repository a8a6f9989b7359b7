"""Pooling for embedding requests: each prefill chunk's share of a prompt's pooled hidden state.

A pooling request is prefill only. Its prompt may run in several chunks (chunked prefill), so
the pool is accumulated on the request: ``mean`` keeps a float32 running sum and the token
count, ``last`` keeps the last row of the chunk that ends the prompt. A chunk that starts at
position 0 resets the state, which is what a preempted request's recompute does, so nothing
is counted twice. The runner computes the chunks' reductions on the device in the same
forward as the rest of the batch and copies them to the host once per step.
"""
from __future__ import annotations

import torch

from ..core.outputs import PooledChunk
from .runner_requests import RunnerStep


def pooled_chunks(hidden: torch.Tensor, step: RunnerStep) -> dict[str, PooledChunk]:
    """Each pooling request's chunk reduction, from the step's final hidden states
    (``hidden``: the scheduled rows in batch order, padding dropped), copied to the host in
    one go for the whole step."""
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
    if reduced:
        host = torch.stack([value for _, value in reduced]).cpu()
        for (request_id, _), value in zip(reduced, host):
            chunks[request_id].value = value
    return chunks
