"""Prompt normalization and the checks that keep bad input away from the engine."""
from __future__ import annotations

import re
from typing import Any, Optional, Union

from ..sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]
# What a pooling request is checked and scheduled as: a prompt, and no token sampled.
PREFILL_ONLY = SamplingParams(max_tokens=0)


class InputError(ValueError):
    """Input the engine cannot serve; ``param`` names the request field at fault (``prompt``,
    ``max_tokens``, ``stop_token_ids``), so the server's 400 can name it too."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param

    def for_prompt(self, index: int) -> "InputError":
        """The same error, said of prompt ``index`` of several."""
        return InputError(f"prompt {index}: {self}", self.param)


class ContextLengthError(InputError):
    """A request longer than the model's context, said in OpenAI's (and vLLM's) words: clients
    recognise the overflow by that sentence (litellm raises ContextWindowExceededError on it),
    so its wording is part of the API. ``where`` names the input: the prompt, or the messages
    of a chat request (``said_of``)."""

    def __init__(self, max_model_len: int, prompt_tokens: int, completion_tokens: int,
                 param: Optional[str], where: str = "prompt") -> None:
        self.numbers = (max_model_len, prompt_tokens, completion_tokens)
        super().__init__(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the {where}, "
                         f"{completion_tokens} in the completion). Please reduce the length of the {where} "
                         "or completion.", param)

    def said_of(self, where: str) -> "ContextLengthError":
        return ContextLengthError(*self.numbers, self.param, where)


def prompt_to_ids(prompt: PromptType, tokenizer: Any) -> tuple[Optional[str], list[int]]:
    """A string, a list of token ids, or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _as_ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt, list(tokenizer.encode(prompt))
    return None, _as_ids(prompt)


def _as_ids(ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt token ids must be a list of integers")
    return list(ids)


def check_prompt(ids: list[int], params: SamplingParams, vocab_size: int,
                 max_model_len: int) -> SamplingParams:
    """Raises ValueError for prompts the engine cannot serve; returns params with max_tokens set."""
    if not ids:
        raise InputError("the prompt is empty (no tokens)", "prompt")
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
    unknown_stops = [t for t in params.stop_token_ids if t >= vocab_size]
    if unknown_stops:  # it could never be sampled: a typo the caller should hear about
        raise InputError(f"stop_token_ids: token id {unknown_stops[0]} is outside the vocabulary "
                         f"[0, {vocab_size})", "stop_token_ids")
    if params.max_tokens == 0:  # prefill only (echo, scoring, pooling): the prompt may fill the context
        if len(ids) > max_model_len:
            raise ContextLengthError(max_model_len, len(ids), 0, "prompt")
        return params
    if len(ids) >= max_model_len:  # no room for the one token every generation produces
        raise ContextLengthError(max_model_len, len(ids), params.max_tokens or 1, "prompt")
    room = max_model_len - len(ids)
    if params.max_tokens is None:
        return _with_max_tokens(params, room)
    if params.max_tokens > room:
        raise ContextLengthError(max_model_len, len(ids), params.max_tokens, "max_tokens")
    return params


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, max_tokens=max_tokens)


def template_supports_tools(template: Optional[str]) -> bool:
    """Whether a chat template reads ``tools`` (one that does not would silently drop them)."""
    return bool(template) and re.search(r"\btools\b", template) is not None
