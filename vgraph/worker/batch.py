"""The one way a step becomes tensors: a scheduled batch (real, or dummy requests for warm-up,
profiling and capture) plus the dispatcher's decision in, the flat, padded batch out.

Padding happens here and only here, and never changes what the real rows compute: a padding
token writes no KV (slot -1) and either belongs to no sequence (rows past
``query_start_loc[-1]``: PIECEWISE and NONE) or to an empty sequence of its own (FULL: one
token, sequence length 0), so attention gives it zeros and the real rows' results are those
of the unpadded batch. Padded rows are dropped after the forward (``FlatBatch.num_scheduled``).
A FULL verify batch (speculative guesses, ``Decision.query_len`` > 1) also pads each sequence
to its fixed row count: those rows come after the sequence's own, write no KV, and are never
sampled, so causal attention keeps the real rows' results; they stay inside ``num_scheduled``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from vgraph.ops.forward_context import AttentionMetadata
from vgraph.ops.kernels.host import sm_count, wave_efficient_splits

from .dispatch import Decision, Path
from .runner_requests import RunnerRequest, RunnerStep

if TYPE_CHECKING:
    from .cuda_graphs import DecodeBuffers

# The token id of padding rows: any valid id works (the row writes nothing and is dropped).
PAD_TOKEN_ID = 0

# Split-KV decode pays off when a decode batch has too few (sequence, kv head) programs to
# fill the GPU and the contexts are long enough to split. The split count aims at a few
# resident stage-1 programs per SM (compiled for sm_90 at head_dim 128 it takes ~114
# registers x 128 threads, so 4 fit), each split keeping enough keys to amortize its
# partial-output write and its share of the merge.
_SPLIT_KV_MIN_SEQ_LEN = 2048
_SPLIT_KV_PROGRAMS_PER_SM = 4
_SPLIT_KV_MIN_KEYS_PER_SPLIT = 512
_SPLIT_KV_MAX_SPLITS = 64
# A batch of fewer programs than SMs (batch 1 of an 8-KV-head model: 8 programs on 132 SMs)
# splits from short contexts on: the stage-1 kernel divides the sequence's actual keys among
# the splits, so a count baked for max_model_len still spreads a short context, and the empty
# splits exit at once. Measured on an H200 (perf.decode_kernels_ab, batch 1, bf16): 8B shape
# 10.5 -> 8.0 us at 256 keys and 30.1 -> 9.8 us at 1024; 0.5B shape 8.1 -> 6.4 and 20.8 -> 6.6.
_SPLIT_KV_UNDERFILLED_MIN_SEQ_LEN = 256
_SPLIT_KV_UNDERFILLED_KEYS_PER_SPLIT = 64


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64, padding included
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    # Row of the flat batch whose logits are sampled, per request that produces a token.
    sample_indices: torch.Tensor  # [S'] int64
    sampled_requests: list[RunnerRequest]  # in sample_indices order (a verifying request: one per guess + 1)
    num_scheduled: int  # rows before padding
    # ``sample_indices`` again when those rows are all the step uses and fewer than it runs
    # (ForwardContext.output_rows: the model's tail may then run on them alone); else None.
    output_rows: Optional[torch.Tensor] = None
    # A FULL batch written into the decode buffers (its tensors are their views): nothing to
    # copy before replay (cuda_graphs.DecodeBuffers.write).
    resident: bool = False

    @property
    def num_tokens(self) -> int:
        """Rows the forward runs, padding included."""
        return self.input_ids.shape[0]

    def sampled_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sampled rows' hidden states, from the forward's output: every real row, or
        (fewer rows) the ``output_rows`` alone, already in ``sample_indices`` order."""
        if self.output_rows is not None and hidden.shape[0] == self.output_rows.shape[0]:
            return hidden
        if len(self.sampled_requests) == self.num_scheduled == hidden.shape[0]:
            return hidden  # a decode: every real row is sampled, in order (no gather)
        return hidden[self.sample_indices]


@dataclass(frozen=True)
class StageInput:
    """What a pipeline stage after the first reads in place of token ids: the previous stage's
    output, ``[T, width]`` in ``dtype`` (vgraph/distributed/pipeline.py). The builder makes it
    zeros (padding rows and dummy steps keep them); the runner receives a real step's rows into it."""

    width: int
    dtype: torch.dtype


