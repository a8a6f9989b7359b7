"""A step whose device work is enqueued and whose sampled ids are not read yet.

Overlapped scheduling launches step N+1 before it reads step N's ids, so that on a GPU the host
builds and launches the next step while the device still computes this one. Two things make
that exact:

- Each sampled row's request gets a ``PENDING`` token in the runner's copy at launch, in the
  place its id will take; ``finish`` writes the id there. Lengths, positions and block slots
  are therefore right at once, whatever still waits for the device.
- A step launched while a request's token is pending feeds that row's input id from the
  earlier step's sampled tensor on the device (``pending_inputs``): no host round trip.

- Sampling that counts earlier ids (penalties) adds a pending token to its row's counts on the
  device, from the earlier step's sampled tensor (``pending_tokens``): no wait either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from ..core.outputs import ModelRunnerOutput
from .logprob_rows import HostCopy, LogprobRows
from .pooling import PendingPooled
from .prompt_logprobs import PendingPromptLogprobs
from .runner_requests import PENDING, RunnerRequest, RunnerStep
from .sampler import device_tensor


class LaunchedStep:
    """One step's results as they come off the device: the sampled ids, the logprobs and prompt
    logprobs and the pooled states: device tensors whose copies to the host start at launch on
    CUDA and are read at ``finish``.

    A verifying request (speculative guesses, spec/) has one sampled row per guess plus one:
    at ``finish`` its guesses are accepted while each equals the target's token at the row
    before it, and the target's token after the last accepted one is its sampled token. It
    is never scheduled before that (its token count is unknown until then): no placeholder."""

    def __init__(self, step: RunnerStep, sampled_requests: Iterable[RunnerRequest] = (),
                 token_ids: Optional[torch.Tensor] = None, logprobs: Optional[LogprobRows] = None,
                 prompt_logprobs: Optional[PendingPromptLogprobs] = None,
                 pooled: Optional[PendingPooled] = None, record: bool = True) -> None:
        """``record``: the rows' requests are the runner's copies, which take pending tokens
        (not so for the dummy requests of warm-up, profiling and capture)."""
        self.requests = list(sampled_requests)
        self.token_ids = token_ids
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self._pooled = pooled
        self._record = record
        # Per sampling chunk: its request, its guesses, and where its id goes in the request's
        # output (behind a PENDING placeholder; None for a verifying request).
        # (None: a step that samples nothing here, e.g. a pipeline stage before the last.)
        self._chunks = [(c.request, c.draft_token_ids, None if c.draft_token_ids or not record
                         else _placeholder(c.request)) for c in step.chunks if c.produces_token and self.requests]
        # Everything the host reads of this step, copied off the device together, from now on:
        # the sampled ids, then the logprobs, the prompt logprobs and the pooled values.
        tensors = [token_ids] if token_ids is not None and self.requests else []
        self._logprobs_at = len(tensors)
        tensors += logprobs.tensors() if logprobs is not None else ()
        self._prompt_at = len(tensors)
        tensors += prompt_logprobs.tensors() if prompt_logprobs is not None else ()
        self._pooled_at = len(tensors)
        tensors += pooled.tensors() if pooled is not None else ()
        self._copy = HostCopy(tensors)
        self._result: Optional[ModelRunnerOutput] = None

    @property
    def finished(self) -> bool:
        return self._result is not None

    def row_of(self) -> dict[str, int]:
        """Request id -> its (last) row of ``token_ids``."""
        return {r.request_id: i for i, r in enumerate(self.requests)}

    def finish(self) -> ModelRunnerOutput:
        """Waits for the ids (once) and writes them over the placeholders."""
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> ModelRunnerOutput:
        host = self._copy.wait()
        prompt_logprobs = (None if self._prompt_logprobs is None
                           else self._prompt_logprobs.entries(host[self._prompt_at:self._pooled_at]))
        pooled = None if self._pooled is None else self._pooled.read(host[self._pooled_at:])
        if not self.requests:
            return ModelRunnerOutput({}, None, prompt_logprobs, pooled)
        ids = host[0].tolist()
        sampled: dict[str, int] = {}
        accepted: dict[str, list[int]] = {}
        row = 0
        for request, drafts, slot in self._chunks:
            targets = ids[row:row + len(drafts) + 1]
            row += len(targets)
            num_accepted = _accepted(drafts, targets)
            sampled[request.request_id] = token_id = targets[num_accepted]
            if drafts:
                accepted[request.request_id] = list(drafts[:num_accepted])
                if self._record:
                    request.output_token_ids.extend([*drafts[:num_accepted], token_id])
            elif slot is not None:
                request.output_token_ids[slot] = token_id
        logprobs = None
        if self._logprobs is not None:
            rows = self._logprobs.entries(ids, host[self._logprobs_at:self._prompt_at])
            logprobs = {r.request_id: lp for r, lp in zip(self.requests, rows) if lp is not None}
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, pooled, accepted or None)


def _placeholder(request: RunnerRequest) -> int:
    """Appends a PENDING token to ``request``'s output; returns its index."""
    request.output_token_ids.append(PENDING)
    return len(request.output_token_ids) - 1


