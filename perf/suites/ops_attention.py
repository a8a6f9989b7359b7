"""Attention rows of the op benchmark: a decode batch of ``tokens`` sequences.

Variants: the plain-torch paged reference (one sequence at a time), on CPU the batched CPU
kernel the engine runs, SDPA over K/V already
gathered into a contiguous padded batch (what an unpaged runtime runs; it excludes the gather),
and on CUDA the unified Triton kernel and the split-KV kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vgraph.ops.attention import gather_kv, paged_attention_reference
from vgraph.ops.attention_batch import random_paged_batch


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
    context = _context(device)
    kv_heads, group, head_dim = (8, 4, 128) if device == "cuda" else (2, 4, 64)
    batch = random_paged_batch([(context, 1)] * tokens, kv_heads, group, head_dim, 16, dtype).to(device)
    q, k, v = _sdpa_inputs(batch, context)
    args = batch.args()
    variants = {
        "torch_eager": lambda: paged_attention_reference(*args),
        "sdpa_contiguous": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    if device == "cpu":  # the batched CPU kernel the engine runs (ops/cpu_attention.py)
        variants["vgraph_cpu_kernel"] = lambda: torch.ops.vgraph.paged_attention(*args)
    if device == "cuda":
        vg = torch.ops.vgraph
        variants["triton"] = lambda: vg.paged_attention(*args)
        variants["triton_split_kv"] = lambda: vg.paged_attention_decode_split_kv(
            batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens,
            batch.softmax_scale, 8)
    return {f"paged_attention_decode_ctx{context}": variants}
