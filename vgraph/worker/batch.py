"""Turns a scheduled step into the flat tensors the model and the attention op consume."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.scheduler import SchedulerOutput
from vgraph.ops.forward_context import AttentionMetadata


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    # Row of the flat batch whose logits are sampled, per request that produces a token.
    sample_indices: torch.Tensor  # [S'] int64
    sampled_requests: list  # the Request objects, in sample_indices order

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_flat_batch(sched: SchedulerOutput, block_size: int, device: torch.device) -> FlatBatch:
    """Concatenates every scheduled chunk: tokens, positions, cache slots, block table rows."""
    ids, pos, slots, q_lens, seq_lens, tables, sample_rows, sampled = [], [], [], [], [], [], [], []
    offset = 0
    for item in sched.scheduled:
        req, n = item.request, item.num_new_tokens
        start = item.start_position
        positions = np.arange(start, start + n, dtype=np.int64)
        blocks = np.asarray(req.block_ids, dtype=np.int64)
        ids.append(np.asarray(item.token_ids, dtype=np.int64))
        pos.append(positions)
        slots.append(blocks[positions // block_size] * block_size + positions % block_size)
        q_lens.append(n)
        seq_lens.append(start + n)
        tables.append(blocks)
        offset += n
        if item.produces_token:
            sample_rows.append(offset - 1)
            sampled.append(req)
    width = max((len(t) for t in tables), default=1) or 1
    table = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    qsl = np.zeros(len(q_lens) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(q_lens)

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=dev(np.concatenate(slots) if slots else np.zeros(0, np.int64)),
        block_table=dev(table), query_start_loc=dev(qsl),
        seq_lens=dev(np.asarray(seq_lens, dtype=np.int32)),
        max_query_len=max(q_lens, default=0), max_seq_len=max(seq_lens, default=0))
    return FlatBatch(dev(np.concatenate(ids)), dev(np.concatenate(pos)), meta,
                     dev(np.asarray(sample_rows, dtype=np.int64)), sampled)
