"""A request's state as it moves through the scheduler."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ..lora.request import LoRARequest
from ..sampling_params import SamplingParams
from ..structured.matcher import GrammarState

if TYPE_CHECKING:
    from .outputs import PoolingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV will be recomputed
    FINISHED_STOPPED = "stop"  # EOS, stop token id or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # A plain attribute, set once per member: asked several times for every sequence of
        # every step, where a property hashing the member into a set cost ~0.4 us a time.
        self.finished = value in ("stop", "length", "abort")


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
    # Mixed into the first prefix-cache block hash: requests with different salts never share KV.
    cache_salt: Optional[str] = None
    # Top-n prompt logprobs this sequence computes (None: none). The engine sets it on the first
    # sequence of an n > 1 request only, so the prompt's logprobs are computed once.
    num_prompt_logprobs: Optional[int] = None
    # Per prompt token: {token id: logprob} (the token's own first, then the top-n); the first
    # token has no logprob (None). Filled chunk by chunk; never longer than the prompt.
    prompt_logprobs: list[Optional[dict[int, float]]] = field(default_factory=list)
    # A pooling (embedding) request: prefill only, its hidden states pooled chunk by chunk.
    pooling: Optional["PoolingState"] = None
    # Structured outputs: this sequence's matcher, advanced by the scheduler on each new token.
    grammar: Optional[GrammarState] = None
    # The LoRA adapter this sequence runs with (None: the base model).
    lora_request: Optional[LoRARequest] = None
    # Tokens scheduled to be sampled whose ids are not known yet (a step in flight): a step
    # scheduled ahead feeds them from the runner's own copy (overlapped scheduling).
    num_pending_tokens: int = 0
    # Tokens the latest step appended (more than one when speculative guesses were accepted).
    num_step_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def lora_id(self) -> Optional[int]:
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def prefix_salt(self) -> Optional[bytes]:
        """Mixed into the first block's hash: requests with different cache salts, or run with
        different adapters (whose KV differs for the same tokens), never share cached blocks."""
        parts = [p for p in (self.cache_salt, None if self.lora_id is None else f"lora:{self.lora_id}") if p]
        return "\x00".join(parts).encode() if parts else None

    @property
    def prefill_only(self) -> bool:
        """Computes its prompt and ends there (``max_tokens=0``, or pooling): samples nothing."""
        return self.pooling is not None or self.sampling_params.max_tokens == 0

    @property
    def skips_prefix_cache(self) -> bool:
        """Requests that need every prompt position's hidden state (prompt logprobs, pooling)
        recompute the prompt instead of reusing cached KV (they still publish their blocks)."""
        return self.pooling is not None or self.num_prompt_logprobs is not None

    def add_prompt_logprobs(self, first: int, entries: list[dict[int, float]]) -> None:
        """Entries for prompt tokens ``first ..``: only those not scored yet are kept (a
        recompute after preemption scores some again)."""
        have = len(self.prompt_logprobs)
        if first > have:
            raise RuntimeError(f"prompt logprobs of {self.request_id} would skip tokens {have}..{first - 1}")
        self.prompt_logprobs.extend(entries[have - first:])

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.num_prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_token_ids)

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
