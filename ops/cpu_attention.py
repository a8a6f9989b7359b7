"""Batched CPU paged attention: the CPU kernels of ``vgraph::paged_attention`` and its split-KV.

The reference (``attention.paged_attention_reference``) loops over sequences in Python; a
decode step of 64 sequences x 8 layers is 512 tiny gathers and attentions, and that loop
dominated the CPU engine's decode. Here a group of sequences costs a fixed number of ops:
one ``index_select`` of their K/V rows into a padded ``[S, L, Hkv, D]`` tensor, one boolean
causal mask ``[S, max_q, L]``, and one ``scaled_dot_product_attention`` call. On the 2-core
CPU, decode of 64 sequences of 16-300 tokens (Hq 8, Hkv 4, D 64): ~20 ms -> ~7 ms per call.
At that size the op is bound by memory traffic, not Python, hence the gather design below:
one pass to gather, one to read, cache-sized groups, and no page faults (``_Workspace``).

SDPA rather than a hand-written masked softmax: on CPU it runs a fused flash kernel that
handles GQA without ``repeat_interleave``, reads the gathered K/V through strides (no
transpose copies) and never materialises the ``[S, Hq, max_q, L]`` scores, so the padded
K/V is read once. It accumulates in fp32 for every dtype; fp32 results agree with the
reference's plain softmax to ~1e-7 relative. Half-precision inputs are not upcast first
(the reference does), which stays well inside the half-type tolerance.

Work is split into *segments* (a run of query rows of one sequence). With the C++ kernels
(``cpu_attention_native``), short segments (decode rows) go to the short-segment kernel and
every longer one (prefills, chunks, prefix-cache hits) to the prefill kernel, both reading
the paged cache in place; the SDPA routes below then serve only when the kernels are off
(``VGRAPH_CPU_ATTENTION=torch``, no compiler) or cannot take the inputs. There, a prefill
with no cached context runs SDPA alone with ``is_causal``, which needs no mask and skips the
upper triangle. The rest are tiled into row ranges and grouped so that a group's padded mask
and gathered K/V stay under fixed budgets, and so that short rows are not padded to the
length of a long prefill in the same batch. The split is planned once per forward
(``cached_plan``) and reused by every layer.

An fp8 KV cache goes to the C++ kernels too, which read its rows times their scale. Where
SDPA serves instead, its gathered rows are dequantized into q's dtype (``cached * scale``,
``kv_cache.dequantize_kv``) before SDPA, so the gather still moves one byte per element.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_attention_native as native
from .forward_context import metadata_memo
from .kv_cache import dequantize_kv, is_fp8_cache

# (k_scale, v_scale) of an fp8 cache; None each for 1.0, and for any other cache.
KVScales = tuple[Optional[Tensor], Optional[Tensor]]
NO_SCALES: KVScales = (None, None)

# Most (query row, key) pairs one group may cover: its bool mask, which SDPA turns into a
# float one (64 MiB). Long prefills are tiled by query rows to stay under it.
PAIR_BUDGET = 1 << 24
# Most bytes of gathered K (and as many of V) one group may hold. A group's K/V then stay in
# cache between the gather and the attention, and fit the reused per-thread buffers (see
# ``_Workspace``). Measured on a 2-core CPU, decode of 64 sequences: 1-4 MiB is ~2x faster
# than 16 MiB or than one group for the whole batch. A single sequence longer than this is
# still gathered whole (into a fresh tensor), as the reference does.
KV_BUDGET_BYTES = 4 << 20
# Padding a group may add beyond 5/4 of its useful (row, key) pairs: small enough that a
# decode row never pads to a long prefill's length, large enough that a decode batch of
# mixed lengths stays one group (each extra group costs a fixed ~25 ops of overhead).
PADDING_SLACK = 1 << 16


@dataclass(frozen=True)
class Segment:
    """Query rows ``start:start + q_len`` of sequence ``seq``: the last rows of ``seq_len`` keys."""

    seq: int
    start: int
    q_len: int
    seq_len: int


def sequence_segments(query_start_loc: Tensor, seq_lens: Tensor, num_rows: int,
                      max_query_len: int) -> list[Segment]:
    """One segment per sequence with work to do, after the reference's host-side checks.

    Padding sequences (``seq_len == 0``) and empty queries get no segment: their rows stay
    zero. The error messages match ``paged_attention_reference`` so callers see one contract.
    """
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    segments = []
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if not 0 <= start <= end <= num_rows:
            raise ValueError(f"sequence {i}: query rows {start}:{end} outside q's {num_rows} rows")
        if end - start > max_query_len:
            raise ValueError(f"sequence {i}: query length {end - start} > "
                             f"max_query_len {max_query_len}")
        if seq_len == 0 or end == start:
            continue
        if seq_len < end - start:
            raise ValueError(f"sequence {i}: seq_len {seq_len} < query length {end - start}")
        segments.append(Segment(i, start, end - start, seq_len))
    return segments


def tile_segment(seg: Segment, pair_budget: int) -> list[Segment]:
    """Splits a long segment into row tiles of at most ``pair_budget`` (row, key) pairs.

    Tile ``r0:r1`` is causal too, so it only needs keys up to its last row's position.
    """
    rows = max(1, pair_budget // seg.seq_len)
    if seg.q_len <= rows:
        return [seg]
    context = seg.seq_len - seg.q_len
    return [Segment(seg.seq, seg.start + r0, min(rows, seg.q_len - r0),
                    context + min(r0 + rows, seg.q_len))
            for r0 in range(0, seg.q_len, rows)]


def group_segments(segments: list[Segment], pair_budget: int, kv_rows_budget: int,
                   slack: int = PADDING_SLACK) -> Iterator[list[Segment]]:
    """Groups segments, shortest queries first, so each group's padding stays cheap.

    A group of n segments is padded to ``n x max_q x max_len`` (row, key) pairs and
    ``n x max_len`` gathered K/V rows. A segment joins the current group while the pairs
    stay within ``pair_budget`` and within 5/4 of the useful pairs plus ``slack``, and the
    K/V rows within ``kv_rows_budget``.
    """
    group: list[Segment] = []
    useful = max_len = 0
    for seg in sorted(segments, key=lambda s: (s.q_len, s.seq_len)):
        new_useful, new_len = useful + seg.q_len * seg.seq_len, max(max_len, seg.seq_len)
        pairs = (len(group) + 1) * seg.q_len * new_len  # sorted: seg.q_len is the group's max
        too_big = (pairs > min(pair_budget, new_useful * 5 // 4 + slack)
                   or (len(group) + 1) * new_len > kv_rows_budget)
        if group and too_big:
            yield group
            group, new_useful, new_len = [], seg.q_len * seg.seq_len, seg.seq_len
        group.append(seg)
        useful, max_len = new_useful, new_len
    if group:
        yield group


def _int_tensor(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def cache_slots(block_table: Tensor, seqs: Tensor, seq_lens: Tensor, num_keys: int,
                block_size: int) -> Tensor:
    """``[S, num_keys]`` cache slot of each sequence's key positions.

    Positions past a sequence's end read its position 0 instead: always written, so finite,
    and masked out. Their table entries may be stale or garbage, and an unwritten slot may
    hold NaN, which a zero softmax weight would still turn into a NaN output.
    """
    pos = torch.arange(num_keys, device=seqs.device)[None, :]
    pos = torch.where(pos < seq_lens[:, None], pos, 0)
    blocks = torch.gather(block_table[seqs].long(), 1, pos // block_size)
    return blocks * block_size + pos % block_size


class _Workspace(threading.local):
    """Per-thread K and V gather buffers of ``KV_BUDGET_BYTES``, reused across calls.

    Fresh multi-MiB tensors each call are returned to the OS by glibc's heap trimming and
    page-faulted back on the next call: thousands of faults per layer, which cost as much as
    the attention itself. Two resident buffers (8 MiB per thread) avoid that. They are
    allocated outside inference mode so that writing them is legal in and out of it.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, Tensor] = {}

    def get(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor | None:
        """A ``shape`` view of buffer ``name``, or None when it does not fit the budget."""
        nbytes = dtype.itemsize * torch.Size(shape).numel()
        if nbytes > KV_BUDGET_BYTES:
            return None
        if name not in self.buffers:
            with torch.inference_mode(False):
                self.buffers[name] = torch.empty(KV_BUDGET_BYTES, dtype=torch.uint8)
        return self.buffers[name][:nbytes].view(dtype).view(shape)


_WORKSPACE = _Workspace()


def gather_kv(cache: Tensor, slots: Tensor, buffer: str | None = None) -> Tensor:
    """``[S, L, Hkv, D]`` rows of ``cache`` at ``slots`` [S, L], in one ``index_select``.

    ``index_select`` on the flat ``[slots, Hkv, D]`` view is one copy pass, several times
    faster here than advanced indexing; the result is read through strides, never copied.
    With ``buffer`` it lands in that workspace buffer (valid until the next gather into it).
    """
    flat = cache.flatten(0, 1)
    shape = (slots.numel(), *flat.shape[1:])
    out = None
    if buffer is not None and cache.device.type == "cpu":
        out = _WORKSPACE.get(buffer, cache.dtype, shape)
    if out is None:
        out = flat.new_empty(shape)
    torch.index_select(flat, 0, slots.flatten(), out=out)
    return out.view(*slots.shape, *flat.shape[1:])


def causal_mask(q_lens: Tensor, seq_lens: Tensor, max_q: int, num_keys: int) -> Tensor:
    """``[S, max_q, num_keys]``: query row j of a sequence sits at ``seq_len - q_len + j``.

    Padded rows (``j >= q_len``) still see key 0 (every segment has ``seq_len >= 1``), so no
    row is fully masked and the softmax never produces NaN; those rows are discarded.
    """
    rows = torch.arange(max_q, device=q_lens.device)
    keys = torch.arange(num_keys, device=q_lens.device)
    q_pos = (seq_lens - q_lens)[:, None] + rows[None, :]
    keys = keys[None, None, :]
    return (keys <= q_pos[:, :, None]) & (keys < seq_lens[:, None, None])


def attend_group(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                 segments: list[Segment], scale: float, out: Tensor,
                 kv_scales: KVScales = NO_SCALES) -> None:
    """Attention for one group of segments, written into their rows of ``out``."""
    device = q.device
    starts = _int_tensor([s.start for s in segments], device)
    q_lens = _int_tensor([s.q_len for s in segments], device)
    seq_lens = _int_tensor([s.seq_len for s in segments], device)
    max_q, max_len = max(s.q_len for s in segments), max(s.seq_len for s in segments)
    slots = cache_slots(block_table, _int_tensor([s.seq for s in segments], device), seq_lens,
                        max_len, k_cache.shape[1])
    # Padded query slots repeat the segment's last row, so they index real rows of q.
    row_offsets = torch.arange(max_q, device=device)
    rows = starts[:, None] + torch.minimum(row_offsets[None, :], q_lens[:, None] - 1)
    keys = dequantize_kv(gather_kv(k_cache, slots, "k"), kv_scales[0], q.dtype)
    values = dequantize_kv(gather_kv(v_cache, slots, "v"), kv_scales[1], q.dtype)
    result = F.scaled_dot_product_attention(
        q[rows].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=causal_mask(q_lens, seq_lens, max_q, max_len)[:, None], scale=scale,
        enable_gqa=True).transpose(1, 2)                                # [S, max_q, Hq, D]
    real = row_offsets[None, :] < q_lens[:, None]
    out.index_copy_(0, rows[real], result[real])


def attend_fresh_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                         seg: Segment, scale: float, out: Tensor,
                         new_kv: tuple[Tensor, Tensor] | None = None,
                         kv_scales: KVScales = NO_SCALES) -> None:
    """A prefill with no cached context, whose queries are all its keys: SDPA with
    ``is_causal``, which skips the blocks above the diagonal instead of computing them under
    a mask as a padded group must (1.5x faster on the offline suite's prefill).

    ``new_kv``: the step's own K/V rows (aligned with q's rows), which are exactly what the
    cache holds for this sequence; reading them saves gathering them back (a third of the
    attention's time at 64-136-token prompts)."""
    if new_kv is not None:
        keys, values = (t[seg.start:seg.start + seg.q_len] for t in new_kv)
    else:
        device = q.device
        slots = cache_slots(block_table, _int_tensor([seg.seq], device), _int_tensor([seg.seq_len], device),
                            seg.seq_len, k_cache.shape[1])
        keys = dequantize_kv(gather_kv(k_cache, slots, "k")[0], kv_scales[0], q.dtype)
        values = dequantize_kv(gather_kv(v_cache, slots, "v")[0], kv_scales[1], q.dtype)
    rows = q[seg.start:seg.start + seg.q_len]
    result = F.scaled_dot_product_attention(
        rows.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True)
    out[seg.start:seg.start + seg.q_len] = result[0].transpose(0, 1)


