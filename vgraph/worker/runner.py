"""The model runner: owns the model, the KV cache and the compiled forward, and turns one
scheduled step into one sampled token per finished chunk.

Its startup is one story, told in ``__init__``: load the model, profile the largest steps
(CUDA), size and allocate the KV cache, compile (or load from the compile cache), warm up,
capture CUDA graphs. Profiling and warm-up run dummy requests through the real step (batch
builder, dispatcher, forward, sampler); capture builds its batches with the same builder
(dummy prefills for PIECEWISE buckets, all-padding batches for FULL ones).
The engine reads what it needs from ``num_blocks``, ``max_model_len`` (lowered to the KV
cache's capacity when that is smaller) and ``startup``; nothing outside this package changes
a runner.

Under pipeline parallelism (vgraph/distributed/pipeline.py) the runner is one stage's: its
model, KV caches and compiled forward cover the stage's layers only. Every stage builds the same
batch from the same plan; a stage after the first receives the previous stage's rows into the
batch's inputs before its forward, a stage before the last sends its rows on after it and
samples nothing. Warm-up, profiling and capture run each stage alone, on zeros.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

from vgraph.ops import build_cpu_kernels

from ..compiler.counters import CompileCounters
from ..config import CudaGraphMode, EngineConfig
from ..core.step_plan import StepPlan
from ..distributed.pipeline import StageLink
from ..distributed.state import pp_stage
from ..structured.bitmask import GrammarMasks
from ..models.loader import load_model
from .batch import BatchBuilder, StageInput
from .cuda_graphs import CaptureReport, ForwardRunner, estimate_capture_bytes
from .dispatch import Buckets, VerifyShape, capture_sizes
from .dummy import DummySource, blocks_for, dummy_decode, dummy_lengths, dummy_prefill
from .kv_sizing import (Companion, KVSpec, MemoryProfile, allocate_kv_caches, kv_cache_scales, num_blocks_for,
                        usable_max_model_len)
from ..core.outputs import ModelRunnerOutput
from .pooling import pooled_chunks
from .prompt_logprobs import compute_prompt_logprobs
from .launched import LaunchedStep, pending_inputs, pending_tokens
from .runner_requests import RunnerRequests, RunnerStep
from .sampler import Sampler, SamplingMetadata, SamplingMetadataCache
from .startup import StartupReport
from .step_threads import StepThreads

if TYPE_CHECKING:
    from ..compiler.cache import CompileCache
    from ..lora.config import LoRAConfig
    from ..lora.request import LoRARequest
    from ..lora.slots import LoRASlotManager

logger = logging.getLogger("vgraph")

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Tokens of the warm-up step: enough to trace (or load) the compiled forward.
_WARM_UP_TOKENS = 16


class ModelRunner:
    """Owns the model, the KV caches and the compiled forward; runs forward + sampler."""

    def __init__(self, config: EngineConfig) -> None:
        if not config.is_resolved:
            raise ValueError("ModelRunner takes a resolved EngineConfig (EngineConfig.resolved)")
        self.config = config
        self.device = config.torch_device
        # Steps launched and not yet finished (``submit``/``collect``), oldest first.
        self.launched: deque[LaunchedStep] = deque()
        t0 = time.perf_counter()
        if self.device.type == "cpu":
            build_cpu_kernels()  # first use builds them (~1 s each); logged, cached on disk
        lora = _lora_config(config)
        self.model, self.hf_config, weights = load_model(config.model, self.device,
                                                         use_custom_ops=config.compile.custom_ops,
                                                         lora_config=lora)
        t1 = time.perf_counter()
        m = self.model
        # The adapters in the model's slots (vgraph/lora/slots.py); None without LoRA.
        self.lora: Optional["LoRASlotManager"] = None
        if lora is not None:
            from ..lora.slots import LoRASlotManager
            self.lora = LoRASlotManager(m, lora, m.dtype)
        self.spec = KVSpec(m.num_layers, m.num_kv_heads, m.head_dim, config.cache.block_size,
                           config.cache.kv_torch_dtype(m.dtype))
        self.kv_scales = kv_cache_scales(m, config.cache)
        self.vocab_size = m.vocab_size
        self.softmax_scale = float(m.softmax_scale)
        self.sampler = Sampler()
        self.sampling = SamplingMetadataCache(self.vocab_size, self.device)
        self.requests = RunnerRequests()  # the runner's copy of every planned, unfinished request
        self.stage = pp_stage()
        # Activations to and from the neighbouring stages; None with one stage.
        self.link: Optional[StageLink] = StageLink(self.stage) if self.stage.size > 1 else None
        stage_input = None if self.stage.is_first else StageInput(2 * m.hidden_size, m.dtype)
        self.builder = BatchBuilder(self.spec.block_size, self.device, m.num_kv_heads, config.max_model_len,
                                    stage_input, self.stage.is_last)
        buckets = capture_sizes(config.compile, config.scheduler.max_num_seqs,
                                config.scheduler.max_num_batched_tokens, _verify_shape(config))
        profile = self._profile_memory()
        reserve = self._graph_reserve(profile, buckets)
        self.num_blocks = self._plan_blocks(profile, reserve, self._draft_share(profile))
        # What a sequence may really reach: max_model_len, or less when the KV cache is smaller.
        self.max_model_len = usable_max_model_len(config.max_model_len, self.num_blocks, self.spec.block_size,
                                                  self.device)
        self.kv_caches = allocate_kv_caches(self.spec, self.num_blocks, self.device,
                                            bool(config.cache.kv_cache_prefault))
        t2 = time.perf_counter()
        forward = self._compiled_forward()
        self.graphs = ForwardRunner(forward, self.kv_caches, self.softmax_scale, self.builder,
                                  config.compile.cudagraph_mode, buckets,
                                  weights=[*m.parameters(), *m.buffers()], kv_scales=self.kv_scales)
        self._warm_up()
        t3 = time.perf_counter()
        # CPU: all threads or one per step size, as measured (step_threads.py); None elsewhere,
        # and where Dynamo's frame serves (it guards on the thread count: a change recompiles).
        self.step_threads = StepThreads.for_engine(
            self.device, config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size,
            fixed_threads=getattr(forward, "guards_global_state", False))
        # Read after the warm-up: a warm forward that failed there has been replaced.
        self.compile_counters: Optional[CompileCounters] = getattr(forward, "counters", None)
        self.compile_cache: Optional["CompileCache"] = getattr(forward, "cache", None)
        if self.compile_counters is not None:
            from ..compiler.counters import log_compile_summary
            log_compile_summary(self.compile_counters, self.compile_cache, t3 - t2)
        capture = replace(self._capture(), estimated_bytes=reserve)
        if 0 < reserve < capture.memory_bytes:  # 0: KV size given, nothing reserved
            logger.warning("CUDA graphs took %.3f GiB, more than the %.3f GiB reserved for them",
                           capture.memory_bytes / 2**30, reserve / 2**30)
        self.startup = StartupReport(t1 - t0, weights.weights_bytes, t2 - t1, self.num_blocks,
                                     self.num_blocks * self.spec.bytes_per_block, profile, t3 - t2, capture,
                                     _compile_source(self.compile_counters))

    # ------------------------------------------------------------------ startup phases

    @torch.inference_mode()
    def _profile_memory(self) -> Optional[MemoryProfile]:
        """On CUDA, unless the KV size is given: the peak device memory of the largest steps
        the scheduler may run, eager, sampler included, over a scratch KV cache (freed before
        returning): the most tokens (``max_num_batched_tokens`` in prefills of at most
        ``max_model_len``) and the most sampled rows (a decode of ``max_num_seqs``
        sequences); then what the device holds outside torch's allocator."""
        if self.device.type != "cuda" or self.config.cache.num_gpu_blocks is not None:
            return None
        sched = self.config.scheduler
        tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * self.config.max_model_len)
        lens = dummy_lengths(tokens, self.config.max_model_len, sched.max_num_seqs)
        scratch_blocks = blocks_for(lens, self.spec.block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # loading's cached blocks are not the step's fragmentation
        torch.cuda.reset_peak_memory_stats(self.device)
        resident = torch.cuda.memory_allocated(self.device)
        caches = allocate_kv_caches(self.spec, scratch_blocks, self.device)
        eager = ForwardRunner(self.model, caches, self.softmax_scale, self.builder, CudaGraphMode.NONE,
                              Buckets((), ()), kv_scales=self.kv_scales)
        self._step(eager, dummy_prefill(lens, self.spec.block_size, scratch_blocks))
        # The widest sampling step too: logits and the top-k/top-p sort for every seat.
        self._step(eager, dummy_decode(sched.max_num_seqs, 1, self.spec.block_size, scratch_blocks))
        torch.cuda.synchronize(self.device)
        scratch = scratch_blocks * self.spec.bytes_per_block
        peak = torch.cuda.max_memory_allocated(self.device) - scratch
        peak_reserved = torch.cuda.max_memory_reserved(self.device) - scratch
        del caches, eager
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return MemoryProfile(int(peak), int(peak_reserved), int(resident), sum(lens), int(total),
                             int(free), int(reserved))

    def _graph_reserve(self, profile: Optional[MemoryProfile], buckets: Buckets) -> int:
        """Memory to leave free for CUDA graph capture, which can only run once the KV cache
        exists (the graphs bake its addresses in), so it is estimated now."""
        if profile is None:
            return 0
        reserve = estimate_capture_bytes(profile.activation_bytes_per_token, self.model, buckets,
                                         self.config.compile.cudagraph_mode, self.config.max_model_len,
                                         self.spec.block_size)
        if reserve:
            logger.info("reserving %.3f GiB for CUDA graphs before sizing the KV cache", reserve / 2**30)
        return reserve

    def _draft_share(self, profile: Optional[MemoryProfile]) -> Optional[Companion]:
        """A speculative draft model's memory, when the cache is sized from a GPU profile: the
        draft loads after this cache exists, on the same device (vgraph/spec/draft_model.py)."""
        spec = self.config.speculative_config
        if profile is None or spec is None or spec.method != "draft_model":
            return None
        from ..spec.draft_model import draft_memory
        fixed, per_block = draft_memory(spec, self.config, self.model.dtype)
        logger.info("leaving %.3f GiB and %d bytes per KV block for the draft model %s", fixed / 2**30, per_block,
                    spec.model)
        return Companion(fixed, per_block)

    def _plan_blocks(self, profile: Optional[MemoryProfile], reserve: int,
                     companion: Optional[Companion] = None) -> int:
        max_model_len = self.config.max_model_len
        useful = self.config.scheduler.max_num_seqs * -(-max_model_len // self.spec.block_size)
        blocks = num_blocks_for(self.spec, self.config.cache, self.device, profile, reserve, useful, companion)
        tokens = blocks * self.spec.block_size
        logger.info("KV cache (%s): %d blocks of %d tokens = %d tokens (%.2f GiB); max concurrency at "
                    "max_model_len %d: %.2fx", self.spec.dtype_name, blocks, self.spec.block_size, tokens,
                    blocks * self.spec.bytes_per_block / 2**30, max_model_len, tokens / max_model_len)
        return blocks

    def _compiled_forward(self) -> Forward:
        """The compiled forward, or the eager module. The compiled one is the compiler's ladder
        of loaders (compiler/build.py), climbed at its first call, the warm-up: its top rung
        imports neither Dynamo nor Inductor, the lower ones bring both (~2.5 s), which an
        eager engine never uses."""
        if not self.config.compile.compiled:
            return self.model
        from ..compiler.build import build_forward
        return build_forward(self.model, self.config, self.hf_config, self.device)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One dummy prefill through the real step: compiles (or loads) the forward before
        the first request arrives."""
        n = min(_WARM_UP_TOKENS, self.config.scheduler.max_num_batched_tokens, self.config.max_model_len)
        self._step(self.graphs, dummy_prefill([n], self.spec.block_size, self.num_blocks))

    def _capture(self) -> CaptureReport:
        """On CUDA, captures the graphs of the mode's buckets; elsewhere there is nothing to
        capture (the buckets run the compiled forward at padded sizes)."""
        mode = self.config.compile.cudagraph_mode
        if mode is CudaGraphMode.NONE:
            logger.info("no CUDA graphs (cudagraph_mode=none%s): every batch runs the %s forward unpadded",
                        "" if self.device.type == "cuda" else f", the default on {self.device.type}",
                        "compiled" if self.config.compile.compiled else "eager")
            return CaptureReport()
        if self.device.type != "cuda":
            self._log_buckets_without_graphs()
            return CaptureReport()
        sched = self.config.scheduler
        report = self.graphs.capture(torch.cuda.graph_pool_handle(),
                                     DummySource(self.num_blocks, self.spec.block_size, self.config.max_model_len,
                                                 sched.max_num_seqs))
        logger.info(report.summary())
        return report

    def _log_buckets_without_graphs(self) -> None:
        g = self.graphs
        full = g.buckets.full if g.mode.has_full else ()
        pieces = g.buckets.piecewise if g.mode.has_piecewise else ()
        logger.info("cudagraph_mode=%s on %s: no graphs; %d decode buckets (FULL, up to %s) and %d token "
                    "buckets (PIECEWISE, up to %s) run the compiled forward at the padded size",
                    g.mode.value, self.device.type, len(full), full[-1] if full else "-", len(pieces),
                    pieces[-1] if pieces else "-")

    # ------------------------------------------------------------------ one step

    def execute(self, plan: StepPlan, grammar_masks: Optional[GrammarMasks] = None) -> ModelRunnerOutput:
        """One step of the scheduler's plan, start to end. ``grammar_masks``: the structured-
        output masks of the sampled rows, in batch order (the engine owns the grammars)."""
        return self.finish(self.launch(plan, grammar_masks))

    def submit(self, plan: StepPlan, grammar_masks: Optional[GrammarMasks] = None) -> None:
        """Launches a step; ``collect`` finishes the oldest. Overlapped scheduling submits step
        N+1 before collecting step N: on a GPU the host then builds and launches N+1 while
        the device still runs N, and reads N's tokens after."""
        self.launched.append(self.launch(plan, grammar_masks))

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's result (waits for its tokens)."""
        return self.finish(self.launched.popleft())

    @torch.inference_mode()
    def launch(self, plan: StepPlan, grammar_masks: Optional[GrammarMasks] = None) -> LaunchedStep:
        """Folds the plan in and enqueues the step's device work up to the sampled ids, without
        reading them. Each sampled row's request gets a pending token (``launched.PENDING``) at once; a
        step launched before that one is finished takes it from the device (``pending_inputs``)."""
        step = self.requests.apply(plan)
        if not step.chunks:
            return LaunchedStep(step)
        return self._launch(self.graphs, step, grammar_masks, record=True)

    @torch.inference_mode()
    def finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Waits for a launched step's ids and writes them over its pending tokens."""
        return launched.finish()

    def add_lora(self, request: "LoRARequest") -> None:
        """Reads and checks an adapter into the host cache (raises ``LoRAAdapterError`` naming
        the file and field when it cannot be served), so a step never meets a bad one."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled for this engine (enable_lora=True, --enable-lora)")
        self.lora.add_adapter(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drops an adapter from its slot and the host cache; False if it was not loaded."""
        return self.lora is not None and self.lora.remove_adapter(lora_int_id)

    def close(self) -> None:
        """Nothing runs apart from the caller's thread: finishes what was launched."""
        while self.launched:
            self.collect()

    def _set_lora_slots(self, step: RunnerStep) -> None:
        """Each row's adapter slot for the next forward, loading into slots what the step needs
        (a copy into fixed buffers: the graphs stay valid)."""
        assert self.lora is not None
        slots = self.lora.prepare([c.request.lora_request for c in step.chunks])
        # A list, then one tensor: repeat_interleave with a tensor of counts is five small ops
        # (about 0.1 ms of a 12 ms CPU decode step of 32 rows).
        rows = [slot for slot, chunk in zip(slots, step.chunks) for _ in range(chunk.num_new_tokens)]
        self.model.set_lora_token_slots(torch.tensor(rows, dtype=torch.int32, device=self.device))

    def _step(self, graphs: ForwardRunner, step: RunnerStep,
              masks: Optional[GrammarMasks] = None) -> ModelRunnerOutput:
        """A whole step over dummy or real requests (warm-up, profiling, capture)."""
        if not step.chunks:
            return ModelRunnerOutput({}, None)
        return self._launch(graphs, step, masks, record=False).finish()

    def _launch(self, graphs: ForwardRunner, step: RunnerStep, masks: Optional[GrammarMasks],
                record: bool) -> LaunchedStep:
        """Build, forward on the dispatcher's path, logits of the sampled rows, sample. From the
        same forward: prompt logprobs (worker/prompt_logprobs.py) and pooled hidden states
        (worker/pooling.py) for the requests that ask. A real step (``record``) passes its
        activations between pipeline stages; a dummy step's stay in its stage."""
        batch, decision = graphs.build(step)
        if record and not self.stage.is_first:
            self.link.receive_into(batch.input_ids[:batch.num_scheduled])
        # Only token ids can be pending (a first stage's); a later stage's inputs came in whole.
        feed = (pending_inputs(step, self.launched, self.device, decision.rows_per_chunk)
                if record and self.stage.is_first else None)
        if feed is not None:
            feed.apply(batch.input_ids)
        if self.lora is not None:
            self._set_lora_slots(step)
        threads = self.step_threads if record else None  # dummy steps measure nothing
        with threads.forward(batch.num_scheduled) if threads is not None else contextlib.nullcontext():
            rows = graphs.run(batch, decision)
        if not self.stage.is_last:
            if record:
                self.link.send(rows)
            return LaunchedStep(step, record=record)
        # Dummy steps (warm-up, capture) carry requests of their own: only a recorded step's
        # are all in the runner's counts.
        scoring = not record or self.requests.num_scoring
        pooling = not record or self.requests.num_pooling
        prompt_logprobs = compute_prompt_logprobs(rows, step, self.model.compute_logits) if scoring else None
        pooled = pooled_chunks(rows, step) if pooling else None
        if not batch.sampled_requests:
            return LaunchedStep(step, prompt_logprobs=prompt_logprobs, pooled=pooled, record=record)
        logits = self.model.compute_logits(batch.sampled_hidden(rows))
        # Penalties count the earlier steps' tokens: those still pending are counted on the device.
        counted = (pending_tokens(batch.sampled_requests, self.launched, self.device)
                   if record and self.launched and _reads_output_tokens(batch.sampled_requests) else None)
        pending = None if counted is None else (counted.rows, counted.ids())
        meta = (self.sampling.get(batch.sampled_requests, masks, pending) if record
                else SamplingMetadata.from_requests(batch.sampled_requests, self.vocab_size, self.device, masks))
        drafts = None if self.config.speculative_config is None else _draft_rows(step, self.device)
        out = self.sampler(logits, meta, drafts)
        return LaunchedStep(step, batch.sampled_requests, out.token_ids, out.logprobs, prompt_logprobs, pooled,
                            record)


def _verify_shape(config: EngineConfig) -> Optional[VerifyShape]:
    """The verify batches speculative decoding makes: k + 1 rows a sequence, at most
    ``disable_by_batch_size`` (else ``max_num_seqs``) sequences."""
    spec = config.speculative_config
    if spec is None:
        return None
    max_seqs = spec.disable_by_batch_size or config.scheduler.max_num_seqs
    return VerifyShape(spec.num_speculative_tokens + 1, min(max_seqs, config.scheduler.max_num_seqs),
                       config.max_model_len)


def _draft_rows(step: RunnerStep, device: torch.device) -> Optional[torch.Tensor]:
    """The guess each sampled row verifies (-1: none), or None when no chunk carries guesses."""
    if not any(c.draft_token_ids for c in step.chunks):
        return None
    rows = [t for c in step.chunks if c.produces_token for t in (*c.draft_token_ids, -1)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _reads_output_tokens(requests: list) -> bool:
    """Whether sampling these rows reads their earlier tokens' ids (penalties do)."""
    return any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
               for p in (r.sampling_params for r in requests))


def _lora_config(config: EngineConfig) -> Optional["LoRAConfig"]:
    """The LoRA slot sizes the model is built with, or None without LoRA. The per-row slot
    buffer holds the most rows any forward carries (padding and memory profiling included)."""
    s = config.lora
    if not s.enable_lora:
        return None
    from ..lora.config import LoRAConfig
    return LoRAConfig(s.max_loras, s.max_lora_rank, config.max_forward_rows, s.max_cpu_loras)


def _compile_source(counters: Optional[CompileCounters]) -> str:
    """Where the compiled forward came from, for the startup line."""
    if counters is None:
        return ""
    if counters.captured_graph == "loaded":
        return "loaded from the compile cache"
    if counters.inductor_compilations == 0 and counters.cache_loads:
        return "traced, pieces loaded from the compile cache"
    return "compiled"


