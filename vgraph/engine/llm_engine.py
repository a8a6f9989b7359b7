"""``LLMEngine``: requests in, one scheduler step + one model step at a time, outputs out."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from ..config import EngineConfig
from ..core.request import Request, RequestStatus
from ..core.scheduler import Scheduler, SchedulerOutput
from ..models.loader import load_generation_config, load_hf_config, load_tokenizer, resolve_model_path
from ..models.quantization import resolve_quantization
from ..sampling_params import SamplingParams
from ..worker.runner import ModelRunner
from .detokenizer import IncrementalDetokenizer
from .inputs import PromptType, check_prompt, prompt_to_ids
from .outputs import CompletionOutput, RequestOutput
from .stats import EngineStats, RequestTiming, StepOutput

logger = logging.getLogger("vgraph")


@dataclass
class _Sequence:
    request: Request
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float = 0.0  # of the chosen tokens, kept as they arrive


@dataclass
class _Group:
    """One user request: ``n`` sequences sharing a prompt, and the request's times.

    The times (``time.monotonic()``) live here and nowhere else: ``LLMEngine.step`` stamps
    them where the work happens and derives each step's ``RequestTiming`` from them.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    arrival: float
    sequences: list[_Sequence] = field(default_factory=list)
    first_scheduled: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None

    @property
    def finished(self) -> bool:
        return all(s.request.status.finished for s in self.sequences)


class LLMEngine:
    """Resolves the configuration once, starts a runner and a scheduler over its KV cache,
    and steps them. ``self.config`` is the resolved copy; the caller's object is left as given."""

    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        path = resolve_model_path(config.model.model, config.model.revision)
        hf_config = load_hf_config(path)
        self.config = config.resolved(
            model_path=path, max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 2048)),
            quantized=resolve_quantization(config.model.quantization, hf_config) is not None)
        torch.manual_seed(self.config.model.seed)
        self.runner = ModelRunner(self.config)
        self.tokenizer = load_tokenizer(self.config.model.tokenizer or path)
        self.eos_token_ids = frozenset(load_generation_config(path))
        self.max_model_len = self.config.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, self.runner.num_blocks,
                                   self.max_model_len)
        self._groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, str] = {}
        logger.info("startup: %s", self.runner.startup.timeline())
        logger.info("engine ready in %.2f s", time.perf_counter() - start)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        """Validates everything first: a bad request raises ValueError and touches nothing."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate(self.config.max_logprobs)
        text, ids = prompt_to_ids(prompt, self.tokenizer)
        params = check_prompt(ids, params, self.vocab_size, self.max_model_len)
        group = _Group(request_id, text, ids)
        for i in range(params.n):
            child_params = params if params.seed is None else replace(params, seed=params.seed + i)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(seq_id, ids, child_params, eos_token_ids=self.eos_token_ids)
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                           params.stop, params.include_stop_str_in_output)
            group.sequences.append(_Sequence(req, detok))
        for seq in group.sequences:
            self.scheduler.add_request(seq.request)
            self._seq_to_group[seq.request.request_id] = request_id
        self._groups[request_id] = group

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        seq_ids = [s.request.request_id for rid in ids if rid in self._groups
                   for s in self._groups[rid].sequences]
        self.scheduler.abort_requests(seq_ids)
        for rid in ids:
            self._forget(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _forget(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        for seq in group.sequences if group else []:
            self._seq_to_group.pop(seq.request.request_id, None)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedules, runs the model once, and returns the outputs of requests that advanced."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        result = self.runner.execute(sched)
        advanced = self.scheduler.update(sched, result.sampled, result.logprobs)
        touched: dict[str, _Group] = {}
        for req in advanced:
            group_id = self._seq_to_group[req.request_id]
            group = self._groups[group_id]
            self._detokenize(group, req)
            touched[group_id] = group
        outputs = [self._output(g) for g in touched.values()]
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def _detokenize(self, group: _Group, req: Request) -> None:
        seq = next(s for s in group.sequences if s.request is req)
        token = req.output_token_ids[-1]
        if req.sampling_params.logprobs is not None and len(req.logprobs) == len(req.output_token_ids):
            seq.cumulative_logprob += req.logprobs[-1][token]
        stop = seq.detokenizer.update([token])
        if stop is not None and not req.status.finished:
            req.stop_reason = stop
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for i, seq in enumerate(group.sequences):
            req = seq.request
            wants_logprobs = req.sampling_params.logprobs is not None
            lps = list(req.logprobs) if wants_logprobs else None
            cumulative = seq.cumulative_logprob if lps else None
            completions.append(CompletionOutput(i, seq.detokenizer.output_text, list(req.output_token_ids),
                                                cumulative, lps, req.finish_reason, req.stop_reason))
        cached = group.sequences[0].request.num_cached_prefix_tokens
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             group.finished, cached)

    def stats(self) -> dict[str, Any]:
        pool = self.scheduler.kv_manager.pool
        return {"num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
                "kv_usage": pool.usage, "prefix_cache_queries": pool.prefix_cache_queries,
                "prefix_cache_hits": pool.prefix_cache_hits, "num_preemptions": self.scheduler.num_preemptions}