def check_block_table_width(segments: list[Segment], block_table: Tensor, block_size: int) -> None:
    """Every segment's blocks must be in its table row (the reference would fail on a shape)."""
    width = block_table.shape[1]
    for seg in segments:
        if -(-seg.seq_len // block_size) > width:
            raise ValueError(f"sequence {seg.seq}: seq_len {seg.seq_len} needs more than the "
                             f"block table's {width} blocks of {block_size}")


@dataclass(frozen=True)
class Plan:
    """One batch's work list, checked: the C++ kernels' segments and the SDPA path's."""

    short: Tensor | None  # int64 [n, 4] (sequence, first row, rows, seq_len): short-segment kernel
    tiled: Tensor | None  # the same for the C++ prefill kernel (longer segments)
    native_rows: int      # rows those two cover
    fresh: list[Segment]  # SDPA path: prefills with no cached context (every key is a query)
    long: list[Segment]   # SDPA path: the rest, grouped and masked


def _segment_spec(segments: list[Segment]) -> Tensor | None:
    rows = [(s.seq, s.start, s.q_len, s.seq_len) for s in segments]
    return torch.tensor(rows, dtype=torch.int64) if rows else None


def plan_batch(q: Tensor, k_cache: Tensor, block_table: Tensor, query_start_loc: Tensor,
               seq_lens: Tensor, max_query_len: int, native_kernel: bool) -> Plan:
    """Splits the batch between the routes: segments of at most ``MAX_QUERY_ROWS`` rows go to
    the short-segment C++ kernel, longer ones to the C++ prefill kernel, unless
    ``native_kernel`` is False or the kernels cannot take the inputs (then SDPA)."""
    segments = sequence_segments(query_start_loc, seq_lens, q.shape[0], max_query_len)
    check_block_table_width(segments, block_table, k_cache.shape[1])
    rest, short, tiled = segments, [], []
    if native_kernel and segments and native.supports(q, k_cache):
        if native.enabled():
            short = [s for s in rest if s.q_len <= native.MAX_QUERY_ROWS]
            rest = [s for s in rest if s.q_len > native.MAX_QUERY_ROWS]
        if native.prefill_enabled():
            tiled, rest = rest, []
    return Plan(_segment_spec(short), _segment_spec(tiled), sum(s.q_len for s in short + tiled),
                [s for s in rest if s.q_len == s.seq_len], [s for s in rest if s.q_len != s.seq_len])


def cached_plan(q: Tensor, k_cache: Tensor, block_table: Tensor, query_start_loc: Tensor,
                seq_lens: Tensor, max_query_len: int, native_kernel: bool) -> Plan:
    """``plan_batch``, computed once per forward when the tensors are the forward's metadata
    (every layer then reuses it: ~60 us of host work per layer on a decode step)."""
    memo = metadata_memo(block_table, query_start_loc, seq_lens)
    if memo is None:
        return plan_batch(q, k_cache, block_table, query_start_loc, seq_lens, max_query_len, native_kernel)
    key = ("cpu_attention.plan", q.shape[0], max_query_len, k_cache.shape[1],
           native_kernel and native.supports(q, k_cache))
    plan = memo.get(key)
    if plan is None:
        plan = memo[key] = plan_batch(q, k_cache, block_table, query_start_loc, seq_lens,
                                      max_query_len, native_kernel)
    return plan


def attend_native_in_place(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                           plan: Plan, scale: float, kv_scales: KVScales = NO_SCALES) -> Tensor:
    """The C++ kernels' rows of the output; zeros elsewhere (the SDPA path fills its rows)."""
    covered = plan.native_rows + sum(s.q_len for s in plan.fresh) + sum(s.q_len for s in plan.long)
    if plan.native_rows == 0:  # rows no segment covers (padding) must read zero
        return q.new_empty(q.shape) if covered == q.shape[0] else q.new_zeros(q.shape)
    every_row = plan.native_rows == q.shape[0]  # then the kernels write every row themselves
    out = (torch.empty if every_row else torch.zeros)(q.shape, dtype=torch.float32)
    for spec, long_segments in ((plan.short, False), (plan.tiled, True)):
        if spec is not None:
            native.attend_segments(q, k_cache, v_cache, block_table, spec, scale, out, long_segments,
                                   kv_scales)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def paged_attention_cpu(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                        query_start_loc: Tensor, seq_lens: Tensor, max_query_len: int,
                        softmax_scale: float, pair_budget: int = PAIR_BUDGET,
                        kv_budget_bytes: int = KV_BUDGET_BYTES, native_kernel: bool = True,
                        new_kv: tuple[Tensor, Tensor] | None = None,
                        kv_scales: KVScales = NO_SCALES) -> Tensor:
    """Same contract and results as ``paged_attention_reference``, batched over sequences.

    With ``native_kernel`` (the default; the perf suite times both paths) every segment goes
    to one of the in-place C++ kernels. Otherwise, or when they cannot take the inputs,
    prefills without cached context go to causal SDPA, one sequence each, and the rest to
    grouped, masked SDPA.

    Shapes and dtypes are checked by the caller (the op registration); the metadata is read
    on the host here, which is cheap on CPU and lets the batch be grouped by length.
    ``new_kv``: the K/V rows this step wrote into the cache, one per row of q, in the cache's
    dtype (``vgraph::unified_attention`` has them); fresh prefills then read them directly.
    ``kv_scales``: an fp8 cache's (k_scale, v_scale).
    """
    if new_kv is not None and is_fp8_cache(k_cache):
        raise ValueError("new_kv cannot stand in for an fp8 cache's rows, which are quantized")
    plan = cached_plan(q, k_cache, block_table, query_start_loc, seq_lens, max_query_len, native_kernel)
    out = attend_native_in_place(q, k_cache, v_cache, block_table, plan, softmax_scale, kv_scales)
    for seg in plan.fresh:
        attend_fresh_prefill(q, k_cache, v_cache, block_table, seg, softmax_scale, out, new_kv, kv_scales)
    tiles = [tile for seg in plan.long for tile in tile_segment(seg, pair_budget)]
    # An fp8 group is also held dequantized, in q's dtype: budget by the larger of the two.
    row_bytes = k_cache.shape[2] * k_cache.shape[3] * max(k_cache.element_size(), q.element_size())
    kv_rows_budget = kv_budget_bytes // row_bytes
    for group in group_segments(tiles, pair_budget, kv_rows_budget):
        attend_group(q, k_cache, v_cache, block_table, group, softmax_scale, out, kv_scales)
    return out


def paged_attention_decode_split_kv_cpu(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                        block_table: Tensor, seq_lens: Tensor,
                                        softmax_scale: float, num_splits: int,
                                        kv_scales: KVScales = NO_SCALES) -> Tensor:
    """Split-KV decode on CPU: one query row per sequence; the split count changes nothing here."""
    del num_splits  # only shapes the GPU grid
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_cpu(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, 1,
                               softmax_scale, kv_scales=kv_scales)
