"""Turns a scheduled step into the flat tensors the model and the attention op consume,
and pads them to a dispatcher bucket (see vgraph/worker/dispatch.py).

Padding never changes what the real rows compute: a padding token writes no KV (slot -1)
and belongs to no sequence (PIECEWISE: rows past ``query_start_loc[-1]``) or to an empty
one (FULL: its own sequence of length 0), so attention gives it zeros and the real rows'
results are those of the unpadded batch. Padded rows are dropped after the forward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

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


# The token id of padding rows: any valid id works (the row writes nothing and is dropped).
PAD_TOKEN_ID = 0


def pad_tokens(batch: FlatBatch, num_tokens: int) -> FlatBatch:
    """The batch with ``num_tokens - batch.num_tokens`` padding rows appended (PIECEWISE).

    The sequences are unchanged, so the new rows lie past ``query_start_loc[-1]``; their
    slots are -1 so the cache write skips them.
    """
    extra = num_tokens - batch.num_tokens
    if extra < 0:
        raise ValueError(f"cannot pad {batch.num_tokens} tokens down to {num_tokens}")
    if extra == 0:
        return batch
    meta = batch.attn_metadata
    ids = torch.cat([batch.input_ids, batch.input_ids.new_full((extra,), PAD_TOKEN_ID)])
    positions = torch.cat([batch.positions, batch.positions.new_zeros(extra)])
    slots = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((extra,), -1)])
    return FlatBatch(ids, positions, replace(meta, slot_mapping=slots), batch.sample_indices,
                     batch.sampled_requests)


@dataclass
class DecodeInputs:
    """The model inputs and attention metadata of one FULL bucket: views of ``DecodeBuffers``."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata


class DecodeBuffers:
    """Persistent inputs for pure-decode batches padded to a FULL bucket.

    Allocated once for the largest bucket; bucket B uses views of the first B rows, so a
    CUDA graph captured over those views reads whatever ``fill`` copied in before replay.
    Padding sequences have one token each, slot -1 and sequence length 0. Every sequence of
    a decode batch owns exactly one row, so ``query_start_loc`` is ``0..B`` for real and
    padding sequences alike and is written once, here.
    """

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, max_seq_len: int,
                 device: torch.device, kv_splits: Callable[[int], int] = lambda bucket: 1) -> None:
        long, i32 = dict(dtype=torch.long, device=device), dict(dtype=torch.int32, device=device)
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self.kv_splits = kv_splits  # bucket -> split-KV count, fixed per bucket (per graph)
        self.input_ids = torch.full((max_seqs,), PAD_TOKEN_ID, **long)
        self.positions = torch.zeros(max_seqs, **long)
        self.slot_mapping = torch.full((max_seqs,), -1, **long)
        self.block_table = torch.zeros((max_seqs, max(1, max_blocks_per_seq)), **i32)
        self.seq_lens = torch.zeros(max_seqs, **i32)
        self.query_start_loc = torch.arange(max_seqs + 1, **i32)
        self._views: dict[int, DecodeInputs] = {}

    def inputs(self, bucket: int) -> DecodeInputs:
        """The views of bucket ``bucket`` (the same objects on every call, so the metadata
        a graph was captured with is the metadata it replays with)."""
        if not 1 <= bucket <= self.max_seqs:
            raise ValueError(f"bucket {bucket} outside 1..{self.max_seqs}")
        view = self._views.get(bucket)
        if view is None:
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:bucket], block_table=self.block_table[:bucket],
                query_start_loc=self.query_start_loc[:bucket + 1], seq_lens=self.seq_lens[:bucket],
                max_query_len=1, max_seq_len=self.max_seq_len, num_kv_splits=self.kv_splits(bucket))
            view = self._views[bucket] = DecodeInputs(self.input_ids[:bucket], self.positions[:bucket], meta)
        return view

    def reset(self) -> None:
        """Every row padding again (no slot, empty sequence), as after construction."""
        self.input_ids.fill_(PAD_TOKEN_ID)
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()

    def fill(self, batch: FlatBatch, bucket: int) -> DecodeInputs:
        """Copies a pure-decode batch into rows ``:n`` and padding into ``n:bucket``, in place."""
        meta, n = batch.attn_metadata, batch.num_tokens
        _check_decode_batch(batch, bucket, self.block_table.shape[1])
        view = self.inputs(bucket)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Columns past the batch's width keep stale ids: no sequence reads past its length.
        self.block_table[:n, :meta.block_table.shape[1]].copy_(meta.block_table)
        if bucket > n:
            self.input_ids[n:bucket].fill_(PAD_TOKEN_ID)
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].zero_()
        return view


def _check_decode_batch(batch: FlatBatch, bucket: int, max_width: int) -> None:
    meta, n = batch.attn_metadata, batch.num_tokens
    if not (n == meta.num_seqs and meta.max_query_len == 1):
        raise ValueError(f"not a pure-decode batch: {n} tokens in {meta.num_seqs} sequences, "
                         f"max_query_len {meta.max_query_len}")
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit bucket {bucket}")
    if meta.block_table.shape[1] > max_width:
        raise ValueError(f"block table of width {meta.block_table.shape[1]} exceeds the "
                         f"persistent buffer's {max_width} (max_model_len / block_size)")
