"""The model runner: one scheduled step in, one sampled token per finished chunk out.

Each batch goes the way the dispatcher (dispatch.py) picks: a FULL bucket (pure decode,
copied into persistent buffers; a CUDA graph replay on CUDA), a PIECEWISE token bucket
(padded rows; per-piece CUDA graphs on CUDA), or the compiled forward at its own size.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..compiler.cudagraph import CaptureReport, FullGraphs, Phase, PiecewiseGraphs, capture_all
from ..core.scheduler import SchedulerOutput
from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from .batch import DecodeBuffers, FlatBatch, build_flat_batch, pad_tokens
from .dispatch import BatchShape, Buckets, CudaGraphMode, Decision, Path, choose
from .kv_sizing import KVSpec, allocate_kv_caches
from .sampler import Sampler, SamplingMetadata

# Split-KV decode pays off when a decode batch has too few (sequence, kv head) programs to
# fill the GPU and the contexts are long enough to split.
_SPLIT_KV_MIN_SEQ_LEN = 2048
_SPLIT_KV_MAX_PROGRAMS = 128


@dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> new token id
    logprobs: Optional[dict[str, dict[int, float]]]


class ModelRunner:
    """Owns the model and the KV caches; builds the flat batch and runs forward + sampler."""

    def __init__(self, model: torch.nn.Module, spec: KVSpec, num_blocks: int,
                 device: torch.device, vocab_size: int,
                 forward_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None) -> None:
        self.model = model
        # The compiled forward when compilation is on; the module itself when eager.
        self.forward_fn = forward_fn or model
        self.spec = spec
        self.device = device
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(spec, num_blocks, device)
        self.sampler = Sampler()
        self.softmax_scale = float(model.softmax_scale)
        # Buckets: off until enable_buckets(); graphs: only after capture_cudagraphs() on CUDA.
        self.cudagraph_mode = CudaGraphMode.NONE
        self.buckets = Buckets((), ())
        self.max_model_len = 0
        self.decode_buffers: Optional[DecodeBuffers] = None
        self.full_graphs: Optional[FullGraphs] = None
        self.piecewise_graphs: Optional[PiecewiseGraphs] = None
        self.dispatch_counts: Counter[tuple[Path, int]] = Counter()  # (path, padded size) -> batches

    # ------------------------------------------------------------------ buckets and graphs

    @torch.inference_mode()
    def enable_buckets(self, mode: CudaGraphMode, buckets: Buckets, max_model_len: int) -> None:
        """Pads every batch that fits a bucket from now on (call it with the compiled forward
        in place). FULL buckets get persistent input buffers sized for the largest one
        (inference tensors, like every other input: the compiled forward guards on that)."""
        self.cudagraph_mode, self.buckets, self.max_model_len = mode, buckets, max_model_len
        # Graphs belong to the buffers they were captured over: new buckets, new capture.
        self.decode_buffers, self.full_graphs, self.piecewise_graphs = None, None, None
        if mode.has_full and buckets.full:
            max_blocks = -(-max_model_len // self.spec.block_size)
            self.decode_buffers = DecodeBuffers(buckets.full[-1], max_blocks, max_model_len, self.device,
                                                self._graph_kv_splits)

    def capture_cudagraphs(self) -> CaptureReport:
        """On CUDA, captures the FULL and PIECEWISE graphs of the enabled buckets; elsewhere
        there is nothing to capture (the buckets run the compiled forward at padded sizes)."""
        if self.device.type != "cuda" or self.cudagraph_mode is CudaGraphMode.NONE:
            return CaptureReport()
        return self._capture_graphs(torch.cuda.graph_pool_handle())

    @torch.inference_mode()
    def _capture_graphs(self, pool: object) -> CaptureReport:
        full = None
        if self.decode_buffers is not None:
            full = FullGraphs(self.forward_fn, self.decode_buffers, self.kv_caches, self.softmax_scale, pool)
        pieces = PiecewiseGraphs(pool) if self.cudagraph_mode.has_piecewise and self.buckets.piecewise else None
        report = capture_all(full, self.buckets.full if full is not None else [], pieces,
                             self.buckets.piecewise if pieces else [], self._padding_forward, self.device)
        self.full_graphs, self.piecewise_graphs = full, pieces
        return report

    def _graph_kv_splits(self, bucket: int) -> int:
        """The split-KV count baked into a FULL graph: chosen for the longest context the
        graph may see, since the graph cannot re-decide per step."""
        return self._split_kv_count(bucket, self.max_model_len)

    def _kv_splits(self, meta: AttentionMetadata) -> int:
        if meta.max_query_len != 1:
            return 1  # split-KV is a decode kernel
        return self._split_kv_count(meta.num_seqs, meta.max_seq_len)

    def _split_kv_count(self, num_seqs: int, max_seq_len: int) -> int:
        """Splits only on CUDA, for contexts long enough to split, and only while the
        unsplit grid has too few (sequence, kv head) programs to fill the GPU."""
        if self.device.type != "cuda" or max_seq_len < _SPLIT_KV_MIN_SEQ_LEN:
            return 1
        if num_seqs * self.spec.num_kv_heads >= _SPLIT_KV_MAX_PROGRAMS:
            return 1
        return min(16, max_seq_len // 1024)

    # ------------------------------------------------------------------ forward

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """Hidden states of the rows to sample, for a batch built by ``build_flat_batch``."""
        return self.hidden_states(batch)[batch.sample_indices]

    def hidden_states(self, batch: FlatBatch) -> torch.Tensor:
        """Hidden states of every row of the batch, run on the dispatcher's path; padding rows
        are dropped. The result may be a view of a persistent buffer: consume it before the
        next forward."""
        decision = self.decide(batch)
        self.dispatch_counts[(decision.path, decision.bucket)] += 1
        if decision.path is Path.FULL:
            hidden = self._run_full(batch, decision.bucket)
        elif decision.path is Path.PIECEWISE:
            hidden = self._run(pad_tokens(batch, decision.bucket), piecewise=True)
        else:
            hidden = self._run(batch, piecewise=False)
        return hidden[:batch.num_tokens]

    def decide(self, batch: FlatBatch) -> Decision:
        return choose(BatchShape.of_flat(batch), self.buckets, self.cudagraph_mode)

    def _run_full(self, batch: FlatBatch, bucket: int) -> torch.Tensor:
        if self.full_graphs is not None and bucket in self.full_graphs.graphs:
            return self.full_graphs.replay(batch, bucket)
        inputs = self.decode_buffers.fill(batch, bucket)
        ctx = ForwardContext(inputs.attn_metadata, self.kv_caches, self.softmax_scale)
        with set_forward_context(ctx):
            return self.forward_fn(inputs.input_ids, inputs.positions)

    def _run(self, batch: FlatBatch, piecewise: bool) -> torch.Tensor:
        batch.attn_metadata.num_kv_splits = self._kv_splits(batch.attn_metadata)
        ctx = ForwardContext(batch.attn_metadata, self.kv_caches, self.softmax_scale)
        graphs = self.piecewise_graphs.active(Phase.REPLAY) if piecewise and self.piecewise_graphs \
            else contextlib.nullcontext()
        with set_forward_context(ctx), graphs:
            return self.forward_fn(batch.input_ids, batch.positions)

    def _padding_forward(self, num_tokens: int) -> torch.Tensor:
        """One forward over fresh dummy tokens that attend to nothing and write nothing."""
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            block_table=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.zeros(1, dtype=torch.int32, device=self.device),
            max_query_len=num_tokens, max_seq_len=0)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with set_forward_context(ForwardContext(meta, self.kv_caches, self.softmax_scale)):
            return self.forward_fn(ids, torch.arange(num_tokens, device=self.device))

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """One padding forward: triggers compilation (or the cache load) before the first
        request arrives."""
        self._padding_forward(num_tokens)

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        batch = build_flat_batch(sched, self.spec.block_size, self.device)
        if batch.num_tokens == 0:
            return StepResult({}, None)
        hidden = self.forward(batch)
        if not batch.sampled_requests:
            return StepResult({}, None)
        logits = self.model.compute_logits(hidden)
        meta = SamplingMetadata.from_requests(batch.sampled_requests, self.vocab_size, self.device)
        out = self.sampler(logits, meta)
        ids = out.token_ids.tolist()
        sampled = {r.request_id: t for r, t in zip(batch.sampled_requests, ids)}
        logprobs = None
        if out.logprobs is not None:
            logprobs = {r.request_id: lp for r, lp in zip(batch.sampled_requests, out.logprobs)
                        if lp is not None}
        return StepResult(sampled, logprobs)
