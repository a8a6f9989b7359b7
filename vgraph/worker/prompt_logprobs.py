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
from .runner_requests import RunnerRequest, RunnerStep

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


def compute_prompt_logprobs(hidden: torch.Tensor, step: RunnerStep,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor]
                            ) -> Optional[dict[str, PromptLogprobs]]:
    """Per request that asks: the prompt tokens this step scores, as ``{token: logprob}`` with
    the prompt token first and then the top ``num_prompt_logprobs``. None if nobody asks."""
    spans = _spans(step)
    if not spans:
        return None
    rows = torch.tensor([r for span in spans for r in span.rows], dtype=torch.int64)
    targets = torch.tensor([t for span in spans for t in _targets(span)], dtype=torch.int64)
    top_n = max(span.request.num_prompt_logprobs for span in spans)
    chosen, top_vals, top_ids = [], [], []
    for lo in range(0, len(rows), _ROWS_PER_SLICE):
        idx = rows[lo:lo + _ROWS_PER_SLICE].to(hidden.device)
        tgt = targets[lo:lo + _ROWS_PER_SLICE].to(hidden.device)
        logprobs = compute_logits(hidden[idx]).float().log_softmax(dim=-1)
        chosen.append(logprobs.gather(1, tgt.unsqueeze(1)).squeeze(1))
        if top_n:
            vals, ids = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
            top_vals.append(vals)
            top_ids.append(ids)
    chosen_l = torch.cat(chosen).tolist()
    vals_l = torch.cat(top_vals).tolist() if top_n else None
    ids_l = torch.cat(top_ids).tolist() if top_n else None
    out: dict[str, PromptLogprobs] = {}
    i = 0
    for span in spans:
        n = span.request.num_prompt_logprobs
        entries = []
        for token in _targets(span):
            entry = {token: chosen_l[i]}
            if n:
                for tid, val in zip(ids_l[i][:n], vals_l[i][:n]):
                    entry.setdefault(tid, val)
            entries.append(entry)
            i += 1
        out[span.request.request_id] = PromptLogprobs(span.first, entries)
    return out


def _targets(span: _Span) -> list[int]:
    return span.request.prompt_token_ids[span.first:span.first + len(span.rows)]

