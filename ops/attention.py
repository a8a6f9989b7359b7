"""Paged attention ops over the KV cache: ``vgraph::paged_attention`` and its split-KV decode.

``paged_attention`` serves every kind of row in one flat batch: plain prefill (no cached
context), chunked prefill or prefix-cache hits (a cached context before the new tokens), and
decode (one new token). Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
they are the last ``query_len`` tokens of its ``seq_lens[i]`` tokens, whose K/V are all in
the cache already (``reshape_and_cache`` runs first). Query token ``j`` sits at position
``seq_len - query_len + j`` and attends causally to keys ``0..`` that position. GQA: query
head ``h`` reads KV head ``h // (Hq // Hkv)``. Padding sequences (``seq_len == 0``) and rows
after ``query_start_loc[-1]`` produce zeros.

``paged_attention_decode_split_kv`` computes the same thing for one query token per sequence,
splitting each sequence's KV across several programs so long decodes fill the GPU.

fp8 KV cache: with a ``float8_e4m3fn`` cache, q stays in the model's dtype and each op takes
the cache's per-tensor ``k_scale``/``v_scale`` (one-element float32 tensors, 1.0 when not
given); keys and values are read as ``cached * scale`` (see ``kv_cache``).

Implementations: the op's default is the readable per-sequence reference (also the test
oracle); CUDA runs the Triton kernels; CPU registers the batched plain-torch kernel of
``cpu_attention`` as a device kernel, the same way CUDA does, so the reference stays the
op's definition and the fallback for any other device.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import cpu_attention
from .kernels import lazy
from .cpu_dispatch import python_kernel
from .kv_cache import check_cache_input_dtype, check_kv_cache_pair, check_kv_scale, dequantize_kv
from .registration import vgraph_op

# Triton kernels, imported on first use (kernels.lazy): CPU calls never need them.
kernels = lazy("attention")

_INDEX_DTYPES = (torch.int32, torch.int64)
_ATTN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_index(name: str, t: Tensor, dims: int) -> None:
    if t.dim() != dims or t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be a {dims}-D int32 tensor, got {t.dtype} "
                         f"of shape {tuple(t.shape)}")


def _check_common(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                  seq_lens: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor]) -> None:
    """Shape/dtype checks shared by both attention ops (no device data is read)."""
    check_kv_cache_pair(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, q_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in _ATTN_DTYPES:
        raise ValueError(f"q dtype {q.dtype} must be one of {_ATTN_DTYPES}")
    check_cache_input_dtype("q", q, k_cache)
    check_kv_scale("k_scale", k_scale, k_cache)
    check_kv_scale("v_scale", v_scale, v_cache)
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"q_heads {q.shape[1]} is not a multiple of kv_heads {k_cache.shape[2]}")
    _check_index("block_table", block_table, 2)
    _check_index("seq_lens", seq_lens, 1)
    if block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for "
                         f"{seq_lens.shape[0]} sequences")


def _check_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                           query_start_loc: Tensor, seq_lens: Tensor, max_query_len: int,
                           k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    _check_common(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    _check_index("query_start_loc", query_start_loc, 1)
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {seq_lens.shape[0] + 1} "
                         f"entries, got {query_start_loc.shape[0]}")
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")


def gather_kv(k_cache: Tensor, v_cache: Tensor, block_row: Tensor,
              seq_len: int) -> tuple[Tensor, Tensor]:
    """The first ``seq_len`` cached K/V rows of one sequence, contiguous: 2 x [seq_len, Hkv, D]."""
    block_size = k_cache.shape[1]
    blocks = block_row[: -(-seq_len // block_size)].long()
    keys = k_cache[blocks].flatten(0, 1)[:seq_len]
    values = v_cache[blocks].flatten(0, 1)[:seq_len]
    return keys, values


def attend_causal(q: Tensor, keys: Tensor, values: Tensor, softmax_scale: float) -> Tensor:
    """q [Q, Hq, D] as the last Q positions of keys/values [L, Hkv, D]; fp32 math, q's dtype out."""
    num_q, context = q.shape[0], keys.shape[0] - q.shape[0]
    group = q.shape[1] // keys.shape[1]
    qf = q.float().transpose(0, 1)                                    # [Hq, Q, D]
    kf = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vf = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * softmax_scale                # [Hq, Q, L]
    q_pos = context + torch.arange(num_q, device=q.device)
    k_pos = torch.arange(keys.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return (scores.softmax(dim=-1) @ vf).transpose(0, 1).to(q.dtype)


def paged_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                              query_start_loc: Tensor, seq_lens: Tensor, max_query_len: int,
                              softmax_scale: float, k_scale: Optional[Tensor] = None,
                              v_scale: Optional[Tensor] = None) -> Tensor:
    """Plain-torch paged attention, one sequence at a time (gather K/V, then masked softmax).

    Unlike the kernel it reads the metadata on the host, so it also rejects inconsistent
    metadata (a query longer than max_query_len or than its sequence). An fp8 cache's rows
    are dequantized to fp32 (``cached * scale``) before the math.
    """
    _check_paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                           max_query_len, k_scale, v_scale)
    out = q.new_zeros(q.shape)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if not 0 <= start <= end <= q.shape[0]:
            raise ValueError(f"sequence {i}: query rows {start}:{end} outside q's {q.shape[0]} rows")
        if end - start > max_query_len:
            raise ValueError(f"sequence {i}: query length {end - start} > max_query_len {max_query_len}")
        if seq_len == 0 or end == start:
            continue
        if seq_len < end - start:
            raise ValueError(f"sequence {i}: seq_len {seq_len} < query length {end - start}")
        keys, values = gather_kv(k_cache, v_cache, block_table[i], seq_len)
        keys = dequantize_kv(keys, k_scale, torch.float32)
        values = dequantize_kv(values, v_scale, torch.float32)
        out[start:end] = attend_causal(q[start:end], keys, values, softmax_scale)
    return out


