"""The forward context: how attention metadata and KV caches reach the attention op.

The model's signature stays ``forward(input_ids, positions)`` so that Dynamo captures one
graph for every batch; the per-step attention inputs travel beside it. The runner sets a
context around each forward and ``vgraph::unified_attention`` reads it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch


@dataclass
class AttentionMetadata:
    """Describes one flat batch of sequences for the paged attention kernels.

    Tokens of sequence ``i`` occupy rows ``query_start_loc[i]:query_start_loc[i+1]`` of the
    flat batch; they are the last tokens of a sequence of ``seq_lens[i]`` tokens in total
    (already-cached prefix plus these new ones). A padding sequence has ``seq_lens == 0``
    and its tokens have ``slot_mapping == -1``: they write nothing and produce zeros.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token, -1 = none
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int  # host-side bounds, so no kernel launch needs a device sync
    max_seq_len: int
    num_kv_splits: int = 1  # > 1: a pure-decode batch uses the split-KV kernel

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: [blocks, block_size, kv_heads, head_dim]
    softmax_scale: float


_current: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(
            "vgraph::unified_attention ran outside a forward context; wrap the forward in "
            "vgraph.ops.forward_context.set_forward_context(...)")
    return _current


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous
