"""Logprobs in OpenAI's two formats, from the engine's per-token ``{token id: logprob}`` dicts.

The engine gives, for each generated token, the sampled token's logprob followed by the
requested top-n (from the raw model distribution, as vLLM reports them). Completions list
them all, vLLM-style (so up to n + 1 entries when the sampled token is not in the top n);
chat lists exactly the top n, as OpenAI documents.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


class TokenTexts:
    """Each token id's own text, decoded once and remembered (the vocabulary is finite)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, float]],
                        texts: TokenTexts, text_offset: int) -> tuple[dict[str, Any], int]:
    """Completions' ``{tokens, token_logprobs, top_logprobs, text_offset}`` and the next offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        text = texts(token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry.get(token_id)))
        top.append({texts(t): _finite(v) for t, v in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}, text_offset


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], texts: TokenTexts,
                  num_top: int) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: one entry per token with its top ``num_top`` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num_top]
        content.append({**_chat_entry(texts(token_id), entry.get(token_id)),
                        "top_logprobs": [_chat_entry(texts(t), v) for t, v in best]})
    return content


def _chat_entry(text: str, logprob: Optional[float]) -> dict[str, Any]:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(value: Optional[float]) -> Optional[float]:
    """JSON has no -inf: a token the model gives zero probability is reported as -9999.0."""
    if value is None:
        return None
    return max(float(value), -9999.0)


def prompt_logprobs_part(token_ids: Sequence[int], logprobs: Sequence[Optional[dict[int, float]]],
                         texts: TokenTexts) -> tuple[dict[str, Any], int]:
    """The echoed prompt's part of completions' logprobs, as OpenAI gives it: one entry per
    prompt token, the first with ``null`` logprob and top logprobs (nothing precedes it).
    Offsets count from 0 (the start of the echoed text); returns the offset after the prompt."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for token_id, entry in zip(token_ids, logprobs):
        text = texts(token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else _finite(entry.get(token_id)))
        top.append(None if entry is None else {texts(t): _finite(v) for t, v in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}, offset


def join_logprobs(first: dict[str, Any], second: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Completions' logprobs of the prompt followed by those of the generated tokens."""
    if second is None:
        return first
    return {key: first[key] + second[key] for key in first}
