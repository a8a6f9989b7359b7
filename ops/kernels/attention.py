"""Paged attention kernels: one "unified" kernel for mixed batches, and a split-KV decode pair.

Key tiles. Both kernels walk a sequence's keys TILE_N at a time (32 or 64 keys for 16-bit
caches), not one cache block (16 keys) at a time: a tile's key positions are mapped to their
cache blocks by a gather from the block table (``k_pos // block_size``), so a tile spans
several blocks, and a block may be larger than a tile or not divide it. Why: a 16-key step
does little work per loop iteration (two thin dots between dependent loads), and every query
block of a prompt re-reads all the K/V before it, so a prefill's K/V traffic is inversely
proportional to the query rows per program: 128 rows read it half as often as 64.
These are the shapes of FlashAttention's and vLLM's Triton prefill tiles. ``attention_tiles``
chooses them on the host, and the tests enumerate it.

Unified kernel (``paged_attention_triton``): grid ``(cdiv(max_query_len, BLOCK_Q), num_seqs,
kv_heads)``. A program owns BLOCK_Q query tokens of one sequence times the G = Hq / Hkv query
heads that share one KV head, packed into BLOCK_M = BLOCK_Q * G (padded) rows, so each K/V
tile it loads is reused by the whole GQA group. Query blocks run last-first (they have the
most keys under the causal mask, so the long programs start first), and neighbouring
programs are query blocks of the same sequence and head, which share K/V through L2. Tiles
wholly below the causal diagonal skip the mask; the rest apply it at absolute positions
(query token j of a sequence sits at ``seq_len - query_len + j``). The softmax is online, in
fp32. Programs whose query block lies past the sequence's query length, or whose sequence is
padding (seq_len 0), exit at once. ``max_query_len`` is a host int, so a launch never waits
on the device and can be captured in a CUDA graph.

Split-KV decode (``paged_attention_decode_split_kv_triton``): for one query token per
sequence and long contexts, the unified grid has too few programs to fill the GPU. Stage 1
uses grid ``(num_seqs, kv_heads, num_splits)``; each program attends over its share of the
sequence's key tiles and writes a normalized partial output plus its log-sum-exp (fp32
scratch). Stage 2, grid ``(num_seqs, q_heads)``, rescales and sums the partials. A split
with no keys has lse = -inf and weight 0, so it adds nothing and never makes a NaN.

Specialization: Triton specializes integer arguments on their value (1, or a multiple of
16), so a block table whose width changes between eager steps would compile a new kernel.
The block table's row stride and the split count are ``do_not_specialize``.

Offsets: a block id times the cache's block stride can pass 2^31 elements (a cache of more
than 4 GiB in bf16), so block ids are widened to int64 before the multiply, as are token
and sequence indices that multiply a row stride.

fp8 KV cache (``KV_FP8``): tiles are loaded as e4m3 and widened to q's dtype (exact: every
e4m3 value is a bf16, fp16 and fp32 value), so the dots run as for a 16-bit cache. The
per-tensor scales are folded in rather than applied per element: softmax(q . (k * ks)) =
softmax((q . k) * ks), so ``k_scale`` multiplies the score scale once per program, and
sum(p * v * vs) / l = vs * sum(p * v) / l, so ``v_scale`` multiplies the output once. Both
are loaded from their one-element tensors on the device, so CUDA graphs follow them.

Dots: head_dim is padded to a power of two >= 16 and tiles are >= 16 (tl.dot's minimum),
with masks. Under the interpreter dot operands are upcast to fp32 (``DOT_UPCAST``); fp32
dots use IEEE precision so compiled fp32 results are not rounded through TF32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .common import DOT_UPCAST, kv_scale_args, next_pow2, pdl_enter, pdl_launch

LOG2E = math.log2(math.e)
MIN_DOT = 16
# Query rows per program, by padded head_dim: the fp32 accumulator is BLOCK_M x BLOCK_D;
# 128 x 128 (64 KiB of registers over 8 warps) and 64 x 256 compile for sm_90 without
# spills (tests/ops/sm90_compile.py).
_MAX_ROWS_NARROW_HEAD = 128
_MAX_ROWS_WIDE_HEAD = 64
_WIDE_HEAD = 128  # padded head_dim above this is "wide"
_TILE_NARROW_HEAD = 64
_TILE_WIDE_HEAD = 32
# Accumulators of at least this many fp32 elements get 8 warps, smaller ones 4.
_EIGHT_WARPS_FROM = 128 * 128


@dataclass(frozen=True)
class AttentionTiles:
    """The launch shape of the attention kernels for one (GQA group, query length, head_dim)."""

    block_m: int  # query rows per program: BLOCK_Q tokens x GQA group, padded to a power of two
    block_q: int  # query tokens per program
    tile_n: int  # keys per inner-loop step, gathered across cache blocks
    block_d: int  # head_dim padded to a power of two
    num_warps: int


def attention_tiles(group: int, max_query_len: int, head_dim: int,
                    elem_bytes: int = 2, fp8_cache: bool = False) -> AttentionTiles:
    """Tile shapes for a launch over a cache of ``elem_bytes``-byte elements.

    16-bit caches: decode (one query token) gets the smallest row block that holds the GQA
    group (>= 16 for tl.dot); longer queries get up to 128 rows, and at least one whole GQA
    group. Key tiles are 64 wide. Wide heads (padded head_dim > 128) take 64 rows and
    32-key tiles: 128 x 256 compiles for sm_90 too, but at 239 registers and 128 KiB of
    shared memory, one program per SM with no headroom. All chosen shapes compile for sm_90
    without spills (tests/ops/sm90_compile.py). fp32 caches are the exactness path: their
    IEEE dots run without tensor cores and spilled at every prefill tile tried above 16 x 16
    (32-128 rows, 16-64 keys), so they keep the smallest rows and 16-key tiles.

    ``elem_bytes`` is q's (an fp8 cache's tiles are widened to q's dtype). fp32 q over an fp8
    cache (``fp8_cache``) takes 8 warps: with 4, widening e4m3 tiles to fp32 for the IEEE dots
    took 255 registers and spilled 1 KiB at every shape tried for sm_90; with 8, 170 and none.
    """
    block_d = max(MIN_DOT, next_pow2(head_dim))
    min_rows = max(MIN_DOT, next_pow2(group))
    if elem_bytes > 2:
        return AttentionTiles(block_m=min_rows, block_q=min_rows // group, tile_n=MIN_DOT,
                              block_d=block_d, num_warps=8 if fp8_cache else 4)
    wide = block_d > _WIDE_HEAD
    max_rows = _MAX_ROWS_WIDE_HEAD if wide else _MAX_ROWS_NARROW_HEAD
    block_m = max(min_rows, min(max_rows, next_pow2(max(max_query_len, 1) * group)))
    warps = 8 if block_m * block_d >= _EIGHT_WARPS_FROM else 4
    return AttentionTiles(block_m=block_m, block_q=block_m // group,
                          tile_n=_TILE_WIDE_HEAD if wide else _TILE_NARROW_HEAD,
                          block_d=block_d, num_warps=warps)


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_row, k_pos, kv_mask, kv_head, dims, dim_mask,
                  stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE: tl.constexpr):
    """K^T [BLOCK_D, TILE_N] and V [TILE_N, BLOCK_D] of the keys at ``k_pos``, gathered from
    whichever cache blocks hold them; masked-off keys read nothing and come back 0."""
    phys = tl.load(block_row + k_pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
    key_off = phys * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    k = tl.load(k_cache_ptr + key_off[None, :] + dims[:, None] * stride_cd,
                mask=kv_mask[None, :] & dim_mask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + key_off[:, None] + dims[None, :] * stride_cd,
                mask=kv_mask[:, None] & dim_mask[None, :], other=0.0)
    return k, v


@triton.jit
def _softmax_step(q, k, v, acc, m_i, l_i, allowed, scale_log2, MASKED: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """One online-softmax step over a key tile; ``allowed`` [BLOCK_M, TILE_N] is applied
    only when MASKED (tiles below the causal diagonal and inside the sequence need none).
    KV_FP8: the tile is e4m3, widened to q's dtype here (its scales are applied outside)."""
    if KV_FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no allowed key so far keeps m = -inf; exponentiate against 0 instead so
    # that p and alpha come out 0 rather than NaN.
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                            block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
                            k_scale_ptr, v_scale_ptr, scale_log2, head_dim,
                            stride_qt, stride_qh, stride_qd,
                            stride_ot, stride_oh, stride_od,
                            stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
                            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                            TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr,
                            UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                            KV_FP8: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    first_tok = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_Q  # longest blocks first
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if (first_tok >= q_len) | (seq_len <= 0):
        return  # nothing to do; padding rows keep the zeros the launcher wrote
    context_len = seq_len - q_len
    if KV_FP8:  # k_scale folds into the score scale (module doc)
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    io_mask = row_mask[:, None] & dim_mask[None, :]
    row_tok = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + row_tok[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    # Keys this program can see: up to the position of its last query token. Every row sees
    # the keys up to its first token's position, so whole tiles before that need no mask.
    kv_end = context_len + tl.minimum(q_len, first_tok + BLOCK_Q)
    unmasked_tiles = (context_len + first_tok + 1) // TILE_N
    for t in range(0, unmasked_tiles):
        k_pos = t * TILE_N + offs_n
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_row, k_pos, k_pos < kv_end, kv_head,
                             dims, dim_mask, stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE)
        acc, m_i, l_i = _softmax_step(q, k, v, acc, m_i, l_i, None, scale_log2, False,
                                      UPCAST, DOT_PRECISION, KV_FP8)
    for t in range(unmasked_tiles, tl.cdiv(kv_end, TILE_N)):
        k_pos = t * TILE_N + offs_n
        kv_mask = k_pos < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_row, k_pos, kv_mask, kv_head,
                             dims, dim_mask, stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE)
        allowed = kv_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        acc, m_i, l_i = _softmax_step(q, k, v, acc, m_i, l_i, allowed, scale_log2, True,
                                      UPCAST, DOT_PRECISION, KV_FP8)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:  # and v_scale into the output
        out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + row_tok[:, None] * stride_ot + head[:, None] * stride_oh
             + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _split_kv_stage1_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
                            block_table_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
                            scale_log2, head_dim, num_q_heads, num_splits,
                            stride_qt, stride_qh, stride_qd,
                            stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
                            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                            KV_FP8: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), num_splits)
    tile_start = split * per_split
    tile_end = tl.minimum(tile_start + per_split, tl.cdiv(seq_len, TILE_N))
    full_tiles = seq_len // TILE_N  # tiles with no key past the sequence's end
    if KV_FP8:  # k_scale folds into the score scale (module doc)
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_start, tl.minimum(tile_end, full_tiles)):
        k_pos = t * TILE_N + offs_n
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_row, k_pos, k_pos < seq_len, kv_head,
                             dims, dim_mask, stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE)
        acc, m_i, l_i = _softmax_step(q, k, v, acc, m_i, l_i, None, scale_log2, False,
                                      UPCAST, DOT_PRECISION, KV_FP8)
    for t in range(tl.maximum(tile_start, full_tiles), tile_end):  # the partial last tile
        k_pos = t * TILE_N + offs_n
        kv_mask = k_pos < seq_len
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_row, k_pos, kv_mask, kv_head,
                             dims, dim_mask, stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE)
        acc, m_i, l_i = _softmax_step(q, k, v, acc, m_i, l_i, kv_mask[None, :], scale_log2, True,
                                      UPCAST, DOT_PRECISION, KV_FP8)

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part = (seq.to(tl.int64) * num_q_heads + head) * num_splits + split
    tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], out,
             mask=row_mask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _split_kv_stage2_kernel(part_out_ptr, part_lse_ptr, out_ptr, head_dim, num_q_heads,
                            num_splits, stride_ot, stride_oh, stride_od,
                            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    part = (seq * num_q_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    weights = tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0))  # empty split -> weight 0
    total = tl.sum(weights, axis=0)
    partial = tl.load(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :],
                      mask=split_mask[:, None], other=0.0)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def _dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast dot operands?, dot input precision) for a cache dtype."""
    upcast = DOT_UPCAST
    return upcast, "ieee" if upcast or dtype == torch.float32 else "tf32"


def _check_same_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have identical strides")


def _zeroed_output(q: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """Zeros shaped like ``q``: a new tensor, or ``out`` cleared (the kernels write only the
    rows of real sequences; padding rows must read as zeros)."""
    return _checked_output(q, out).zero_() if out is not None else q.new_zeros(q.shape)


def _checked_output(q: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """``out``, checked against ``q``, or a new uninitialized tensor like it: for a kernel
    that writes every element itself."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"attention output {tuple(out.shape)} {out.dtype} on {out.device} does not "
                         f"match q {tuple(q.shape)} {q.dtype} on {q.device}")
    return out


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, max_query_len: int,
                           softmax_scale: float, out: Optional[torch.Tensor] = None,
                           k_scale: Optional[torch.Tensor] = None,
                           v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal paged attention for a flat batch of variable-length queries; see module doc.

    Rows of ``q`` outside every sequence (and rows of padding sequences) come back as zeros.
    ``out``: a tensor shaped like ``q`` to write the result into (and return), so a caller
    that keeps its output at one address (PIECEWISE graphs) needs no copy afterwards.
    ``k_scale``/``v_scale``: an fp8 cache's per-tensor scales.
    """
    _check_same_layout(k_cache, v_cache)
    out = _zeroed_output(q, out)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len <= 0 or q.shape[0] == 0:
        return out
    group = q.shape[1] // k_cache.shape[2]
    # Tiles and dot precision follow q's dtype: an fp8 cache's tiles are widened to it.
    k_scale_t, v_scale_t, kv_fp8 = kv_scale_args(k_cache, k_scale, v_scale)
    tiles = attention_tiles(group, max_query_len, k_cache.shape[3], q.element_size(), kv_fp8)
    upcast, precision = _dot_settings(q.dtype)
    grid = (triton.cdiv(max_query_len, tiles.block_q), num_seqs, k_cache.shape[2])
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, query_start_loc, seq_lens, k_scale_t, v_scale_t,
        softmax_scale * LOG2E, k_cache.shape[3],
        *q.stride(), *out.stride(), *k_cache.stride(), block_table.stride(0),
        GROUP=group, BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_q, TILE_N=tiles.tile_n,
        BLOCK_D=tiles.block_d, BLOCK_SIZE=k_cache.shape[1],
        UPCAST=upcast, DOT_PRECISION=precision, KV_FP8=kv_fp8, num_warps=tiles.num_warps,
        **pdl_launch(q.device))
    return out


def effective_splits(num_splits: int, table_width: int, block_size: int, tile_n: int) -> int:
    """The split count a launch uses: at least 1, and no more than the key tiles the block
    table can hold (a split with less than a tile to own only adds work to stage 2)."""
    return max(1, min(int(num_splits), triton.cdiv(table_width * block_size, tile_n)))


def paged_attention_decode_split_kv_triton(q: torch.Tensor, k_cache: torch.Tensor,
                                           v_cache: torch.Tensor, block_table: torch.Tensor,
                                           seq_lens: torch.Tensor, softmax_scale: float,
                                           num_splits: int,
                                           out: Optional[torch.Tensor] = None,
                                           k_scale: Optional[torch.Tensor] = None,
                                           v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention (one query token per sequence) split over the KV length; see module doc.

    ``num_splits`` is capped by the key tiles the block table can hold. ``out``, ``k_scale``
    and ``v_scale`` as in ``paged_attention_triton``.
    """
    _check_same_layout(k_cache, v_cache)
    num_seqs, num_q_heads, head_dim = q.shape
    # Stage 2 writes every element of every (sequence, head), an empty sequence's as zeros
    # (its splits hold no keys): no clearing kernel first (one a layer at batch 1).
    out = _checked_output(q, out)
    if num_seqs == 0:
        return out
    group = num_q_heads // k_cache.shape[2]
    k_scale_t, v_scale_t, kv_fp8 = kv_scale_args(k_cache, k_scale, v_scale)
    tiles = attention_tiles(group, 1, head_dim, q.element_size(), kv_fp8)
    num_splits = effective_splits(num_splits, block_table.shape[1], k_cache.shape[1],
                                         tiles.tile_n)
    upcast, precision = _dot_settings(q.dtype)
    part_out = torch.empty((num_seqs, num_q_heads, num_splits, tiles.block_d), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32,
                           device=q.device)
    _split_kv_stage1_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, part_out, part_lse, block_table, seq_lens, k_scale_t, v_scale_t,
        softmax_scale * LOG2E, head_dim, num_q_heads, num_splits,
        *q.stride(), *k_cache.stride(), block_table.stride(0),
        GROUP=group, BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n, BLOCK_D=tiles.block_d,
        BLOCK_SIZE=k_cache.shape[1], UPCAST=upcast, DOT_PRECISION=precision, KV_FP8=kv_fp8,
        num_warps=tiles.num_warps, **pdl_launch(q.device))
    _split_kv_stage2_kernel[(num_seqs, num_q_heads)](
        part_out, part_lse, out, head_dim, num_q_heads, num_splits, *out.stride(),
        BLOCK_S=next_pow2(num_splits), BLOCK_D=tiles.block_d,
        num_warps=1 if tiles.block_d <= 128 else 2, **pdl_launch(q.device))
    return out
