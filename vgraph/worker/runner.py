"""The model runner: one scheduled step in, one sampled token per finished chunk out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..core.scheduler import SchedulerOutput
from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from .batch import FlatBatch, build_flat_batch
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

    def _kv_splits(self, meta: AttentionMetadata) -> int:
        if self.device.type != "cuda" or meta.max_query_len != 1 or meta.max_seq_len < _SPLIT_KV_MIN_SEQ_LEN:
            return 1
        if meta.num_seqs * self.spec.num_kv_heads >= _SPLIT_KV_MAX_PROGRAMS:
            return 1
        return min(16, meta.max_seq_len // 1024)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """Hidden states of the rows to sample, for a batch built by ``build_flat_batch``."""
        batch.attn_metadata.num_kv_splits = self._kv_splits(batch.attn_metadata)
        ctx = ForwardContext(batch.attn_metadata, self.kv_caches, self.softmax_scale)
        with set_forward_context(ctx):
            hidden = self.forward_fn(batch.input_ids, batch.positions)
        return hidden[batch.sample_indices]

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """One forward over dummy tokens that attend to nothing and write nothing: triggers
        compilation (or the cache load) before the first request arrives."""
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            block_table=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.zeros(1, dtype=torch.int32, device=self.device),
            max_query_len=num_tokens, max_seq_len=0)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with set_forward_context(ForwardContext(meta, self.kv_caches, self.softmax_scale)):
            self.forward_fn(ids, torch.arange(num_tokens, device=self.device))

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
