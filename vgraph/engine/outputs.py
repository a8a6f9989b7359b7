"""What the engine hands back: shaped like vLLM's ``RequestOutput`` so its users feel at home."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, float]]]  # per token: {token id: logprob}, chosen included
    finish_reason: Optional[str] = None  # "stop", "length", "abort" or None while running
    stop_reason: Optional[int | str] = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: one entry per prompt token, {token id: logprob} with
    # the prompt token first, then the top-n; the first token's entry is None. Set once the
    # whole prompt has been scored (None before, and when not asked).
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # the pooled final hidden state (L2-normalized unless configured off)


@dataclass
class EmbeddingRequestOutput:
    """One ``LLM.embed`` / pooling result, shaped like vLLM's: ``output.outputs.embedding``."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
