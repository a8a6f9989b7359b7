"""Prompt logprobs: the log-probability of each prompt token given the tokens before it,
computed in the same forward as the prefill.

Row ``j`` of a prefill chunk holds the hidden state after position ``j``, whose logits score
prompt token ``j + 1``. So a chunk over positions ``s .. s + n - 1`` scores prompt tokens
``s + 1 .. s + n`` (up to the prompt's last one): the chunk's last row scores the next chunk's
first token, and the first prompt token has no logprob at all. Only the rows of requests that
ask go through ``lm_head`` (everyone else still gets logits for its sampled row only), and a
request that was preempted and recomputes its prompt skips the tokens already scored, so
nothing is scored twice or lost. Logprobs are ``log_softmax`` of the raw logits, as the
sampler's are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..core.outputs import PromptLogprobs
from .logprob_rows import LogprobRows
from .runner_requests import RunnerRequest, RunnerStep
from .sampler import device_tensor

# Rows sent through lm_head + log_softmax at once: bounds the [rows, vocab] float32 buffers
# (1024 rows of a 152k vocabulary is 0.6 GB) whatever the prompt's length.
_ROWS_PER_SLICE = 1024


@dataclass
class _Span:
    request: RunnerRequest
    first: int  # first prompt token scored
    rows: range  # rows of the flat batch, one per token scored


def _spans(step: RunnerStep) -> list[_Span]:
    """Which rows of this step score which prompt tokens, per request that asks."""
    spans, offset = [], 0
    for item in step.chunks:
        request, n, start = item.request, item.num_new_tokens, item.start_position
        if request.num_prompt_logprobs is not None:
            first = max(start + 1, item.num_prompt_logprobs_done)  # already scored: skipped
            last = min(start + n, request.num_prompt_tokens - 1)
            if first <= last:
                spans.append(_Span(request, first, range(offset + first - 1 - start, offset + last - start)))
        offset += n
    return spans


@dataclass(frozen=True)
class PendingPromptLogprobs:
    """The prompt tokens one step scores, per request, with their logprobs still on the device
    (read when the step is finished: ``launched.py``)."""

    spans: list[tuple[str, int, list[int]]]  # (request id, first prompt token scored, the tokens)
    rows: LogprobRows  # one row per token scored, in span order

    def tensors(self) -> list[torch.Tensor]:
        return self.rows.tensors()

    def entries(self, host: list[torch.Tensor]) -> dict[str, PromptLogprobs]:
        """Per request ``PromptLogprobs``, from ``tensors()`` read on the host."""
        entries = self.rows.entries([t for _, _, tokens in self.spans for t in tokens], host)
        out: dict[str, PromptLogprobs] = {}
        i = 0
        for request_id, first, tokens in self.spans:
            out[request_id] = PromptLogprobs(first, entries[i:i + len(tokens)])
            i += len(tokens)
        return out


def compute_prompt_logprobs(hidden: torch.Tensor, step: RunnerStep,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor]
                            ) -> Optional[PendingPromptLogprobs]:
    """Per request that asks: the prompt tokens this step scores, each with its logprob and the
    top ``num_prompt_logprobs`` (on the device: nothing here waits for it). None if nobody asks."""
    spans = _spans(step)
    if not spans:
        return None
    rows = [r for span in spans for r in span.rows]
    targets = [_targets(span) for span in spans]
    flat_targets = [t for tokens in targets for t in tokens]
    counts = [span.request.num_prompt_logprobs for span in spans for _ in span.rows]
    top_n = max(counts)
    parts = []
    for lo in range(0, len(rows), _ROWS_PER_SLICE):
        idx = device_tensor(rows[lo:lo + _ROWS_PER_SLICE], torch.int64, hidden.device)
        tgt = device_tensor(flat_targets[lo:lo + _ROWS_PER_SLICE], torch.int64, hidden.device)
        logprobs = compute_logits(hidden[idx]).float().log_softmax(dim=-1)
        parts.append(LogprobRows.of(logprobs, tgt, counts[lo:lo + _ROWS_PER_SLICE], top_n))
    return PendingPromptLogprobs([(span.request.request_id, span.first, tokens) for span, tokens in zip(spans, targets)],
                                 LogprobRows.cat(parts))


def _targets(span: _Span) -> list[int]:
    return span.request.prompt_token_ids[span.first:span.first + len(span.rows)]