def _accepted(drafts: tuple[int, ...], targets: list[int]) -> int:
    """How many leading guesses equal the target's token at the row before each (greedy)."""
    count = 0
    while count < len(drafts) and drafts[count] == targets[count]:
        count += 1
    return count


@dataclass(frozen=True)
class PendingInputs:
    """Rows of a new batch whose token is still pending on the device: as input ids
    (``apply``), or for the penalties' counts of the sampled rows (``ids``)."""

    rows: torch.Tensor  # [P] rows of the new batch
    sources: list[tuple[torch.Tensor, torch.Tensor]]  # (earlier step's sampled ids, [P_i] rows of it)

    def ids(self) -> torch.Tensor:
        """[P] the pending ids, in ``rows`` order, gathered on the device."""
        return torch.cat([ids[index] for ids, index in self.sources])

    def apply(self, input_ids: torch.Tensor) -> None:
        """Writes the pending ids into ``input_ids`` on the device (after the build's copy)."""
        input_ids[self.rows] = self.ids()


@dataclass(frozen=True)
class PendingPrefix:
    """The steady decode's case of ``PendingInputs``: the new batch's first ``count`` rows take
    the earlier step's first ``count`` sampled ids, row for row (the same requests in the same
    order). One device copy, and no index tensors to upload: on a GPU the general form costs
    two uploads, a gather, a concatenation and a scatter on the host's clock every step."""

    ids: torch.Tensor  # the earlier step's sampled ids
    count: int

    def apply(self, input_ids: torch.Tensor) -> None:
        input_ids[:self.count].copy_(self.ids[:self.count])


def pending_inputs(step: RunnerStep, launched: Iterable[LaunchedStep], device: torch.device,
                   rows_per_chunk: int = 0) -> Optional[PendingInputs | PendingPrefix]:
    """The rows of ``step`` whose input is a pending token of an unfinished launched step, or
    None (the serial loop: every token is known when a step is built). ``rows_per_chunk``: the
    batch's fixed rows per chunk (a FULL verify batch, ``Decision.rows_per_chunk``), else 0."""
    unfinished = _unfinished(launched)
    if not unfinished:
        return None  # nothing is pending: no walk over the step's rows
    wanted: dict[str, int] = {}  # request id -> row of the new batch
    offset = 0
    for chunk in step.chunks:
        out = chunk.request.output_token_ids
        if out and out[-1] == PENDING:
            position = chunk.request.num_tokens - 1
            if not chunk.start_position <= position < chunk.start_position + chunk.num_new_tokens:
                raise RuntimeError(f"request {chunk.request.request_id}: its pending token (position {position}) "
                                   f"is outside its chunk ({chunk.start_position}+{chunk.num_new_tokens})")
            wanted[chunk.request.request_id] = offset + position - chunk.start_position
        offset += rows_per_chunk or chunk.num_new_tokens
    if not wanted:
        return None
    found = _found(wanted, unfinished)
    if wanted:
        raise RuntimeError(f"pending tokens of {sorted(wanted)} belong to no step in flight")
    if len(found) == 1 and all(a == b == i for i, (a, b) in enumerate(found[0][1])):
        return PendingPrefix(found[0][0].token_ids, len(found[0][1]))
    return _pending(found, device)


def pending_tokens(requests: list[RunnerRequest], launched: Iterable[LaunchedStep],
                   device: torch.device) -> Optional[PendingInputs]:
    """For each token of ``requests`` (the sampled rows of a new batch) still pending in an
    unfinished launched step: its row, and its id in that step's sampled tensor. None when
    nothing is pending (the serial loop)."""
    unfinished = _unfinished(launched)
    if not unfinished:
        return None
    found = _found({r.request_id: i for i, r in enumerate(requests)}, unfinished, once=False)
    return _pending(found, device) if found else None


def _unfinished(launched: Iterable[LaunchedStep]) -> list[LaunchedStep]:
    return [earlier for earlier in launched if not earlier.finished and earlier.token_ids is not None]


def _found(wanted: dict[str, int], unfinished: list[LaunchedStep],
           once: bool = True) -> list[tuple[LaunchedStep, list[tuple[int, int]]]]:
    """Per unfinished step holding some of ``wanted`` (request id -> row of the new batch): its
    (row of the step, row of the new batch) pairs. ``once``: a request is taken from the first
    step that holds it and popped from ``wanted`` (an input row takes one id); else from every
    step that holds it (penalties count every pending token)."""
    found = []
    for earlier in unfinished:
        pairs = [(row, wanted.pop(rid) if once else wanted[rid]) for rid, row in earlier.row_of().items()
                 if rid in wanted]
        if pairs:
            found.append((earlier, pairs))
    return found


def _pending(found: list[tuple[LaunchedStep, list[tuple[int, int]]]], device: torch.device) -> PendingInputs:
    # Copied without waiting for the step in flight (device_tensor): ``torch.tensor(..., device=)``
    # waited for it, 0.43 ms of each 1.37 ms batch-1 step of the 0.5B model on an H200.
    sources = [(earlier.token_ids, device_tensor([a for a, _ in pairs], torch.int64, device))
               for earlier, pairs in found]
    rows = [b for _, pairs in found for _, b in pairs]
    return PendingInputs(device_tensor(rows, torch.int64, device), sources)
