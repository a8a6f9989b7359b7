"""Dummy steps: what warm-up, memory profiling and graph capture run, so that
they go through the same batch builder, dispatcher, forward and sampler as a real step.

Their KV goes to real block ids (wrapped around the pool, or a scratch cache while
profiling); that is harmless before serving starts, since a real request always writes its
KV before reading it. Their sampling asks for top-k and top-p, so the profiled step includes
the sampler's most memory-hungry path (a sort over the vocabulary per row).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sampling_params import SamplingParams
from .batch import PAD_TOKEN_ID
from .runner_requests import RunnerChunk, RunnerRequest, RunnerStep

_DUMMY_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1, seed=0)


def dummy_lengths(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """``num_tokens`` split into prefills of at most ``max_model_len`` tokens, as few as
    possible (at most ``max_num_seqs``: the scheduler's limit too)."""
    lens = [min(max_model_len, num_tokens - s) for s in range(0, num_tokens, max_model_len)]
    return lens[:max_num_seqs]


def dummy_prefill(lengths: list[int], block_size: int, num_blocks: int) -> RunnerStep:
    """One fresh prefill per length, each over its own consecutive blocks (modulo the pool),
    every one sampling a token."""
    return prefill_step([[PAD_TOKEN_ID] * n for n in lengths], block_size, num_blocks, _DUMMY_PARAMS, "dummy")


def prefill_step(prompts: list[list[int]], block_size: int, num_blocks: int, params: SamplingParams,
                 prefix: str) -> RunnerStep:
    """One step that prefills every prompt whole, each over its own consecutive blocks
    (modulo the pool), every one sampling a token with ``params``."""
    chunks, first = [], 0
    for i, ids in enumerate(prompts):
        count = -(-len(ids) // block_size)
        blocks = [(first + b) % num_blocks for b in range(count)]
        first += count
        req = RunnerRequest(f"{prefix}-{i}", list(ids), params, block_ids=blocks)
        chunks.append(RunnerChunk(req, len(ids), 0, True))
    return RunnerStep(chunks)


def dummy_decode(num_seqs: int, context: int, block_size: int, num_blocks: int, first_token: int = 6) -> RunnerStep:
    """A pure-decode step: ``num_seqs`` sequences of ``context`` cached tokens each (over
    distinct blocks, modulo the pool), one new token each (benchmarks of the decode path)."""
    chunks = []
    per_seq = -(-(context + 1) // block_size)
    for i in range(num_seqs):
        blocks = [(i * per_seq + b) % num_blocks for b in range(per_seq)]
        req = RunnerRequest(f"dummy-decode-{i}", [PAD_TOKEN_ID] * context + [first_token + i], _DUMMY_PARAMS,
                            block_ids=blocks)
        chunks.append(RunnerChunk(req, 1, context, True))
    return RunnerStep(chunks)


def blocks_for(lengths: list[int], block_size: int) -> int:
    """Blocks ``dummy_prefill`` uses without wrapping (the size of a scratch cache)."""
    return sum(-(-n // block_size) for n in lengths)


@dataclass(frozen=True)
class DummySource:
    """Dummy prefills of a given size for graph capture, over a pool of ``num_blocks``."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int

    def prefill(self, num_tokens: int) -> RunnerStep:
        lens = dummy_lengths(num_tokens, self.max_model_len, self.max_num_seqs)
        return dummy_prefill(lens, self.block_size, self.num_blocks)
