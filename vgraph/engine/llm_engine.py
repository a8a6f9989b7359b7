"""``LLMEngine``: requests in, one scheduler step + one model step at a time, outputs out."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from vgraph.ops import build_cpu_kernels

from ..compiler.counters import CompileCounters
from ..compiler.setup import build_compiled_forward, log_compile_summary
from ..config import EngineConfig
from ..core.request import Request, RequestStatus
from ..core.scheduler import Scheduler
from ..models.loader import (load_generation_config, load_model, load_tokenizer, resolve_model_path,
                             runs_quantized)
from ..sampling_params import SamplingParams
from ..compiler.cudagraph import CaptureReport
from ..worker.dispatch import CudaGraphMode, capture_sizes, resolve_mode
from ..worker.kv_sizing import KVSpec, num_blocks_for
from ..worker.runner import ModelRunner
from .detokenizer import IncrementalDetokenizer
from .inputs import PromptType, check_prompt, prompt_to_ids
from .outputs import CompletionOutput, RequestOutput
from .profiling import estimate_cudagraph_bytes, profile_memory

logger = logging.getLogger("vgraph")


@dataclass
class _Sequence:
    request: Request
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float = 0.0  # of the chosen tokens, kept as they arrive


@dataclass
class _Group:
    """One user request: ``n`` sequences sharing a prompt."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.status.finished for s in self.sequences)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        self.device = config.resolved_device()
        if self.device.type == "cpu":
            build_cpu_kernels()  # first use builds them (~1 s each); logged, cached on disk
        path = resolve_model_path(config.model.model, config.model.revision)
        config.model.model = str(path)
        # A copy: the caller's CompileConfig may be reused for another device or checkpoint.
        config.compile = replace(config.compile, custom_ops=config.compile.resolved_custom_ops(
            self.device.type, runs_quantized(config.model)))
        torch.manual_seed(config.model.seed)
        self.model, self.hf_config, self.load_stats = load_model(
            config.model, self.device, use_custom_ops=config.compile.custom_ops)
        self.tokenizer = load_tokenizer(config.model.tokenizer or path)
        self.eos_token_ids = frozenset(load_generation_config(path))
        self.max_model_len = self._max_model_len()
        self.vocab_size = self.model.vocab_size
        self.compile_counters: Optional[CompileCounters] = None
        self.runner = self._build_runner()
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks, self.max_model_len)
        self._groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, str] = {}
        logger.info("engine ready in %.2f s", time.perf_counter() - start)

    def _max_model_len(self) -> int:
        limit = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        wanted = self.config.model.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        return wanted

    def _build_runner(self) -> ModelRunner:
        m = self.model
        # The activation dtype, not a parameter's: fp8 models hold e4m3 weights.
        spec = KVSpec(m.num_layers, m.num_kv_heads, m.head_dim, self.config.cache.block_size, m.dtype)
        self._plan_graphs()
        useful = self.config.scheduler.max_num_seqs * -(-self.max_model_len // spec.block_size)
        num_blocks = num_blocks_for(spec, self.config.cache, self.device, self._non_kv_bytes(spec), useful)
        tokens = num_blocks * spec.block_size
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB); max concurrency at "
                    "max_model_len %d: %.2fx", num_blocks, spec.block_size, tokens,
                    num_blocks * spec.bytes_per_block / 2**30, self.max_model_len, tokens / self.max_model_len)
        runner = ModelRunner(m, spec, num_blocks, self.device, m.vocab_size)
        if self.config.compile.level == "compiled":
            self._compile(runner)
        return runner

    def _plan_graphs(self) -> None:
        """The dispatcher's mode and buckets, known before memory is planned."""
        sched = self.config.scheduler
        self.cudagraph_mode = resolve_mode(self.config.compile, self.device.type)
        self.cudagraph_buckets = capture_sizes(self.config.compile, sched.max_num_seqs, sched.max_num_batched_tokens)
        self.cudagraph_report: Optional[CaptureReport] = None
        self._graph_reserve = 0

    def _non_kv_bytes(self, spec: KVSpec) -> int:
        """On CUDA, unless the KV size is given: device memory everything but the KV cache
        needs, the profiled forward's peak plus the CUDA graphs' estimate (captured later,
        over the allocated cache, so they cannot be measured yet)."""
        if self.device.type != "cuda" or self.config.cache.num_gpu_blocks is not None:
            return 0
        profile = profile_memory(self.model, spec, self.config.scheduler, self.max_model_len, self.device)
        self._graph_reserve = estimate_cudagraph_bytes(profile, self.model, self.cudagraph_buckets,
                                                       self.cudagraph_mode, self.max_model_len, spec.block_size)
        if self._graph_reserve:
            logger.info("reserving %.3f GiB for CUDA graphs before sizing the KV cache", self._graph_reserve / 2**30)
        return profile.peak_bytes + self._graph_reserve

    def _compile(self, runner: ModelRunner) -> None:
        """Captures and compiles the forward now (or loads it from the compile cache), then
        sets up the dispatcher's buckets and captures the CUDA graphs."""
        start = time.perf_counter()
        compiled, self.compile_counters, self.compile_cache = build_compiled_forward(
            self.model, self.config, self.hf_config, self.device)
        runner.forward_fn = compiled
        runner.warm_up(min(16, self.config.scheduler.max_num_batched_tokens))
        log_compile_summary(self.compile_counters, self.compile_cache, time.perf_counter() - start)
        self._set_up_graphs(runner)

    def _set_up_graphs(self, runner: ModelRunner) -> None:
        mode, buckets = self.cudagraph_mode, self.cudagraph_buckets
        if mode is CudaGraphMode.NONE:
            logger.info("no CUDA graphs (cudagraph_mode=none%s): every batch runs the compiled forward "
                        "unpadded", "" if self.device.type == "cuda" else f", the default on {self.device.type}")
            return
        runner.enable_buckets(mode, buckets, self.max_model_len)
        report = runner.capture_cudagraphs()
        report.estimated_bytes = self._graph_reserve
        self.cudagraph_report = report
        if self.device.type == "cuda":
            logger.info(report.summary())
            if 0 < self._graph_reserve < report.memory_bytes:  # 0: KV size given, nothing reserved
                logger.warning("CUDA graphs took %.3f GiB, more than the %.3f GiB reserved for them",
                               report.memory_bytes / 2**30, self._graph_reserve / 2**30)
            return
        full = buckets.full if mode.has_full else ()
        pieces = buckets.piecewise if mode.has_piecewise else ()
        logger.info("cudagraph_mode=%s on %s: no graphs; %d decode buckets (FULL, up to %s) and %d token "
                    "buckets (PIECEWISE, up to %s) run the compiled forward at the padded size",
                    mode.value, self.device.type, len(full), full[-1] if full else "-", len(pieces),
                    pieces[-1] if pieces else "-")

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
