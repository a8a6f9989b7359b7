"""What the engine hands back, in two forms.

- Per step, ``LLMEngine.step`` emits ``OutputDelta``s: each request's *new* tokens (with their
  logprobs), a finish, prompt logprobs once, an embedding once. It never detokenizes and never
  copies what a request produced before, so a step costs the same at token 10 and token 10,000.
- Callers get ``RequestOutput``s, shaped like vLLM's so its users feel at home, built from the
  deltas by the one ``OutputProcessor`` (text, stop strings, n groups), cumulative, as deltas,
  or once at the end (``OutputKind``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union


class OutputKind(enum.Enum):
    """What a caller receives for a request (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = "cumulative"  # each output holds everything so far (the server's streams)
    DELTA = "delta"  # each output holds only what is new since the previous one
    FINAL_ONLY = "final_only"  # one output, when the request finishes (LLM.generate)


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence gained in one step: tokens (with their logprobs) and, once, its end."""

    index: int
    new_token_ids: list[int]
    new_logprobs: Optional[list[dict[int, float]]]  # None unless the request asked for logprobs
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


@dataclass(slots=True)
class OutputDelta:
    """One request's news from one step (``embedding`` set for a pooling request, which ends at once)."""

    request_id: str
    sequences: list[SequenceDelta] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None  # once, when complete
    embedding: Optional[Any] = None  # a sequence of floats


@dataclass(slots=True)
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


@dataclass(slots=True)
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
