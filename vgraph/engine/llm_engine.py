"""``LLMEngine``: requests in, one scheduler step + one model step at a time, outputs out."""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch

from ..config import EngineConfig
from ..core.request import Request, RequestStatus
from ..core.scheduler import Scheduler, SchedulerOutput
from ..models.demo import demo_model_path
from ..models.loader import load_generation_config, load_hf_config, load_tokenizer, resolve_model_path
from ..models.quantization import resolve_quantization
from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from ..core.outputs import PoolingState
from ..structured.compiler import GrammarCompiler
from ..structured.bitmask import fill_masks
from ..structured.matcher import GrammarState
from ..distributed.executors import make_executor
from ..lora.request import LoRARequest
from ..spec.proposers import build_proposer
from ..worker.startup import engine_timeline, process_age
from .inputs import PREFILL_ONLY, InputError, PromptType, check_prompt, prompt_to_ids
from .outputs import OutputDelta, SequenceDelta
from .stats import EngineStep, EngineStats, RequestTiming

logger = logging.getLogger("vgraph")


@dataclass(slots=True)
class _Group:
    """One user request: ``n`` sequences sharing a prompt, and the request's times.

    The times (``time.monotonic()``) live here and nowhere else: ``LLMEngine.step`` stamps
    them where the work happens and derives each step's ``RequestTiming`` from them.
    """

    request_id: str
    num_prompt_tokens: int
    arrival: float
    sequences: list[Request] = field(default_factory=list)
    first_scheduled: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        sequences = self.sequences
        if len(sequences) == 1:  # most requests: no generator
            return sequences[0].status.finished
        return all(r.status.finished for r in sequences)

    @property
    def finish_reasons(self) -> list[str]:
        """One per sequence; "abort" for a sequence not finished by itself (it is being aborted)."""
        return [r.finish_reason or "abort" for r in self.sequences]


