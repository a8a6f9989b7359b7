"""``SamplingParams``: what a request asks of the sampler, validated before it reaches the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .structured.params import StructuredOutputsParams

_EPS = 1e-5


@dataclass
class SamplingParams:
    """Same fields and meanings as vLLM's (and OpenAI's where they overlap)."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = all tokens
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16  # None = up to max_model_len
    min_tokens: int = 0
    logprobs: Optional[int] = None  # number of top logprobs per generated token (0 = only the chosen)
    # Top logprobs per prompt token (0 = only the prompt token's own); the first token has none.
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    # Constrains the output to a JSON schema, JSON object, regex, choice or grammar (a dict
    # with the same keys is accepted too); ``guided_decoding`` is vLLM's older name for it.
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        self.structured_outputs = _structured(self.structured_outputs, self.guided_decoding)
        self.guided_decoding = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    def validate(self, max_logprobs: Optional[int] = None) -> None:
        """Raises ValueError naming the field and the allowed range."""
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0 < self.repetition_penalty <= 2, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            # 0: prefill only (e.g. prompt_logprobs alone); the request ends with reason "length".
            (self.max_tokens is None or self.max_tokens >= 0, f"max_tokens must be non-negative, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be non-negative, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.structured_outputs is not None and self.min_tokens > 0:
            raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides "
                             "where the output ends")
        if max_logprobs is not None and self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(f"logprobs={self.logprobs} exceeds the maximum of {max_logprobs} "
                             "(raise it with max_logprobs / --max-logprobs)")
        if max_logprobs is not None and self.prompt_logprobs is not None and self.prompt_logprobs > max_logprobs:
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs} exceeds the maximum of {max_logprobs} "
                             "(raise it with max_logprobs / --max-logprobs)")


def _structured(value: Any, alias: Any) -> Optional[StructuredOutputsParams]:
    """``structured_outputs`` (or its alias ``guided_decoding``) as StructuredOutputsParams."""
    if value is not None and alias is not None and value != alias:
        raise ValueError("structured_outputs and guided_decoding are the same setting; give one of them")
    value = value if value is not None else alias
    if isinstance(value, dict):
        return StructuredOutputsParams.from_dict(value)
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                         f"got {type(value).__name__}")
    return value
