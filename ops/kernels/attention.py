"""Paged attention kernels: one "unified" kernel for mixed batches, and a split-KV decode pair.

Unified kernel (``paged_attention_triton``): grid ``(num_seqs, cdiv(max_query_len, BLOCK_Q),
kv_heads)``. A program owns BLOCK_Q query tokens of one sequence times the G = Hq / Hkv query
heads that share one KV head, packed into BLOCK_M = BLOCK_Q * G (padded) rows, so each K/V
tile it loads is reused by the whole GQA group. It walks the sequence's cache blocks through
the block table (BLOCK_N = block_size keys at a time), applies the causal mask at absolute
positions (query token j of a sequence sits at ``seq_len - query_len + j``) and keeps an
online softmax in fp32. Programs whose query block lies past the sequence's query length, or
whose sequence is padding (seq_len 0), exit at once. ``max_query_len`` is a host int, so a
launch never waits on the device and can be captured in a CUDA graph.

Split-KV decode (``paged_attention_decode_split_kv_triton``): for one query token per
sequence and long contexts, the unified grid has too few programs to fill the GPU. Stage 1
uses grid ``(num_seqs, kv_heads, num_splits)``; each program attends over its share of the
sequence's cache blocks and writes a normalized partial output plus its log-sum-exp (fp32
scratch). Stage 2, grid ``(num_seqs, q_heads)``, rescales and sums the partials. A split
with no keys has lse = -inf and weight 0, so it adds nothing and never makes a NaN.

Dots: head_dim is padded to a power of two >= 16 and block_size to one >= 16 (tl.dot's
minimum), with masks. Under the interpreter dot operands are upcast to fp32 (``DOT_UPCAST``);
fp32 dots use IEEE precision so compiled fp32 results are not rounded through TF32.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import DOT_UPCAST, next_pow2

LOG2E = math.log2(math.e)
_MIN_DOT = 16
# Rows (query tokens x GQA group) per program when a sequence has many query tokens.
_PREFILL_BLOCK_M = 64


@triton.jit
def _attend_block(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, base, offs_n, dims, kv_mask,
                  dim_mask, allowed, stride_cs, stride_cd, scale_log2,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a cache block; ``allowed`` [BLOCK_M, BLOCK_N] is the mask."""
    k = tl.load(k_cache_ptr + base + offs_n[None, :] * stride_cs + dims[:, None] * stride_cd,
                mask=kv_mask[None, :] & dim_mask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + base + offs_n[:, None] * stride_cs + dims[None, :] * stride_cd,
                mask=kv_mask[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
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


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                            block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
                            scale_log2, head_dim, block_size,
                            stride_qt, stride_qh, stride_qd,
                            stride_ot, stride_oh, stride_od,
                            stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
                            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    first_tok = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if (first_tok >= q_len) | (seq_len <= 0):
        return  # nothing to do; padding rows keep the zeros the launcher wrote
    context_len = seq_len - q_len

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
    offs_n = tl.arange(0, BLOCK_N)
    # Keys this program can see: up to the position of its last query token.
    kv_end = context_len + tl.minimum(q_len, first_tok + BLOCK_Q)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for j in range(0, tl.cdiv(kv_end, block_size)):
        phys = tl.load(block_row + j).to(tl.int64)
        k_pos = j * block_size + offs_n
        kv_mask = (offs_n < block_size) & (k_pos < kv_end)
        allowed = kv_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr,
                                      phys * stride_cb + kv_head * stride_ch, offs_n, dims,
                                      kv_mask, dim_mask, allowed, stride_cs, stride_cd,
                                      scale_log2, UPCAST, DOT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row_tok[:, None] * stride_ot + head[:, None] * stride_oh
             + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _split_kv_stage1_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
                            block_table_ptr, seq_lens_ptr,
                            scale_log2, head_dim, block_size, num_q_heads, num_splits,
                            stride_qt, stride_qh, stride_qd,
                            stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
                            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr,
                            UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_blocks = tl.cdiv(seq_len, block_size)
    per_split = tl.cdiv(num_blocks, num_splits)
    blk_start = split * per_split
    blk_end = tl.minimum(blk_start + per_split, num_blocks)

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
    offs_n = tl.arange(0, BLOCK_N)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for j in range(blk_start, blk_end):
        phys = tl.load(block_row + j).to(tl.int64)
        k_pos = j * block_size + offs_n
        kv_mask = (offs_n < block_size) & (k_pos < seq_len)
        allowed = row_mask[:, None] & kv_mask[None, :]
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr,
                                      phys * stride_cb + kv_head * stride_ch, offs_n, dims,
                                      kv_mask, dim_mask, allowed, stride_cs, stride_cd,
                                      scale_log2, UPCAST, DOT_PRECISION)

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part = (seq.to(tl.int64) * num_q_heads + head) * num_splits + split
    tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], out,
             mask=row_mask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _split_kv_stage2_kernel(part_out_ptr, part_lse_ptr, out_ptr, head_dim, num_q_heads,
                            num_splits, stride_ot, stride_oh, stride_od,
                            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
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


def _cache_blocks(k_cache: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_D): cache block and head_dim padded to powers of two >= 16."""
    return max(_MIN_DOT, next_pow2(k_cache.shape[1])), max(_MIN_DOT, next_pow2(k_cache.shape[3]))


def _unified_block_m(group: int, max_query_len: int) -> int:
    """Rows per program: 16 for decode-only batches, up to 64 when queries are longer."""
    return max(_MIN_DOT, next_pow2(group), min(_PREFILL_BLOCK_M, next_pow2(max_query_len * group)))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, max_query_len: int,
                           softmax_scale: float) -> torch.Tensor:
    """Causal paged attention for a flat batch of variable-length queries; see module doc.

    Rows of ``q`` outside every sequence (and rows of padding sequences) come back as zeros.
    """
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have identical strides")
    out = q.new_zeros(q.shape)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len <= 0 or q.shape[0] == 0:
        return out
    group = q.shape[1] // k_cache.shape[2]
    block_m = _unified_block_m(group, max_query_len)
    block_q = block_m // group
    block_n, block_d = _cache_blocks(k_cache)
    upcast, precision = _dot_settings(k_cache.dtype)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), k_cache.shape[2])
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, query_start_loc, seq_lens,
        softmax_scale * LOG2E, k_cache.shape[3], k_cache.shape[1],
        *q.stride(), *out.stride(), *k_cache.stride(), block_table.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast, DOT_PRECISION=precision, num_warps=4)
    return out


def paged_attention_decode_split_kv_triton(q: torch.Tensor, k_cache: torch.Tensor,
                                           v_cache: torch.Tensor, block_table: torch.Tensor,
                                           seq_lens: torch.Tensor, softmax_scale: float,
                                           num_splits: int) -> torch.Tensor:
    """Decode attention (one query token per sequence) split over the KV length; see module doc.

    ``num_splits`` is capped by the block table's width, since a split needs a block to own.
    """
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have identical strides")
    num_seqs, num_q_heads, head_dim = q.shape
    out = q.new_zeros(q.shape)
    num_splits = max(1, min(int(num_splits), block_table.shape[1]))
    if num_seqs == 0:
        return out
    group = num_q_heads // k_cache.shape[2]
    block_n, block_d = _cache_blocks(k_cache)
    upcast, precision = _dot_settings(k_cache.dtype)
    part_out = torch.empty((num_seqs, num_q_heads, num_splits, block_d), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32,
                           device=q.device)
    _split_kv_stage1_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, part_out, part_lse, block_table, seq_lens,
        softmax_scale * LOG2E, head_dim, k_cache.shape[1], num_q_heads, num_splits,
        *q.stride(), *k_cache.stride(), block_table.stride(0),
        GROUP=group, BLOCK_M=max(_MIN_DOT, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast, DOT_PRECISION=precision, num_warps=4)
    _split_kv_stage2_kernel[(num_seqs, num_q_heads)](
        part_out, part_lse, out, head_dim, num_q_heads, num_splits, *out.stride(),
        BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, num_warps=1 if block_d <= 128 else 2)
    return out
