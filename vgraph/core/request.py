"""A request's state as it moves through the scheduler."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..sampling_params import SamplingParams
from ..structured.matcher import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV will be recomputed
    FINISHED_STOPPED = "stop"  # EOS, stop token id or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """One sequence. ``n > 1`` requests are split into n of these by the engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prefix-cache hits included).
    num_computed_tokens: int = 0
    num_cached_prefix_tokens: int = 0  # of the prompt, found in the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: Optional[int | str] = None
    # Per generated token: {token_id: logprob} including the chosen token (when logprobs asked).
    logprobs: list[dict[int, float]] = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    # Mixed into the first prefix-cache block hash: requests with different salts never share KV.
    cache_salt: Optional[str] = None
    # Structured outputs: this sequence's matcher, advanced by the scheduler on each new token.
    grammar: Optional[GrammarState] = None

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None
