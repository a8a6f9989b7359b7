"""Continuous batching: which tokens of which requests run in the next forward pass.

Each step has a token budget (``max_num_batched_tokens``) and a seat limit (``max_num_seqs``).
Running requests go first, in admission order: a decode costs one token, a request still in
chunked prefill takes what is left of its prompt up to the remaining budget. Waiting requests
are admitted FIFO with whatever budget and seats remain, starting from their cached prefix and
splitting long prompts into chunks. Decodes and prefill chunks share one mixed batch.

With LoRA, the running requests use at most ``max_loras`` different adapters (the model's
slots): a waiting request whose adapter would be one too many waits, and those behind it that
fit are admitted past it (in their order).

Overlapped scheduling: ``schedule`` advances ``num_computed_tokens`` at once, so the engine
may schedule step N+1 before step N's tokens are known. A token scheduled but not yet sampled is
*pending*: with ``schedule_ahead`` a running request's next decode is scheduled anyway (the
runner feeds it the token it sampled itself); without it (pipeline stages, whose first stage
never samples), or for a request whose next step needs that token on the host (a grammar's
mask), the request waits for ``update``. Results of a request preempted or finished meanwhile
are handled as if ``update`` had come first, so the tokens equal the serial loop's.

When a running request cannot get a block, the newest running request is preempted by
recompute: its blocks are freed and it returns to the front of the waiting queue, to re-run its
prompt and the tokens it already generated as a prefill. Newest-first keeps the oldest
requests (closest to finishing, longest waited) making progress.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from ..config import CacheConfig, SchedulerConfig
from .block_pool import BlockPool
from .kv_cache_manager import KVCacheManager
from .outputs import ModelRunnerOutput, PooledChunk, PromptLogprobs
from .request import Request, RequestStatus
from .step_plan import StepPlan, StepPlanner
from ..spec.proposer import ProposalRequest, Proposer
from ..spec.stats import SpecDecodeStats, speculates



@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens from ``start_position`` on.

    The tokens are ``request.all_token_ids[start_position:start_position + num_new_tokens]`` at
    positions ``start_position..`` (the last one may still be pending: the runner has it);
    ``start_position`` is ``request.num_computed_tokens`` when scheduled.
    """

    request: Request
    num_new_tokens: int  # the guessed tokens included
    # Speculative decoding: tokens guessed to follow the request's last one, run after it in
    # this chunk so the step verifies them (spec/); their KV counts only where accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    start_position: int = field(init=False)
    # Whether this chunk reaches the last known token, so the runner samples the next one
    # (never for a prefill-only request). Fixed at scheduling time: it must not change when
    # update() advances the request.
    produces_token: bool = field(init=False)

    def __post_init__(self) -> None:
        request = self.request
        self.start_position = request.num_computed_tokens
        self.produces_token = (self.start_position + self.num_new_tokens - len(self.draft_token_ids)
                               == request.num_tokens + request.num_pending_tokens and not request.prefill_only)

    @property
    def end_position(self) -> int:
        """Tokens whose K/V the cache holds once this chunk has run."""
        return self.start_position + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """What one forward pass computes, in batch order: the scheduler's own record (live
    requests, read back by ``update``) and ``plan``, the plain data the runner executes."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted while building this step (now at the front of the waiting queue).
    preempted: list[Request] = field(default_factory=list)
    # Requests admitted from the waiting queue in this step (first admissions and re-admissions).
    admitted: list[Request] = field(default_factory=list)
    plan: StepPlan = field(default_factory=StepPlan)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def samples(self) -> list[ScheduledRequest]:
        """The scheduled requests that produce a token this step, in batch order."""
        return [s for s in self.scheduled if s.produces_token]


class Scheduler:
    """Decides each step's batch and folds the sampled tokens back into the requests."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, max_model_len: int, max_loras: Optional[int] = None,
                 schedule_ahead: bool = False, microbatches: int = 1,
                 proposer: Optional[Proposer] = None) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        pool = BlockPool(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(pool, max_model_len)
        # A request alone must always fit in the pool, or preemption could never make room:
        # generation stops at the pool's capacity as it does at max_model_len.
        self.max_seq_len = min(max_model_len, num_blocks * cache_config.block_size)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.planner = StepPlanner()  # what the runner has been told, for each step's plan
        self.max_loras = max_loras  # different adapters the running requests may use (None: no LoRA)
        # A decode whose input token is still pending may be scheduled (the runner feeds it).
        self.schedule_ahead = schedule_ahead
        # Pipeline stages: each step takes at most 1/microbatches of the requests, so the steps in
        # flight (one per stage) share them instead of one step taking all and the others none.
        self.microbatches = microbatches
        # Speculative decoding: the proposer the engine built from the config (spec/proposers.py).
        self.proposer = proposer
        self.spec_stats = SpecDecodeStats(0 if proposer is None else proposer.k)

    # -- queue management -------------------------------------------------------------------

    @property
    def block_pool(self) -> BlockPool:
        return self.kv_cache_manager.pool

    @property
    def kv_manager(self) -> KVCacheManager:
        """Short name for ``kv_cache_manager`` (the engine's stats read the pool through it)."""
        return self.kv_cache_manager

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        """Queues a new request; raises ValueError for one that could never be served."""
        self._validate(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Aborts requests in any state, freeing their blocks; unknown or finished ids are ignored."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str] | str, status: RequestStatus) -> None:
        """Ends requests for reasons found outside the scheduler (stop strings, client gone)."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        finished = [self.requests[i] for i in dict.fromkeys(ids) if i in self.requests]
        if not finished:
            return
        for request in finished:
            request.status = status
            self._release(request)
        self.running = [r for r in self.running if not r.status.finished]
        if any(r.status.finished for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.status.finished)

    # -- scheduling -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Builds the next batch and advances each scheduled request past it (its sampled
        token, if any, pending until ``update``)."""
        output = SchedulerOutput()
        seats = -(-(len(self.running) + len(self.waiting)) // self.microbatches)  # requests this step may take
        budget = self._schedule_running(output, self.config.max_num_batched_tokens, seats)
        if not output.preempted:
            self._schedule_waiting(output, budget, seats)
        plan = self.planner.plan(output.scheduled)
        for item in output.scheduled:
            item.request.num_computed_tokens = item.end_position
            item.request.num_pending_tokens += item.produces_token
        return replace(output, plan=plan)

    def _schedule_running(self, output: SchedulerOutput, budget: int, seats: int) -> int:
        """Schedules running requests in order, preempting the newest when blocks run out."""
        index = 0
        guesses = self._proposals(budget, seats)
        running, scheduled = self.running, output.scheduled  # preemption pops from running in place
        while index < len(running) and budget > 0 and len(scheduled) < seats:
            request = running[index]
            num_new = self._capped(min(self._num_schedulable(request), budget))
            drafts = guesses.get(request.request_id, [])[:budget - 1] if guesses and num_new == 1 else []
            num_new += len(drafts)
            if num_new > 0:
                if not self._allocate_or_preempt(request, num_new, output):
                    break
                scheduled.append(ScheduledRequest(request, num_new, drafts))
                budget -= num_new
            index += 1
        return budget

    def _proposals(self, budget: int, seats: int) -> dict[str, list[int]]:
        """Guesses for the running requests that decode one token this step and may speculate,
        asked of the proposer in one batch (a draft model runs them together). Only as many
        requests as the step can seat are asked; the loop trims guesses the budget cannot take."""
        proposer = self.proposer
        if proposer is None:
            return {}
        # Enqueued requests count, waiting ones too (vLLM's rule): while a large batch is still
        # being admitted, its first requests would otherwise speculate, the draft prefilling their
        # prompts, only to stop a few steps later.
        limit = proposer.config.disable_by_batch_size
        if limit is not None and len(self.running) + len(self.waiting) > limit:
            return {}
        batch = []
        for request in self.running[:min(seats, budget)]:
            if self._num_schedulable(request) == 1 and speculates(request):
                room = self._room(request)
                if room > 0:
                    batch.append(ProposalRequest(request.request_id, request.all_token_ids, room))
        if not batch:
            return {}
        return {asked.request_id: guess for asked, guess in zip(batch, proposer.propose(batch)) if guess}

    def _room(self, request: Request) -> int:
        """Guesses that fit after a decode's token: the step adds one of its own, and neither
        the context nor ``max_tokens`` may be passed."""
        room = self.max_seq_len - request.num_tokens - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(request.output_token_ids) - 1)
        return room

    def _num_schedulable(self, request: Request) -> int:
        """Tokens of ``request`` that may run now: none while its pending token is needed on
        the host first, or would be one past its last (it ends when that token arrives)."""
        pending = request.num_pending_tokens
        if pending and not (self.schedule_ahead and request.grammar is None
                            and (self.proposer is None or not speculates(request))):
            return 0
        num_tokens = request.num_tokens + pending
        max_tokens = request.sampling_params.max_tokens
        if pending and (num_tokens >= self.max_seq_len or (
                max_tokens is not None and len(request.output_token_ids) + pending >= max_tokens)):
            return 0
        return num_tokens - request.num_computed_tokens

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Preempts from the back of ``running`` until ``request`` fits; False if it went itself.

        Requests before ``request`` in the running list are already scheduled this step and
        the victim is always the last one, so no scheduled request is ever taken back.
        """
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, seats: int) -> None:
        """Admits waiting requests FIFO while budget, seats and blocks last (past those whose
        adapter does not fit the slots, which keep their place)."""
        passed: list[Request] = []
        # The running requests' adapters, when LoRA bounds them (no walk over running otherwise).
        adapters = set() if self.max_loras is None else {r.lora_id for r in self.running if r.lora_id is not None}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and len(output.scheduled) < seats:
            request = self.waiting[0]
            if request.num_pending_tokens:  # preempted while a step ran: back once its token is known
                break
            if not self._adapter_fits(request, adapters):
                passed.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = ([], 0) if request.skips_prefix_cache else \
                self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self._may_chunk(num_new):
                    break
                num_new = budget
            num_new = self._capped(num_new)
            if not self.kv_cache_manager.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            self._admit(request, num_hit_tokens)
            output.scheduled.append(ScheduledRequest(request, num_new))
            output.admitted.append(request)
            budget -= num_new
            if request.lora_id is not None:
                adapters.add(request.lora_id)
        self.waiting.extendleft(reversed(passed))

    def _adapter_fits(self, request: Request, adapters: set[int]) -> bool:
        """Whether ``request`` may join running requests that use ``adapters``."""
        lora_id = request.lora_id
        return (lora_id is None or self.max_loras is None or lora_id in adapters
                or len(adapters) < self.max_loras)

    def _capped(self, num_new: int) -> int:
        """A prompt chunk cut to ``long_prefill_token_threshold`` (vLLM's option) with chunked
        prefill on: a step that also carries running streams' decodes then costs a few decode
        steps at most, not a long prefill's worth."""
        cap = self.config.long_prefill_token_threshold
        if cap and num_new > cap and self.config.enable_chunked_prefill:
            return cap
        return num_new

    def _may_chunk(self, num_new: int) -> bool:
        """Without chunked prefill a prompt runs whole; a preempted request whose prompt plus
        output outgrew the whole budget is still chunked, or it could never run again."""
        return self.config.enable_chunked_prefill or num_new > self.config.max_num_batched_tokens

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        """Moves the head of the queue to running, past its cached prefix.

        ``num_cached_prefix_tokens`` (reported as cached prompt tokens) is set on the first
        admission only (never preempted yet); a re-admission after preemption may hit its own
        generated tokens.
        """
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        if request.num_preemptions == 0:
            request.num_cached_prefix_tokens = num_hit_tokens
        self.running.append(request)

    # -- results ----------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Applies a step's results; returns the requests that got a token (finished included)
        and the prefill-only requests that finished their prompt (status "length").

        Requests finished (or aborted) since ``schedule`` are skipped: their blocks are gone
        and their tokens are no longer wanted. A request preempted since (a later step was
        scheduled first) still takes its results, as it would have before that step.
        """
        new_token_requests: list[Request] = []
        any_finished = False
        prompt_results = result.prompt_logprobs is not None or result.pooled is not None
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.status.finished:
                continue
            if prompt_results:
                self._apply_prompt_results(request, result.prompt_logprobs, result.pooled)
            end = scheduled.end_position
            stopped = False
            if scheduled.produces_token:
                request.num_pending_tokens -= 1
                stopped = self._append_tokens(request, scheduled, result)
                new_token_requests.append(request)
                accepted = request.num_step_tokens - 1  # guesses kept (the step's own token follows them)
                end -= len(scheduled.draft_token_ids) - accepted  # the rejected guesses' KV is not the cache's
            if request.status is not RequestStatus.PREEMPTED:  # running, or finished by this step
                if scheduled.draft_token_ids:  # never scheduled ahead: nothing ran past this chunk
                    request.num_computed_tokens = end
                self.kv_cache_manager.cache_blocks(request, end)
            if stopped:
                self._release(request)
                any_finished = True
            elif request.prefill_only and scheduled.end_position >= request.num_prompt_tokens:
                request.status = RequestStatus.FINISHED_LENGTH
                new_token_requests.append(request)
                self._release(request)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.status.finished]
            if any(r.status.finished for r in self.waiting):
                self.waiting = deque(r for r in self.waiting if not r.status.finished)
        return new_token_requests

    @staticmethod
    def _apply_prompt_results(request: Request, prompt_logprobs: Optional[dict[str, PromptLogprobs]],
                              pooled: Optional[dict[str, PooledChunk]]) -> None:
        """Folds a chunk's prompt logprobs and pooled share into the request."""
        if prompt_logprobs is not None and request.request_id in prompt_logprobs:
            result = prompt_logprobs[request.request_id]
            request.add_prompt_logprobs(result.first, result.entries)
        if pooled is not None and request.pooling is not None and request.request_id in pooled:
            request.pooling.add(pooled[request.request_id])

    def _append_tokens(self, request: Request, scheduled: ScheduledRequest, result: ModelRunnerOutput) -> bool:
        """Appends the step's tokens (the accepted guesses, then the sampled one), stopping at
        the first that ends the request; returns whether one did. ``num_step_tokens`` counts
        what was appended."""
        rid = request.request_id
        if not scheduled.draft_token_ids:  # one token: the common case
            self._append_token(request, result.sampled[rid], result.logprobs)
            request.num_step_tokens = 1
            return self._check_stop(request)
        accepted = result.accepted_drafts.get(rid, []) if result.accepted_drafts else []
        self.spec_stats.record(len(scheduled.draft_token_ids), len(accepted))
        request.num_step_tokens = 0
        for token_id in (*accepted, result.sampled[rid]):
            self._append_token(request, token_id, result.logprobs)
            request.num_step_tokens += 1
            if self._check_stop(request):
                return True
        return False

    @staticmethod
    def _append_token(request: Request, token_id: int,
                      logprobs: Optional[dict[str, dict[int, float]]]) -> None:
        request.output_token_ids.append(token_id)
        if logprobs is not None and request.request_id in logprobs:
            request.logprobs.append(logprobs[request.request_id])
        if request.grammar is not None:
            request.grammar.advance(request.output_token_ids)

    def _check_stop(self, request: Request) -> bool:
        """Sets a finished status after a new token; length caps win, as in vLLM.

        EOS and stop token ids do not end a request before ``min_tokens`` tokens.
        """
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if request.num_tokens >= self.max_seq_len or (
                params.max_tokens is not None and num_output >= params.max_tokens):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        if num_output < params.min_tokens:
            return False
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        return self._check_grammar(request)

    @staticmethod
    def _check_grammar(request: Request) -> bool:
        """A grammar closed by EOS ends the request (even with ``ignore_eos``); one whose matcher
        failed (a token it rejected: a bug, logged by the matcher) ends it as aborted."""
        grammar = request.grammar
        if grammar is None:
            return False
        if grammar.error is not None:
            request.status = RequestStatus.FINISHED_ABORTED
            return True
        if grammar.ended:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        return False

    def _release(self, request: Request) -> None:
        """Frees a finished request's blocks and forgets it (the queues are pruned by callers)."""
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.planner.forget(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)

    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("the prompt must contain at least one token")
        # A prefill-only request (pooling, max_tokens=0) may fill the context; others need a slot.
        if num_prompt >= self.max_model_len + request.prefill_only:
            raise ValueError(f"the prompt has {num_prompt} tokens, which leaves no room to generate "
                             f"within max_model_len={self.max_model_len}")
        capacity = self.block_pool.num_blocks * self.block_size
        if num_prompt >= capacity + request.prefill_only:
            raise ValueError(f"the prompt has {num_prompt} tokens but the KV cache holds only "
                             f"{capacity} tokens ({self.block_pool.num_blocks} blocks of {self.block_size})")
        if not self.config.enable_chunked_prefill and num_prompt > self.config.max_num_batched_tokens:
            raise ValueError(f"the prompt has {num_prompt} tokens, more than max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens}, and chunked prefill is disabled")
