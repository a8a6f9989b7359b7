"""Attention rows of the op benchmark: a decode batch of ``tokens`` sequences.

Variants: **torch_eager**, the plain-torch paged reference (one sequence at a time);
**vgraph**, ``torch.ops.vgraph.paged_attention`` (on CPU the C++ kernel that reads the paged
cache in place, on CUDA the unified Triton kernel); CPU only **vgraph_gather_sdpa** (the
batched torch path it replaced for decode rows: gather K/V into a copy, then SDPA); CUDA only
**vgraph_split_kv** (the split-KV decode kernel, 8 splits); **sdpa_contiguous**, SDPA over K/V already gathered into a contiguous padded batch
(what an unpaged runtime runs; it excludes the gather). Batches above ``MAX_SEQS`` sequences
are skipped (the largest decode bucket; the reference's per-sequence loop makes them slow).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vgraph.ops.attention import gather_kv, paged_attention_reference
from vgraph.ops.attention_batch import random_paged_batch
from vgraph.ops.cpu_attention import paged_attention_cpu


MAX_SEQS = 256


def describe(device: str) -> str:
    kv_heads, group, head_dim = _heads(device)
    return (f"paged decode attention, context {_context(device)}, {kv_heads} kv heads x {group} "
            f"query heads each, head_dim {head_dim}, block 16; batches up to {MAX_SEQS} sequences")


def _heads(device: str) -> tuple[int, int, int]:
    return (8, 4, 128) if device == "cuda" else (2, 4, 64)


def _context(device: str) -> int:
    return 1024 if device == "cuda" else 256


def _sdpa_inputs(batch, context: int):
    """[B, H, 1, D] queries and [B, Hkv, L, D] contiguous keys/values gathered once."""
    keys, values = [], []
    for i in range(batch.seq_lens.shape[0]):
        k, v = gather_kv(batch.k_cache, batch.v_cache, batch.block_table[i], int(batch.seq_lens[i]))
        keys.append(k.transpose(0, 1))
        values.append(v.transpose(0, 1))
    return batch.q.unsqueeze(2), torch.stack(keys), torch.stack(values)


def families(tokens: int, dtype: torch.dtype, device: str) -> dict:
    if tokens > MAX_SEQS:
        return {}
    context = _context(device)
    kv_heads, group, head_dim = _heads(device)
    batch = random_paged_batch([(context, 1)] * tokens, kv_heads, group, head_dim, 16, dtype).to(device)
    q, k, v = _sdpa_inputs(batch, context)
    args = batch.args()
    vg = torch.ops.vgraph
    variants = {"vgraph": lambda: vg.paged_attention(*args)}  # CPU: ops/cpu_attention.py
    if device == "cuda":
        variants["vgraph_split_kv"] = lambda: vg.paged_attention_decode_split_kv(
            batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens,
            batch.softmax_scale, 8)
    else:  # the batched torch path the C++ kernel replaced for decode rows: gather, then SDPA
        variants["vgraph_gather_sdpa"] = lambda: paged_attention_cpu(*args, native_kernel=False)
    variants["torch_eager"] = lambda: paged_attention_reference(*args)
    variants["sdpa_contiguous"] = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return {f"paged_attention_decode_ctx{context}": variants}
