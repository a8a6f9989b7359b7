"""What the engine tells its tensor-parallel workers each step, and the workers' copy of the
requests it describes.

The scheduler runs once, in the engine, over the engine's ``Request`` objects. Every worker runs
the same step (batch building, forward, sampler) and so needs the same view of each scheduled
request, but sending whole requests every step would resend every prompt and block table. So
each worker keeps a mirror: a request's fixed parts (prompt, sampling parameters, ...) are sent
once, when it is first scheduled; each step then sends only what changed (the tokens the engine
appended since, the block ids past the common prefix, where this chunk starts), and finished
requests are dropped. What only the engine has stays there: grammar matchers (the engine fills
the step's allowed-token masks and sends them) and detokenizers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..core.request import Request
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from ..sampling_params import SamplingParams
from ..structured.bitmask import GrammarMasks, fill_masks
from ..core.outputs import PoolingState


@dataclass(frozen=True)
class NewRequest:
    """A request's fixed parts, sent the first time a worker sees it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    num_prompt_logprobs: Optional[int]
    pooling: Optional[tuple[str, bool]]  # (pooling type, normalize) of a pooling request


@dataclass(frozen=True)
class ScheduledDelta:
    """One scheduled chunk, and what changed in its request since the worker last saw it."""

    request_id: str
    num_new_tokens: int
    start_position: int
    produces_token: bool
    new_output_tokens: list[int]
    blocks_from: int  # the mirror keeps block_ids[:blocks_from] and appends new_blocks
    new_blocks: list[int]
    num_prompt_logprobs_done: int


@dataclass(frozen=True)
class StepMessage:
    forget: list[str]  # finished requests, dropped before the new ones are added
    new: list[NewRequest]
    scheduled: list[ScheduledDelta]
    masks: Optional[GrammarMasks]  # structured outputs' masks of the sampled rows, in batch order


@dataclass
class _Sent:
    request: Request
    num_output_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)


class StepEncoder:
    """Engine side: turns each ``SchedulerOutput`` into a ``StepMessage``, remembering what the
    workers were sent."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._sent: dict[str, _Sent] = {}

    def encode(self, sched: SchedulerOutput) -> StepMessage:
        forget = [rid for rid, sent in self._sent.items() if sent.request.status.finished]
        for rid in forget:
            del self._sent[rid]
        new: list[NewRequest] = []
        scheduled = [self._delta(item, new, forget) for item in sched.scheduled]
        grammars = [item.request.grammar for item in sched.scheduled if item.produces_token]
        return StepMessage(forget, new, scheduled, fill_masks(grammars, self.vocab_size))

    def _delta(self, item: ScheduledRequest, new: list[NewRequest], forget: list[str]) -> ScheduledDelta:
        req = item.request
        sent = self._sent.get(req.request_id)
        if sent is None or sent.request is not req:  # first sight (or an id reused by a new request)
            if sent is not None:
                forget.append(req.request_id)
            pooling = None if req.pooling is None else (req.pooling.pooling_type, req.pooling.normalize)
            new.append(NewRequest(req.request_id, list(req.prompt_token_ids), req.sampling_params,
                                  req.eos_token_ids, req.num_prompt_logprobs, pooling))
            sent = self._sent[req.request_id] = _Sent(req)
        keep = len(sent.block_ids)
        if req.block_ids[:keep] != sent.block_ids:  # preempted and readmitted: new blocks
            keep = 0
        delta = ScheduledDelta(req.request_id, item.num_new_tokens, item.start_position, item.produces_token,
                               req.output_token_ids[sent.num_output_tokens:], keep, req.block_ids[keep:],
                               len(req.prompt_logprobs))
        sent.num_output_tokens, sent.block_ids = len(req.output_token_ids), list(req.block_ids)
        return delta


class RequestMirror:
    """Worker side: the requests the engine described, rebuilt into the ``SchedulerOutput`` the
    runner executes."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        for rid in msg.forget:
            self.requests.pop(rid, None)
        for n in msg.new:
            pooling = None if n.pooling is None else PoolingState(*n.pooling)
            self.requests[n.request_id] = Request(n.request_id, list(n.prompt_token_ids), n.sampling_params,
                                                  eos_token_ids=n.eos_token_ids,
                                                  num_prompt_logprobs=n.num_prompt_logprobs, pooling=pooling)
        out = SchedulerOutput()
        for d in msg.scheduled:
            out.scheduled.append(self._advance(d))
        return out

    def _advance(self, d: ScheduledDelta) -> ScheduledRequest:
        req = self.requests[d.request_id]
        req.output_token_ids.extend(d.new_output_tokens)
        del req.block_ids[d.blocks_from:]
        req.block_ids.extend(d.new_blocks)
        req.num_computed_tokens = d.start_position
        if req.num_prompt_logprobs is not None:
            req.prompt_logprobs = [None] * d.num_prompt_logprobs_done
        item = ScheduledRequest(req, d.num_new_tokens)
        if item.produces_token != d.produces_token:
            raise RuntimeError(f"request {d.request_id}: the worker's copy is out of step with the engine's "
                               f"({req.num_tokens} tokens, chunk {d.start_position}+{d.num_new_tokens})")
        return item
