"""The runner's own copy of the requests the scheduler has planned, and one step's chunks over
them: what the batch builder, the sampler, prompt logprobs and pooling read.

The scheduler's ``StepPlan`` (core/step_plan.py) sends a request's fixed parts once and then
only what changed; ``RunnerRequests.apply`` folds each plan in and returns the step. Every
tensor-parallel rank does the same with the same plan, so the ranks need nothing else. The
seeded generator lives here, with the sampler that draws from it, and survives preemption (a
recompute samples nothing it sampled before).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..core.kv_cache_manager import token_slice
from ..core.step_plan import PlannedChunk, PlannedRequest, StepPlan
from ..lora.request import LoRARequest
from ..sampling_params import SamplingParams


PENDING = -1  # a sampled token whose id the host has not read yet (never a vocabulary id; launched.py)


@dataclass(slots=True)
class RunnerRequest:
    """One sequence as the runner knows it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    num_prompt_logprobs: Optional[int] = None
    pooling_type: Optional[str] = None
    lora_request: Optional[LoRARequest] = None
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    generator: Optional[torch.Generator] = None

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @classmethod
    def planned(cls, p: PlannedRequest) -> "RunnerRequest":
        return cls(p.request_id, list(p.prompt_token_ids), p.sampling_params, p.eos_token_ids,
                   p.num_prompt_logprobs, p.pooling_type, p.lora_request)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, position: int) -> int:
        """The token id at ``position`` of prompt + output."""
        prompt = self.prompt_token_ids
        return prompt[position] if position < len(prompt) else self.output_token_ids[position - len(prompt)]


@dataclass(slots=True)
class RunnerChunk:
    """One request's share of a step: ``num_new_tokens`` tokens at positions ``start_position..``.

    Not frozen: one is built for every row of every step, and a frozen dataclass's ``__init__``
    costs five times a plain one's (0.55 against 0.11 us: 0.1 ms a step at batch 256)."""

    request: RunnerRequest
    num_new_tokens: int
    start_position: int
    produces_token: bool  # samples the next token after its last row
    num_prompt_logprobs_done: int = 0  # prompt tokens already scored (prompt logprobs requests)
    # Speculative guesses after the last known token: the chunk's last rows, each sampled.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_sampled_rows(self) -> int:
        return len(self.draft_token_ids) + 1 if self.produces_token else 0

    @property
    def token_ids(self) -> list[int]:
        known = token_slice(self.request, self.start_position,
                            self.start_position + self.num_new_tokens - len(self.draft_token_ids))
        return known + list(self.draft_token_ids) if self.draft_token_ids else known


@dataclass(frozen=True)
class RunnerStep:
    """One forward pass's chunks, in batch order."""

    chunks: list[RunnerChunk] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class RunnerRequests:
    """Every request the scheduler has planned and not yet finished, by id.

    Each sampled token is appended here at launch (worker/launched.py), before the scheduler
    hears of it: a step scheduled ahead (overlapped scheduling) finds it here.
    """

    def __init__(self) -> None:
        self.requests: dict[str, RunnerRequest] = {}
        # How many live requests ask for prompt logprobs / pooled states: while none does, a
        # step skips the walks over its chunks that look for them (every step of a large batch).
        self.num_scoring = 0
        self.num_pooling = 0

    def apply(self, plan: StepPlan) -> RunnerStep:
        for request_id in plan.forget:
            gone = self.requests.pop(request_id, None)
            if gone is not None:
                self._count(gone, -1)
        for p in plan.new:
            request = self.requests[p.request_id] = RunnerRequest.planned(p)
            self._count(request, 1)
        return RunnerStep([self._advance(c) for c in plan.chunks])

    def _count(self, request: RunnerRequest, sign: int) -> None:
        self.num_scoring += sign * (request.num_prompt_logprobs is not None)
        self.num_pooling += sign * (request.pooling_type is not None)

    def _advance(self, c: PlannedChunk) -> RunnerChunk:
        req = self.requests[c.request_id]
        end = c.output_from + len(c.new_output_tokens)
        if c.output_from > len(req.output_token_ids):
            raise RuntimeError(f"request {c.request_id}: the runner's copy lacks output tokens "
                               f"{len(req.output_token_ids)}..{c.output_from - 1}")
        req.output_token_ids[c.output_from:end] = c.new_output_tokens  # its own samples beyond stay
        del req.block_ids[c.blocks_from:]
        req.block_ids.extend(c.new_blocks)
        if c.start_position + c.num_new_tokens - len(c.draft_token_ids) > req.num_tokens:
            raise RuntimeError(f"request {c.request_id}: the runner's copy is out of step with the scheduler's "
                               f"({req.num_tokens} tokens, chunk {c.start_position}+{c.num_new_tokens})")
        return RunnerChunk(req, c.num_new_tokens, c.start_position, c.produces_token, c.num_prompt_logprobs_done,
                           tuple(c.draft_token_ids))