def paged_attention_decode_split_kv_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                              block_table: Tensor, seq_lens: Tensor,
                                              softmax_scale: float, num_splits: int,
                                              k_scale: Optional[Tensor] = None,
                                              v_scale: Optional[Tensor] = None) -> Tensor:
    """Same math as ``paged_attention_reference`` with one query row per sequence.

    The split count only changes how the kernel shares work, never the result.
    """
    _check_split_kv(q, k_cache, v_cache, block_table, seq_lens, num_splits, k_scale, v_scale)
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_reference(q, k_cache, v_cache, block_table, query_start_loc,
                                     seq_lens, 1, softmax_scale, k_scale, v_scale)


def _check_split_kv(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                    seq_lens: Tensor, num_splits: int, k_scale: Optional[Tensor] = None,
                    v_scale: Optional[Tensor] = None) -> None:
    _check_common(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"split-KV decode takes one query row per sequence: q has "
                         f"{q.shape[0]} rows for {seq_lens.shape[0]} sequences")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


@vgraph_op("vgraph::paged_attention", mutates_args=())
def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, max_query_len: int,
                    softmax_scale: float, k_scale: Optional[Tensor] = None,
                    v_scale: Optional[Tensor] = None) -> Tensor:
    """Causal attention of a flat variable-length query batch over the paged KV cache
    (an fp8 cache read at ``k_scale``/``v_scale``)."""
    return paged_attention_reference(q, k_cache, v_cache, block_table, query_start_loc,
                                     seq_lens, max_query_len, softmax_scale, k_scale, v_scale)


@paged_attention.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
      query_start_loc: Tensor, seq_lens: Tensor, max_query_len: int,
      softmax_scale: float, k_scale: Optional[Tensor] = None,
      v_scale: Optional[Tensor] = None) -> Tensor:
    _check_paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                           max_query_len, k_scale, v_scale)
    return q.new_empty(q.shape)


@paged_attention.register_kernel("cuda")
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
      query_start_loc: Tensor, seq_lens: Tensor, max_query_len: int,
      softmax_scale: float, k_scale: Optional[Tensor] = None,
      v_scale: Optional[Tensor] = None) -> Tensor:
    _check_paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                           max_query_len, k_scale, v_scale)
    return kernels.paged_attention_triton(q, k_cache, v_cache, block_table, query_start_loc,
                                          seq_lens, max_query_len, softmax_scale,
                                          k_scale=k_scale, v_scale=v_scale)


@python_kernel("paged_attention")
def _paged_attention_cpu(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                         query_start_loc: Tensor, seq_lens: Tensor, max_query_len: int,
                         softmax_scale: float, k_scale: Optional[Tensor] = None,
                         v_scale: Optional[Tensor] = None) -> Tensor:
    """Batched CPU kernel: a device kernel rather than the op's default, so the reference
    keeps defining the op (and serving devices without a kernel) while CPU gets the fast path."""
    _check_paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                           max_query_len, k_scale, v_scale)
    return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, block_table, query_start_loc,
                                             seq_lens, max_query_len, softmax_scale,
                                             kv_scales=(k_scale, v_scale))


@vgraph_op("vgraph::paged_attention_decode_split_kv", mutates_args=())
def paged_attention_decode_split_kv(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                    block_table: Tensor, seq_lens: Tensor, softmax_scale: float,
                                    num_splits: int, k_scale: Optional[Tensor] = None,
                                    v_scale: Optional[Tensor] = None) -> Tensor:
    """Decode attention (q [S, Hq, D], one token per sequence) with the KV split num_splits ways."""
    return paged_attention_decode_split_kv_reference(q, k_cache, v_cache, block_table, seq_lens,
                                                     softmax_scale, num_splits, k_scale, v_scale)