@dataclass
class _Rows:
    """A batch on the host as flat lists (one entry per token, or per sequence for ``q_lens``,
    ``seq_lens`` and ``tables``), turned into arrays once: a decode row is one int in each,
    never a small array of its own."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    q_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]


class BatchBuilder:
    """Builds ``FlatBatch``es for one runner: its block size, device and split-KV policy."""

    def __init__(self, block_size: int, device: torch.device, num_kv_heads: int, max_model_len: int,
                 stage_input: Optional[StageInput] = None, last_stage: bool = True) -> None:
        """``stage_input``: set on a pipeline stage after the first; ``last_stage`` False on a
        stage whose every row goes on to the next (its tail never runs on sampled rows alone)."""
        self.stage_input = stage_input
        self.last_stage = last_stage
        self.block_size = block_size
        self.device = device
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len

    def build(self, step: RunnerStep, decision: Decision, resident: Optional["DecodeBuffers"] = None) -> FlatBatch:
        """Concatenates every scheduled chunk (tokens, positions, cache slots, block table
        rows), pads to ``decision.bucket``, and moves it to the device in one go per tensor:
        a FULL batch into ``resident`` (the FULL graphs' persistent buffers) when given."""
        rows, sample_rows, sampled = self._rows(step, decision.rows_per_chunk)
        num_scheduled = len(rows.ids)
        padding = decision.bucket - num_scheduled
        if padding < 0:
            raise ValueError(f"cannot pad {num_scheduled} tokens down to {decision.bucket}")
        if decision.path is Path.FULL:
            self._pad_sequences(rows, padding // decision.query_len, decision.query_len)
            if resident is not None and self.stage_input is None:
                return self._resident(rows, sample_rows, sampled, num_scheduled, decision, resident)
        else:
            self._pad_rows(rows, padding)
        meta = self._metadata(rows, decision)
        sample_indices = self._dev(np.asarray(sample_rows, dtype=np.int64))
        output_rows = sample_indices if self._tail_on_sampled_rows(step, decision, len(sample_rows),
                                                                   num_scheduled) else None
        return FlatBatch(self._inputs(np.asarray(rows.ids, dtype=np.int64)),
                         self._dev(np.asarray(rows.positions, dtype=np.int64)), meta, sample_indices, sampled,
                         num_scheduled, output_rows)

    def _resident(self, rows: _Rows, sample_rows: list[int], sampled: list[RunnerRequest], num_scheduled: int,
                  decision: Decision, resident: "DecodeBuffers") -> FlatBatch:
        """A FULL batch written into the decode buffers; a decode whose every row samples takes
        its sample rows from their persistent ``0..B-1`` too."""
        seqs = len(rows.q_lens)
        inputs = resident.write(np.asarray(rows.ids, dtype=np.int64), np.asarray(rows.positions, dtype=np.int64),
                                np.asarray(rows.slots, dtype=np.int64), np.asarray(rows.seq_lens, dtype=np.int32),
                                _block_table(rows.tables), self.max_model_len,
                                self.kv_splits(seqs, decision.query_len, self.max_model_len))
        if decision.query_len == 1 and len(sample_rows) == num_scheduled:  # rows 0..n-1, ascending
            sample_indices = resident.row_indices[:num_scheduled]
        else:
            sample_indices = self._dev(np.asarray(sample_rows, dtype=np.int64))
        return FlatBatch(inputs.input_ids, inputs.positions, inputs.attn_metadata, sample_indices, sampled,
                         num_scheduled, resident=True)

    def _inputs(self, ids: np.ndarray) -> torch.Tensor:
        """Token ids, or on a later pipeline stage the zeros its received rows go into."""
        if self.stage_input is None:
            return self._dev(ids)
        return torch.zeros((ids.shape[0], self.stage_input.width), dtype=self.stage_input.dtype, device=self.device)

    def _tail_on_sampled_rows(self, step: RunnerStep, decision: Decision, num_sampled: int,
                              num_scheduled: int) -> bool:
        """Whether the sampled rows (ascending: one per request, in batch order) are all this
        step uses of the final hidden states, and fewer than its rows: a batch with prefill
        rows, none of whose requests wants prompt logprobs or pooled states. CPU only: the
        CUDA path has not run it yet, and its PIECEWISE graphs replay whole token buckets."""
        if not self.last_stage or self.device.type != "cpu" or decision.path is Path.FULL \
                or num_sampled >= num_scheduled:
            return False
        return not any(c.request.num_prompt_logprobs is not None or c.request.pooling_type is not None
                       for c in step.chunks)

    def _rows(self, step: RunnerStep, rows_per_chunk: int) -> tuple[_Rows, list[int], list[RunnerRequest]]:
        """The chunks' rows; with ``rows_per_chunk`` each chunk is padded to that many."""
        rows = _Rows([], [], [], [], [], [])
        sample_rows, sampled = [], []
        size = self.block_size
        for item in step.chunks:
            req, n, start = item.request, item.num_new_tokens, item.start_position
            blocks = req.block_ids
            end = start + n
            if n == 1 and not item.draft_token_ids:  # a decode row: plain ints
                rows.ids.append(req.token_at(start))
                rows.positions.append(start)
                rows.slots.append(blocks[start // size] * size + start % size)
            else:
                rows.ids.extend(item.token_ids)
                rows.positions.extend(range(start, end))
                rows.slots.extend(blocks[p // size] * size + p % size for p in range(start, end))
            if item.produces_token:  # the last row, and each guess's row before it (spec/)
                last = len(rows.ids)
                if item.draft_token_ids:
                    sample_rows.extend(range(last - item.num_sampled_rows, last))
                    sampled.extend([req] * item.num_sampled_rows)
                else:
                    sample_rows.append(last - 1)
                    sampled.append(req)
            if rows_per_chunk > n:  # guesses this sequence lacks: rows that write no KV
                extra = rows_per_chunk - n
                rows.ids.extend([PAD_TOKEN_ID] * extra)
                rows.positions.extend([end - 1] * extra)  # any valid position: they are only read
                rows.slots.extend([-1] * extra)
                n, end = rows_per_chunk, start + rows_per_chunk
            rows.q_lens.append(n)
            rows.seq_lens.append(end)
            rows.tables.append(blocks)
        return rows, sample_rows, sampled

    @staticmethod
    def _pad_rows(rows: _Rows, count: int) -> None:
        """``count`` rows that belong to no sequence (past ``query_start_loc[-1]``)."""
        if count:
            rows.ids.extend([PAD_TOKEN_ID] * count)
            rows.positions.extend([0] * count)
            rows.slots.extend([-1] * count)

    @staticmethod
    def _pad_sequences(rows: _Rows, count: int, query_len: int = 1) -> None:
        """``count`` empty sequences of ``query_len`` rows each (sequence length 0: attention
        gives them zeros), so every sequence of a FULL batch has the same rows (the graph's
        ``query_start_loc`` is ``0, q, 2q, ..``)."""
        if count:
            rows.ids.extend([PAD_TOKEN_ID] * (count * query_len))
            rows.positions.extend([0] * (count * query_len))
            rows.slots.extend([-1] * (count * query_len))
            rows.q_lens.extend([query_len] * count)
            rows.seq_lens.extend([0] * count)
            rows.tables.extend([[]] * count)

    def _metadata(self, rows: _Rows, decision: Decision) -> AttentionMetadata:
        table = _block_table(rows.tables)
        qsl = np.zeros(len(rows.q_lens) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(rows.q_lens)
        max_query_len, max_seq_len = max(rows.q_lens, default=0), max(rows.seq_lens, default=0)
        if decision.path is Path.FULL:
            # A FULL graph is captured once per bucket and replayed for every context length.
            max_seq_len = self.max_model_len
        return AttentionMetadata(
            slot_mapping=self._dev(np.asarray(rows.slots, dtype=np.int64)), block_table=self._dev(table),
            query_start_loc=self._dev(qsl), seq_lens=self._dev(np.asarray(rows.seq_lens, dtype=np.int32)),
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            num_kv_splits=self.kv_splits(len(rows.q_lens), max_query_len, max_seq_len))

    def kv_splits(self, num_seqs: int, max_query_len: int, max_seq_len: int,
                  num_sms: Optional[int] = None) -> int:
        """Split-KV is a decode kernel, on CUDA, for contexts long enough to split. The count
        fills the GPU: (sequence, kv head) programs times splits against the device's SMs
        (``num_sms``, default read once from the device) times a few resident programs each,
        with at least ``_SPLIT_KV_MIN_KEYS_PER_SPLIT`` keys of ``max_seq_len`` per split, or
        ``_SPLIT_KV_UNDERFILLED_*`` for a batch of fewer programs than SMs. A FULL
        batch passes its bucket's sequence count and max_model_len, so each captured graph
        bakes one count that serves every context length."""
        if self.device.type != "cuda" or max_query_len != 1:
            return 1
        sms = num_sms if num_sms is not None else sm_count(self.device)
        programs = num_seqs * self.num_kv_heads
        underfilled = programs < sms
        min_len = _SPLIT_KV_UNDERFILLED_MIN_SEQ_LEN if underfilled else _SPLIT_KV_MIN_SEQ_LEN
        if max_seq_len < min_len:
            return 1
        keys = _SPLIT_KV_UNDERFILLED_KEYS_PER_SPLIT if underfilled else _SPLIT_KV_MIN_KEYS_PER_SPLIT
        max_splits = min(max_seq_len // keys, _SPLIT_KV_MAX_SPLITS)
        return wave_efficient_splits(programs, sms * _SPLIT_KV_PROGRAMS_PER_SM, max_splits)

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)


def _block_table(tables: list[list[int]]) -> np.ndarray:
    """The sequences' block ids as one [B, widest] int32 array, zero-padded: one flat array
    scattered through a mask, not one small assignment per sequence."""
    lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    width = int(lens.max(initial=0)) or 1
    table = np.zeros((len(tables), width), dtype=np.int32)
    flat = [b for t in tables for b in t]
    if flat:
        table[np.arange(width) < lens[:, None]] = flat
    return table
