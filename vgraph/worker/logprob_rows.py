"""Logprobs that stay on the device until their step is finished.

A step's logprobs (the sampled tokens' and the prompt tokens') are computed on the device with
the step, but a GPU only has them once the step has run. Read at launch (``.tolist()``), they
made the host wait for the step it had just enqueued: every step that carried a request asking
for logprobs ran serially, overlapped scheduling or not. (On an H200 the e2e suite's served
streams, which ask ``logprobs=0``, stepped in 1.56-1.98 ms overlapped and 1.44-1.73 ms serial on
the 0.5B shape at one stream, against 1.13 and 1.49 ms offline without logprobs.) So the
sampler and the prompt scorer return ``LogprobRows`` (device tensors), the launched step copies
them to pinned host memory with its sampled ids (``HostCopy``: one event for all) and builds
the ``{token: logprob}`` entries when it is finished, after the next step was launched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class LogprobRows:
    """Per row: the logprob of the token it scores and its top ``n`` (``counts[row]``; None: the
    row did not ask, its entry is None). ``top_ids`` / ``top_vals`` hold the largest n asked."""

    chosen: torch.Tensor  # [R] float32: logprob of each row's own token
    top_ids: Optional[torch.Tensor]  # [R, N] int64, None when nobody asked for a top-n (N = 0)
    top_vals: Optional[torch.Tensor]  # [R, N] float32
    counts: list[Optional[int]]

    @classmethod
    def of(cls, logprobs: torch.Tensor, token_ids: torch.Tensor, counts: list[Optional[int]],
           top_n: Optional[int] = None) -> "LogprobRows":
        """From ``[R, V]`` log-probabilities and the ``[R]`` tokens the rows score (device work
        only). ``top_n``: the top's width (default: the largest count; slices of one batch give
        the batch's, so that ``cat`` can join them)."""
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if top_n is None:
            top_n = max((n for n in counts if n is not None), default=0)
        top_n = min(top_n, logprobs.shape[-1])
        if not top_n:
            return cls(chosen, None, None, counts)
        top_vals, top_ids = logprobs.topk(top_n, dim=-1)
        return cls(chosen, top_ids, top_vals, counts)

    @classmethod
    def cat(cls, parts: Sequence["LogprobRows"]) -> "LogprobRows":
        """The rows of ``parts`` in order (all of one top width)."""
        if len(parts) == 1:
            return parts[0]
        tops = parts[0].top_ids is not None
        return cls(torch.cat([p.chosen for p in parts]),
                   torch.cat([p.top_ids for p in parts]) if tops else None,
                   torch.cat([p.top_vals for p in parts]) if tops else None,
                   [n for p in parts for n in p.counts])

    def tensors(self) -> list[torch.Tensor]:
        """What the host has to read, in the order ``entries`` takes it back."""
        return [self.chosen] if self.top_ids is None else [self.chosen, self.top_ids, self.top_vals]

    def entries(self, token_ids: Sequence[int], host: Sequence[torch.Tensor]) -> list[Optional[dict[int, float]]]:
        """Per row ``{token: logprob}``: its own token first, then its top n in rank order (n + 1
        entries, or n when its token is among them). ``host``: ``tensors()`` read on the host."""
        chosen = host[0].tolist()
        top_ids, top_vals = (host[1].tolist(), host[2].tolist()) if len(host) > 1 else ([], [])
        out: list[Optional[dict[int, float]]] = []
        for row, n in enumerate(self.counts):
            if n is None:
                out.append(None)
                continue
            entry = {token_ids[row]: chosen[row]}
            if n:
                for tid, val in zip(top_ids[row][:n], top_vals[row][:n]):
                    entry.setdefault(tid, val)
            out.append(entry)
        return out


class HostCopy:
    """Device tensors copied to the host, started at once and read when needed.

    On CUDA each tensor is copied into pinned memory without blocking and one event marks the
    end of all the copies: ``wait`` then waits for this step's work only. Elsewhere the tensors
    are on the host already and ``wait`` returns them."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not any(t.is_cuda for t in tensors):
            self._host, self._ready = list(tensors), None
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self._host, tensors):
            host.copy_(tensor, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def wait(self) -> list[torch.Tensor]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host
