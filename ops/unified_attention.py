"""``vgraph::unified_attention``: the attention op the model calls, and the graph's split point.

The model passes only ``q, k, v`` and its layer index; everything that changes per step
(block tables, sequence lengths, slots) and the KV caches come from the forward context, so
one captured graph serves every batch. The op writes the new K/V into the layer's cache and
attends over it, choosing the split-KV decode kernel for pure-decode batches when the
metadata asks for it. Under PIECEWISE CUDA graphs it writes each layer's output into a
persistent buffer the graphs provide, so the next piece's graph reads it where it lies.
An fp8 KV cache's per-layer scales come from the context too (``ForwardContext.kv_scales``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import kv_cache as _kv_cache  # noqa: F401  (registers the cache write called below)
from .attention import (paged_attention_decode_split_kv_into, paged_attention_into,
                        paged_attention_with_new_kv)
from .forward_context import AttentionMetadata, ForwardContext, get_forward_context
from .registration import vgraph_op

Scales = tuple[Optional[Tensor], Optional[Tensor]]


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"unified_attention wants q [T, Hq, D] and k, v [T, Hkv, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head_dim")


def _write_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 meta: AttentionMetadata, scales: Scales) -> None:
    """Caches the step's K/V; rows past the metadata's tokens (bucket padding) write nothing."""
    num_tokens = meta.slot_mapping.shape[0]
    if num_tokens > k.shape[0]:
        raise ValueError(f"slot_mapping has {num_tokens} entries for {k.shape[0]} tokens")
    torch.ops.vgraph.reshape_and_cache(k[:num_tokens], v[:num_tokens], k_cache, v_cache,
                                       meta.slot_mapping, *scales)


def _attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
            meta: AttentionMetadata, softmax_scale: float, out: Optional[Tensor],
            scales: Scales) -> Tensor:
    """The attention of every row of ``q``, written into ``out`` when one is given. ``k``/``v``
    are the rows just cached: the CPU kernel reads fresh prefills' keys from them."""
    if meta.max_query_len == 1 and meta.num_kv_splits > 1:
        return _attend_decode_split_kv(q, k_cache, v_cache, meta, softmax_scale, out, scales)
    args = (q, k_cache, v_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
            meta.max_query_len, softmax_scale, *scales)
    if out is not None:
        return paged_attention_into(out, *args)
    if q.device.type == "cpu" and meta.max_query_len > 1 and q.shape[0] == k.shape[0]:
        return paged_attention_with_new_kv(q, k, v, *args[1:])
    return torch.ops.vgraph.paged_attention(*args)


def _attend_decode_split_kv(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                            softmax_scale: float, out: Optional[Tensor], scales: Scales) -> Tensor:
    """Pure decode: query row i is sequence i's only new token; rows past the sequences
    (bucket padding) are zeros."""
    num_seqs = meta.num_seqs
    if num_seqs > q.shape[0]:
        raise ValueError(f"decode batch has {num_seqs} sequences but only {q.shape[0]} rows")
    args = (q[:num_seqs], k_cache, v_cache, meta.block_table, meta.seq_lens, softmax_scale,
            meta.num_kv_splits, *scales)
    if out is not None:
        paged_attention_decode_split_kv_into(out[:num_seqs], *args)
        out[num_seqs:].zero_()
        return out
    decoded = torch.ops.vgraph.paged_attention_decode_split_kv(*args)
    if num_seqs == q.shape[0]:
        return decoded
    return torch.cat([decoded, q.new_zeros((q.shape[0] - num_seqs, *q.shape[1:]))])


def _output_buffer(ctx: ForwardContext, layer_idx: int, q: Tensor) -> Optional[Tensor]:
    """The layer's persistent output buffer under PIECEWISE graphs, else None (a new tensor):
    the piece after attention then reads the output in place instead of staging a copy."""
    if ctx.piecewise is None:
        return None
    return ctx.piecewise.attention_output(layer_idx, q.shape, q.dtype, q.device)


# mutates_args=() is deliberate: the op does write this layer's KV cache, but the cache is
# state of the forward context, not an argument. Keeping it out of the schema keeps the
# captured graph's inputs to (q, k, v) — no per-layer cache tensors threaded through the
# graph — and the op is opaque to the compiler (it is the split point), so nothing is
# reordered across the write. The only tensors the op takes, q/k/v, it does not modify.
@vgraph_op("vgraph::unified_attention", mutates_args=())
def unified_attention(q: Tensor, k: Tensor, v: Tensor, layer_idx: int) -> Tensor:
    """Cache write + paged attention for layer ``layer_idx``, driven by the forward context.

    Rows of ``q``/``k``/``v`` beyond the metadata's tokens (bucket padding) write nothing
    and return zeros.
    """
    _check_inputs(q, k, v)
    ctx = get_forward_context()
    if not 0 <= layer_idx < len(ctx.kv_caches):
        raise ValueError(f"layer_idx {layer_idx} out of range for {len(ctx.kv_caches)} KV caches")
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    scales: Scales = (None, None) if ctx.kv_scales is None else tuple(ctx.kv_scales[layer_idx])
    meta = ctx.attn_metadata
    _write_cache(k, v, k_cache, v_cache, meta, scales)
    return _attend(q, k, v, k_cache, v_cache, meta, ctx.softmax_scale, _output_buffer(ctx, layer_idx, q),
                   scales)


@unified_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, layer_idx: int) -> Tensor:
    _check_inputs(q, k, v)
    return q.new_empty(q.shape)  # like q, contiguous, as the real op returns