@paged_attention_decode_split_kv.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
      softmax_scale: float, num_splits: int, k_scale: Optional[Tensor] = None,
      v_scale: Optional[Tensor] = None) -> Tensor:
    _check_split_kv(q, k_cache, v_cache, block_table, seq_lens, num_splits, k_scale, v_scale)
    return q.new_empty(q.shape)


@paged_attention_decode_split_kv.register_kernel("cuda")
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
      softmax_scale: float, num_splits: int, k_scale: Optional[Tensor] = None,
      v_scale: Optional[Tensor] = None) -> Tensor:
    _check_split_kv(q, k_cache, v_cache, block_table, seq_lens, num_splits, k_scale, v_scale)
    return kernels.paged_attention_decode_split_kv_triton(q, k_cache, v_cache, block_table,
                                                          seq_lens, softmax_scale, num_splits,
                                                          k_scale=k_scale, v_scale=v_scale)


@paged_attention_decode_split_kv.register_kernel("cpu")
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
      softmax_scale: float, num_splits: int, k_scale: Optional[Tensor] = None,
      v_scale: Optional[Tensor] = None) -> Tensor:
    _check_split_kv(q, k_cache, v_cache, block_table, seq_lens, num_splits, k_scale, v_scale)
    return cpu_attention.paged_attention_decode_split_kv_cpu(q, k_cache, v_cache, block_table,
                                                             seq_lens, softmax_scale, num_splits,
                                                             kv_scales=(k_scale, v_scale))


# ------------------------------------------------------------------ into a caller's buffer
# Not ops of their own: ``vgraph::unified_attention`` calls these from inside its kernel when
# the forward context holds a persistent output buffer for the layer (PIECEWISE CUDA graphs;
# see vgraph/compiler/piecewise_graphs.py), so its schema, and every cached graph, stay as
# they are. On CUDA the Triton kernel writes the buffer itself, which saves the copy into the
# next piece's staging buffer; elsewhere the op's result is copied in (no graphs to save on).


def paged_attention_into(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                         block_table: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
                         max_query_len: int, softmax_scale: float, k_scale: Optional[Tensor] = None,
                         v_scale: Optional[Tensor] = None) -> Tensor:
    """``vgraph::paged_attention`` written into ``out`` (shaped like ``q``); returns ``out``."""
    _check_paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                           max_query_len, k_scale, v_scale)
    if q.is_cuda:
        return kernels.paged_attention_triton(q, k_cache, v_cache, block_table, query_start_loc,
                                              seq_lens, max_query_len, softmax_scale, out=out,
                                              k_scale=k_scale, v_scale=v_scale)
    return out.copy_(torch.ops.vgraph.paged_attention(q, k_cache, v_cache, block_table,
                                                      query_start_loc, seq_lens, max_query_len,
                                                      softmax_scale, k_scale, v_scale))


def paged_attention_with_new_kv(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                                block_table: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
                                max_query_len: int, softmax_scale: float,
                                k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> Tensor:
    """``vgraph::paged_attention`` given also the K/V rows this step just cached (``k``/``v``,
    one per row of q). On CPU, prefills without cached context attend over those rows
    directly instead of gathering them back out of the cache; the result is the same. Not
    for an fp8 cache, whose rows differ from ``k``/``v`` by the quantization: a prefill must
    read what later steps will read."""
    _check_paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                           max_query_len, k_scale, v_scale)
    if q.device.type != "cpu" or k.dtype != k_cache.dtype or k.shape[0] != q.shape[0]:
        return torch.ops.vgraph.paged_attention(q, k_cache, v_cache, block_table, query_start_loc,
                                                seq_lens, max_query_len, softmax_scale, k_scale, v_scale)
    return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, block_table, query_start_loc,
                                             seq_lens, max_query_len, softmax_scale, new_kv=(k, v))


def paged_attention_decode_split_kv_into(out: Tensor, q: Tensor, k_cache: Tensor,
                                         v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                                         softmax_scale: float, num_splits: int,
                                         k_scale: Optional[Tensor] = None,
                                         v_scale: Optional[Tensor] = None) -> Tensor:
    """``vgraph::paged_attention_decode_split_kv`` written into ``out``; returns ``out``."""
    _check_split_kv(q, k_cache, v_cache, block_table, seq_lens, num_splits, k_scale, v_scale)
    if q.is_cuda:
        return kernels.paged_attention_decode_split_kv_triton(q, k_cache, v_cache, block_table,
                                                              seq_lens, softmax_scale, num_splits,
                                                              out=out, k_scale=k_scale, v_scale=v_scale)
    return out.copy_(torch.ops.vgraph.paged_attention_decode_split_kv(
        q, k_cache, v_cache, block_table, seq_lens, softmax_scale, num_splits, k_scale, v_scale))
