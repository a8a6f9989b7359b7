"""Attention cases for ``vgraph ops check``: a mixed batch and a long split-KV decode."""
from __future__ import annotations

import torch

from .attention import paged_attention_decode_split_kv_reference, paged_attention_reference
from .attention_batch import random_paged_batch
from .kernels.attention import paged_attention_decode_split_kv_triton, paged_attention_triton
from .kernels.kv_cache import reshape_and_cache_triton
from .kv_cache import reshape_and_cache_reference

REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _cache_write_case(dtype: torch.dtype) -> tuple:
    k, v = torch.randn(9, 2, 80).to(dtype), torch.randn(9, 2, 80).to(dtype)
    caches = torch.zeros(6, 16, 2, 80, dtype=dtype)
    slots = torch.tensor([0, 17, 33, -1, 40, 95, -1, 5, 64])

    def run(fn):
        def call(k, v, kc, vc, s):
            kc, vc = kc.clone(), vc.clone()
            fn(k, v, kc, vc, s)
            return kc, vc
        return call
    return ("reshape_and_cache", run(reshape_and_cache_triton), run(reshape_and_cache_reference),
            (k, v, caches, caches.clone(), slots), REL_TOL[dtype])


def attention_cases(dtype: torch.dtype) -> list[tuple]:
    # decode rows, a plain prefill, a prefill after a cached prefix, an exact block boundary
    mixed = random_paged_batch([(40, 1), (0, 37), (32, 17), (15, 1)], kv_heads=2, group=4,
                               head_dim=80, block_size=16, dtype=dtype)
    decode = random_paged_batch([(700, 1), (129, 1), (64, 1)], kv_heads=2, group=7,
                                head_dim=64, block_size=32, dtype=dtype)
    d = decode
    split_inputs = (d.q, d.k_cache, d.v_cache, d.block_table, d.seq_lens)
    return [
        _cache_write_case(dtype),
        ("paged_attention", lambda *a: paged_attention_triton(*a[:6], mixed.max_query_len, mixed.softmax_scale),
         lambda *a: paged_attention_reference(*a[:6], mixed.max_query_len, mixed.softmax_scale),
         mixed.args()[:6], REL_TOL[dtype]),
        ("paged_attention_decode_split_kv",
         lambda *a: paged_attention_decode_split_kv_triton(*a, d.softmax_scale, 4),
         lambda *a: paged_attention_decode_split_kv_reference(*a, d.softmax_scale, 4),
         split_inputs, REL_TOL[dtype]),
    ]
