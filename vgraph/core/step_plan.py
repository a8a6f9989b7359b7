"""What the scheduler hands the model runner each step: plain data, never live ``Request``s.

The runner (every tensor-parallel rank's, alike) keeps its own copy of each request it has
been told about (worker/runner_requests.py). A request's fixed parts (prompt, sampling
parameters, ...) are sent once, the first time it is scheduled; each step then carries only
what changed (the tokens appended since, the block ids past the common prefix, where the chunk
starts), and finished requests are named once so the runner drops them. A step's plan is
therefore small whatever the prompts' lengths, and the same object serves one process or N
ranks: it is picklable and holds nothing the scheduler mutates later.

What only the engine has stays there: grammar matchers (the engine fills the step's
allowed-token masks), detokenizers, the accumulated outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ..lora.request import LoRARequest
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from .scheduler import ScheduledRequest


@dataclass(frozen=True)
class PlannedRequest:
    """A request's fixed parts, sent the first time the runner sees it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    num_prompt_logprobs: Optional[int] = None
    pooling_type: Optional[str] = None  # "mean" | "last" for a pooling (embedding) request
    lora_request: Optional[LoRARequest] = None  # its adapter (None: the base model)


@dataclass(slots=True)
class PlannedChunk:
    """One scheduled chunk: ``num_new_tokens`` tokens from ``start_position`` on, and what
    changed in its request since the runner last saw it. Not frozen: one is built per request
    per step, and a frozen dataclass's ``__init__`` costs about twice as much; nothing changes
    it after the planner made it."""

    request_id: str
    num_new_tokens: int
    start_position: int
    produces_token: bool  # the chunk reaches the last known token: the runner samples the next
    # The request's output tokens from index ``output_from`` on, as far as the scheduler knows
    # them. The runner appends each token it samples at once (a step scheduled before the
    # previous one's tokens are known reads it there); these confirm it, or bring the tokens a
    # rank that samples nothing (an earlier pipeline stage) has not seen.
    new_output_tokens: list[int] = field(default_factory=list)
    output_from: int = 0
    blocks_from: int = 0  # the runner keeps block_ids[:blocks_from] and appends new_blocks
    new_blocks: list[int] = field(default_factory=list)
    # Prompt tokens whose logprobs are already scored (a recompute after preemption skips them).
    num_prompt_logprobs_done: int = 0
    # Speculative guesses run after the chunk's last known token (counted in num_new_tokens).
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepPlan:
    """One forward pass, in batch order."""

    forget: list[str] = field(default_factory=list)  # dropped before ``new`` is added
    new: list[PlannedRequest] = field(default_factory=list)
    chunks: list[PlannedChunk] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


@dataclass(slots=True)
class _Seen:
    """What the runner was last told about one request. Blocks only grow while a request
    runs; a preemption frees them all, so a changed preemption count resends the table."""

    num_output_tokens: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0


class StepPlanner:
    """The scheduler's record of what the runner knows, turned into each step's ``StepPlan``."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}
        self._forget: list[str] = []

    def forget(self, request_id: str) -> None:
        """A finished request: the next plan tells the runner to drop it."""
        if self._seen.pop(request_id, None) is not None:
            self._forget.append(request_id)

    def plan(self, scheduled: list["ScheduledRequest"]) -> StepPlan:
        """The runner executes only plans with chunks: an empty step keeps what it must forget
        for the next one."""
        if not scheduled:
            return StepPlan()
        forget, self._forget = self._forget, []
        new: list[PlannedRequest] = []
        chunks = [self._chunk(new, item) for item in scheduled]
        return StepPlan(forget, new, chunks)

    def _chunk(self, new: list[PlannedRequest], item: "ScheduledRequest") -> PlannedChunk:
        req = item.request
        seen = self._seen.get(req.request_id)
        if seen is None:
            new.append(PlannedRequest(req.request_id, list(req.prompt_token_ids), req.sampling_params,
                                      req.eos_token_ids, req.num_prompt_logprobs,
                                      None if req.pooling is None else req.pooling.pooling_type,
                                      req.lora_request))
            seen = self._seen[req.request_id] = _Seen()
        keep = seen.num_blocks if req.num_preemptions == seen.num_preemptions else 0
        chunk = PlannedChunk(req.request_id, item.num_new_tokens, item.start_position, item.produces_token,
                             req.output_token_ids[seen.num_output_tokens:], seen.num_output_tokens, keep,
                             req.block_ids[keep:], len(req.prompt_logprobs), list(item.draft_token_ids))
        seen.num_output_tokens, seen.num_blocks = len(req.output_token_ids), len(req.block_ids)
        seen.num_preemptions = req.num_preemptions
        return chunk