class LLMEngine:
    """Resolves the configuration once, starts a runner and a scheduler over its KV cache,
    and steps them. ``self.config`` is the resolved copy; the caller's object is left as given.

    Each step returns token deltas (``OutputDelta``); text is the caller's, through the one
    ``OutputProcessor``, which also finds stop strings and reports them back with
    ``finish_sequences``. Every caller works so: ``LLM``, and the server's ``EngineClient``
    whether this engine runs on its thread or in the engine-core process."""

    def __init__(self, config: EngineConfig) -> None:
        start, before_engine = time.perf_counter(), process_age()
        path = demo_model_path(config.model.model) or resolve_model_path(config.model.model, config.model.revision)
        hf_config = load_hf_config(path)
        self.config = config.resolved(
            model_path=path, max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 2048)),
            quantized=resolve_quantization(config.model.quantization, hf_config) is not None)
        # Before the runner's minutes of compiling and capturing: a bad tokenizer fails at once.
        self.tokenizer = load_tokenizer(self.config.model.tokenizer or path)
        self.eos_token_ids = frozenset(load_generation_config(path))
        torch.manual_seed(self.config.model.seed)
        config_and_tokenizer = time.perf_counter() - start
        self.runner = _start_runner(self.config, hf_config)
        # The limit requests are checked against: the configured one, or the KV cache's
        # capacity when that is smaller (the runner warns). /v1/models reports this one.
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        # Structured outputs: grammars over the model's vocabulary (lm_head rows), compiled on
        # first use and cached; thread-safe, so the server validates requests with it too.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                sorted(self.eos_token_ids))
        lora = self.config.lora
        overlap = self.config.scheduler.async_scheduling
        stages = self.config.parallel.pipeline_parallel_size
        # Pipeline stages: a first stage never samples, so a request waits for its token (no
        # schedule-ahead) and the P steps in flight hold disjoint decodes, one per stage.
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, self.runner.num_blocks,
                                   self.max_model_len, lora.max_loras if lora.enable_lora else None,
                                   schedule_ahead=overlap and stages == 1, microbatches=stages,
                                   proposer=build_proposer(self.config, self.tokenizer, self.vocab_size,
                                                           self.runner.num_blocks))
        if self.config.speculative_config is not None:
            logger.info("speculative decoding: %s", self.config.speculative_config.describe())
        # Steps submitted to the runner and not yet collected, with the groups each scheduled
        # first; overlapped scheduling keeps one more in flight than the serial loop, pipeline
        # parallelism one per stage.
        self._in_flight: deque[tuple[SchedulerOutput, set[str]]] = deque()
        self._max_in_flight = stages if stages > 1 else (2 if overlap else 1)
        self._groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, tuple[str, int]] = {}  # sequence id -> (request id, its index)
        ready = time.perf_counter() - start
        after_start = before_engine + ready if before_engine is not None else None
        logger.info("startup: %s", engine_timeline(before_engine, config_and_tokenizer, self.runner.startup,
                                                   after_start))
        logger.info("engine ready in %.2f s; %s", ready,
                    "overlapped scheduling: step N+1 is scheduled and launched before step N's tokens are read"
                    if overlap else "serial step loop (--async-scheduling overlaps it)")

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    arrival_time: Optional[float] = None, lora_request: Optional[LoRARequest] = None) -> None:
        """Validates everything first: a bad request raises ValueError and touches nothing.

        ``arrival_time`` (``time.monotonic()``, default now) is when the request was submitted:
        a server passes the time it took the request, so queue time and latencies include the
        wait before the engine saw it. ``lora_request``: the adapter it runs with (read and
        checked here, so a bad adapter is this request's error, never a failed step).
        """
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            self.add_lora(lora_request)
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt, params, arrival, lora_request)
            return
        params.validate(self.config.max_logprobs)
        _, ids = prompt_to_ids(prompt, self.tokenizer)
        params = check_prompt(ids, params, self.vocab_size, self.max_model_len)
        spec = params.structured_outputs
        grammar = None if spec is None else self.grammar_compiler.compile(spec)
        group = _Group(request_id, len(ids), arrival)
        for i in range(params.n):
            child_params = params if params.seed is None else replace(params, seed=params.seed + i)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            state = None if grammar is None else GrammarState(grammar.matcher(), self.eos_token_ids)
            # The prompt's logprobs are the same for every sequence: the first computes them.
            group.sequences.append(Request(seq_id, ids, child_params, eos_token_ids=self.eos_token_ids, grammar=state,
                                           num_prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                                           lora_request=lora_request))
        self._admit_group(group)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Reads and checks an adapter into the host cache ahead of its requests; a bad one
        raises ``InputError`` (a ValueError naming the adapter's file and field; its ``param``
        is ``model``, the field a served request names an adapter with)."""
        if not self.config.lora.enable_lora:
            raise InputError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled "
                             "(enable_lora=True, --enable-lora)", "model")
        try:
            self.runner.add_lora(lora_request)
        except ValueError as exc:
            raise InputError(f"LoRA adapter {lora_request.lora_name!r}: {exc}", "model") from exc

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter (its slot and host copy) unless an unfinished request still runs
        with it: that request keeps its copy, so no step ever rereads a folder that may be gone
        (the copy leaves the host cache by LRU like any other). False if nothing was removed."""
        if any(r.lora_id == lora_int_id for r in self.scheduler.requests.values()):
            return False
        return self.runner.remove_lora(lora_int_id)

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                             arrival: float, lora_request: Optional[LoRARequest] = None) -> None:
        """A prefill-only request whose final hidden states are pooled into an embedding."""
        _, ids = prompt_to_ids(prompt, self.tokenizer)
        check_prompt(ids, PREFILL_ONLY, self.vocab_size, self.max_model_len)
        model = self.config.model
        pooling = PoolingState(params.pooling_type or model.pooling_type,
                               model.pooling_normalize if params.normalize is None else params.normalize)
        group = _Group(request_id, len(ids), arrival)
        group.sequences.append(Request(request_id, ids, PREFILL_ONLY, pooling=pooling, lora_request=lora_request))
        self._admit_group(group)

    def _admit_group(self, group: _Group) -> None:
        for index, req in enumerate(group.sequences):
            self.scheduler.add_request(req)
            self._seq_to_group[req.request_id] = (group.request_id, index)
        self._groups[group.request_id] = group

    def abort_request(self, request_ids: str | list[str]) -> list[RequestTiming]:
        """Aborts unfinished requests in any state; unknown or finished ids are ignored.

        Returns one timing per aborted request, finish reason "abort" for each of its
        sequences, so that the caller's metrics count aborts like any other finish.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(dict.fromkeys(request_ids))
        groups = [self._groups[rid] for rid in ids if rid in self._groups]
        # A sequence of an n > 1 request that already stopped keeps its own reason.
        reasons = [g.finish_reasons for g in groups]
        self.scheduler.abort_requests([r.request_id for g in groups for r in g.sequences])
        for group in groups:
            self._forget(group.request_id)
        return [RequestTiming(g.request_id, g.num_prompt_tokens, finish_reasons=r)
                for g, r in zip(groups, reasons)]

    def abort_all(self) -> list[RequestTiming]:
        """Aborts every unfinished request (a server shutting down)."""
        return self.abort_request(list(self._groups))

    def finish_sequences(self, items: Sequence[tuple[str, int, Optional[str]]]) -> list[RequestTiming]:
        """Ends sequences for reasons found by the caller's ``OutputProcessor`` (it detokenizes):
        ``(request id, sequence index, stop string)``, a stop string meaning finish reason
        "stop" (it is the stop reason), None meaning "abort" (its text could not be decoded).

        Unknown or finished sequences are ignored. Returns one timing per request this
        finishes (its last sequence ended), as ``step`` would have reported it.
        """
        now, finished = time.monotonic(), []
        for request_id, index, stop in items:
            group = self._groups.get(request_id)
            if group is None or not 0 <= index < len(group.sequences):
                continue
            req = group.sequences[index]
            if not req.status.finished:
                req.stop_reason = stop
                status = RequestStatus.FINISHED_ABORTED if stop is None else RequestStatus.FINISHED_STOPPED
                self.scheduler.finish_requests([req.request_id], status)
            if group.finished:
                finished.append(RequestTiming(group.request_id, group.num_prompt_tokens,
                                              e2e_latency=now - group.arrival, finish_reasons=group.finish_reasons))
                self._forget(group.request_id)
        return finished

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a step in flight whose result is still to be collected."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def _forget(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        for req in group.sequences if group else []:
            self._seq_to_group.pop(req.request_id, None)

    # ------------------------------------------------------------------ the step

    def step(self) -> EngineStep:
        """Schedules, runs the model once, and returns what each request that advanced gained
        (``OutputDelta``s), the timings of requests something happened to, and the engine's
        state after the step.

        Overlapped: the next step is scheduled and submitted before this one's tokens are
        read, so the runner computes it while this thread folds in the results."""
        self._submit_steps()
        if not self._in_flight:
            return EngineStep([], [], self.stats())
        sched, first_scheduled = self._in_flight.popleft()
        result = self.runner.collect()
        advanced = self.scheduler.update(sched, result)
        first_scheduled = {gid for gid in first_scheduled if gid in self._groups}  # not aborted since
        token_time = time.monotonic()
        deltas: dict[str, OutputDelta] = {}
        new_tokens: dict[str, int] = {}  # request id -> tokens this step, over its sequences
        seq_to_group, groups_by_id = self._seq_to_group, self._groups
        groups: list[_Group] = []  # those with a delta, in its order
        for req in advanced:
            group_id, index = seq_to_group[req.request_id]
            delta = deltas.get(group_id)
            if delta is None:  # the request's cached prompt tokens: its first sequence's, as reported before
                group = groups_by_id[group_id]
                groups.append(group)
                delta = deltas[group_id] = OutputDelta(group_id, [], group.sequences[0].num_cached_prefix_tokens)
                new_tokens[group_id] = self._add_to_delta(delta, index, req)
            else:
                new_tokens[group_id] += self._add_to_delta(delta, index, req)
        for group in groups:
            if not group.prompt_logprobs_sent and group.sequences[0].num_prompt_logprobs is not None:
                self._attach_prompt_logprobs(group, deltas[group.request_id])
        if first_scheduled:
            ids = dict.fromkeys([*first_scheduled, *new_tokens])
            timings = [self._timing(groups_by_id[gid], new_tokens.get(gid, 0), gid in first_scheduled, token_time,
                                    gid in new_tokens)
                       for gid in ids]
        else:  # a step of running requests only: each one here produced
            timings = [self._timing(group, new_tokens[group.request_id], False, token_time, True) for group in groups]
        for timing in timings:
            if timing.finish_reasons:
                self._forget(timing.request_id)
        return EngineStep(list(deltas.values()), timings, self.stats())

    def _submit_steps(self) -> None:
        """Schedules and submits steps until as many are in flight as the loop keeps."""
        while len(self._in_flight) < self._max_in_flight:
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                return
            first_scheduled = self._stamp_first_scheduled(sched, time.monotonic())
            # Structured outputs' masks of the sampled rows: the grammars live here, with the
            # scheduler (a constrained request waits for its previous token: its mask is exact).
            # One per sampled row: a verifying request has a row per guess, and no grammar.
            masks = fill_masks([s.request.grammar for s in sched.samples for _ in range(len(s.draft_token_ids) + 1)],
                               self.vocab_size)
            self.runner.submit(sched.plan, masks)
            self._in_flight.append((sched, first_scheduled))

    @staticmethod
    def _add_to_delta(delta: OutputDelta, index: int, req: Request) -> int:
        """Adds what ``req`` gained this step to its request's delta; returns its new tokens.
        A prefill-only sequence gains no token: its finish, or its embedding (pooling)."""
        outputs = req.output_token_ids
        if req.pooling is not None:
            delta.embedding = req.pooling.embedding()
            return 0
        if not outputs and req.prefill_only:
            delta.sequences.append(SequenceDelta(index, [], None, req.finish_reason, req.stop_reason))
            return 0
        logprobs = None
        if req.sampling_params.logprobs is not None and len(req.logprobs) == len(outputs):
            logprobs = [req.logprobs[-1]]
        count = req.num_step_tokens  # more than one when speculative guesses were accepted
        delta.sequences.append(SequenceDelta(index, outputs[-count:], logprobs, req.finish_reason, req.stop_reason))
        return count

    @staticmethod
    def _attach_prompt_logprobs(group: _Group, delta: OutputDelta) -> None:
        """The prompt's logprobs go out once, in the step that completed them."""
        first = group.sequences[0]
        if first.prompt_logprobs_done and not group.prompt_logprobs_sent:
            delta.prompt_logprobs = list(first.prompt_logprobs)
            group.prompt_logprobs_sent = True

    def _stamp_first_scheduled(self, sched: SchedulerOutput, now: float) -> set[str]:
        """Stamps and returns the requests scheduled for the first time in this step (only
        admissions can be: the running ones were scheduled before).

        Their queue time is reported in this step even when a chunked prefill produces no
        token yet; re-admissions after preemption are not first schedulings.
        """
        first: set[str] = set()
        for request in sched.admitted:
            group = self._groups[self._seq_to_group[request.request_id][0]]
            if group.first_scheduled is None:
                group.first_scheduled = now
                first.add(group.request_id)
        return first

    @staticmethod
    def _timing(group: _Group, num_new_tokens: int, first_scheduled: bool, now: float,
                produced: bool = False) -> RequestTiming:
        """Stamps the request's token times and says what it did in this step. A prefill-only
        request (``produced`` an output but no token) has its first output as first token, so
        its prompt and time to first output are counted like a generation's."""
        ttft = itl = None
        if num_new_tokens or (produced and group.last_token is None):
            if group.last_token is None:
                group.first_token = now
                ttft = group.first_token - group.arrival
            else:
                itl = now - group.last_token
            group.last_token = now
        queue_time = None
        if first_scheduled:
            queue_time = max(0.0, group.first_scheduled - group.arrival)
        finished = group.finished
        return RequestTiming(
            group.request_id, group.num_prompt_tokens, num_new_tokens, ttft, itl, queue_time,
            e2e_latency=now - group.arrival if finished else None,
            finish_reasons=group.finish_reasons if finished else [])

    def close(self) -> None:
        """Finishes the runner's launched steps, or stops the worker ranks (idempotent; workers
        also stop at interpreter exit)."""
        self.runner.close()

    def stats(self) -> EngineStats:
        """The engine's state now: the scheduler's queues and counters, the KV pool's usage."""
        pool, spec = self.scheduler.block_pool, self.scheduler.spec_stats
        return EngineStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                           kv_usage=pool.usage, prefix_cache_queries=pool.prefix_cache_queries,
                           prefix_cache_hits=pool.prefix_cache_hits,
                           num_preemptions=self.scheduler.num_preemptions, spec_num_drafts=spec.num_drafts,
                           spec_num_draft_tokens=spec.num_draft_tokens,
                           spec_num_accepted_tokens=spec.num_accepted_tokens,
                           spec_accepted_per_position=tuple(spec.accepted_per_position))


def _start_runner(config: EngineConfig, hf_config: Any) -> Any:
    """The runner or the executor of ranks that the resolved config names (distributed/executors.py)."""
    return make_executor(config, hf_config)
