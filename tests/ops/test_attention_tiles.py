"""Attention tile shapes: the host-side choice (``attention_tiles``) and the kernels run with
multi-block key tiles and tall query blocks against the reference.

The cases put sequence ends, context ends and query-block ends on and around the key-tile
width (32 or 64) and the cache block size, use block sizes smaller than, equal to, larger
than and not dividing a tile, GQA ratios 1-8 (7 to leave padded rows), wide heads (tile 32,
64 rows) and contexts of a few thousand keys.
"""
from __future__ import annotations

import pytest
import torch

from tests.ops.test_attention import PAD, make_batch
from tests.ops.tolerances import assert_close_rel
from vgraph.ops.attention import paged_attention_reference
from vgraph.ops.kernels.attention import MIN_DOT, attention_tiles, effective_splits, paged_attention_triton


@pytest.mark.parametrize("group,max_query_len,head_dim,expected", [
    (1, 1, 128, (16, 16, 64)),     # decode: the smallest row block tl.dot takes
    (8, 1, 128, (16, 2, 64)),
    (32, 1, 128, (32, 1, 64)),     # a GQA group taller than 16 rows
    (4, 3, 64, (16, 4, 64)),       # short queries: rows grow with the query, not past it
    (4, 2048, 128, (128, 32, 64)),  # prefill: 128 rows when head_dim <= 128
    (1, 2048, 64, (128, 128, 64)),
    (7, 2048, 80, (128, 18, 64)),  # 126 of 128 rows used
    (4, 2048, 256, (64, 16, 32)),  # wide head: 64 rows, 32-key tiles
    (128, 9, 256, (128, 1, 32)),   # one whole GQA group even when it is taller than the cap
])
def test_attention_tiles(group, max_query_len, head_dim, expected):
    tiles = attention_tiles(group, max_query_len, head_dim)
    assert (tiles.block_m, tiles.block_q, tiles.tile_n) == expected
    assert tiles.block_q * group <= tiles.block_m
    assert tiles.block_d >= max(head_dim, MIN_DOT)


@pytest.mark.parametrize("group,max_query_len,head_dim,expected", [
    (4, 2048, 128, (16, 4, 16)), (1, 1, 256, (16, 16, 16)), (32, 7, 64, (32, 1, 16)),
])
def test_fp32_caches_keep_small_tiles(group, max_query_len, head_dim, expected):
    tiles = attention_tiles(group, max_query_len, head_dim, elem_bytes=4)
    assert (tiles.block_m, tiles.block_q, tiles.tile_n) == expected


def test_attention_tiles_warps_follow_the_accumulator():
    assert attention_tiles(4, 1, 128).num_warps == 4
    assert attention_tiles(4, 2048, 128).num_warps == 8
    assert attention_tiles(4, 2048, 256).num_warps == 8
    assert attention_tiles(4, 2048, 64).num_warps == 4


@pytest.mark.parametrize("num_splits,width,block_size,tile_n,expected", [
    (8, 100, 16, 64, 8), (8, 3, 16, 64, 1), (8, 9, 16, 64, 3), (0, 9, 16, 64, 1), (5, 1, 128, 32, 4),
])
def test_effective_splits_are_capped_by_the_tiles_a_table_holds(num_splits, width, block_size,
                                                                tile_n, expected):
    assert effective_splits(num_splits, width, block_size, tile_n) == expected


# (dtype, kv_heads, group, head_dim, block_size, specs); specs are (context_len, query_len).
# Multi-block tiles and tall query blocks are the 16-bit path (fp32 keeps 16 x 16 tiles).
PREFILL_CASES = [
    pytest.param(torch.bfloat16, 2, 1, 64, 16,
                 [(0, 200), (300, 70), (1000, 1), PAD, (63, 2), (0, 64), (64, 64), (1, 127)],
                 id="bf16-mha-d64-bs16-two-query-blocks"),
    pytest.param(torch.float16, 1, 7, 80, 16,
                 [(0, 37), (18, 19), (100, 36), (0, 1), (127, 1)],
                 id="fp16-gqa7-d80-bs16-query-block-edges"),
    pytest.param(torch.bfloat16, 2, 4, 128, 32,
                 [(0, 129), (97, 33), (0, 32), (2048, 1), PAD, (31, 33)],
                 id="bf16-gqa4-d128-bs32-long-context"),
    pytest.param(torch.float16, 1, 8, 96, 48,
                 [(0, 50), (47, 17), (95, 1), (200, 16)],
                 id="fp16-gqa8-d96-bs48-block-not-dividing-tile"),
    pytest.param(torch.bfloat16, 2, 2, 256, 128,
                 [(0, 70), (129, 31), (31, 1), (300, 40)],
                 id="bf16-gqa2-d256-bs128-block-larger-than-tile"),
    pytest.param(torch.bfloat16, 1, 3, 64, 8,
                 [(0, 100), (57, 7), (8, 8), (500, 1)],
                 id="bf16-gqa3-d64-bs8-eight-blocks-per-tile"),
    pytest.param(torch.float32, 1, 4, 128, 8,
                 [(0, 40), (33, 15), (16, 1), PAD, (300, 2)],
                 id="fp32-gqa4-d128-bs8-two-blocks-per-tile"),
    pytest.param(torch.float32, 2, 1, 64, 48,
                 [(0, 20), (47, 2), (100, 1)],
                 id="fp32-mha-d64-bs48-tiles-inside-blocks"),
]


@pytest.mark.parametrize("dtype,kv_heads,group,head_dim,block_size,specs", PREFILL_CASES)
def test_tiled_paged_attention_matches_reference(kernel_device: str, dtype, kv_heads, group,
                                                 head_dim, block_size, specs):
    b = make_batch(specs, kv_heads, group, head_dim, block_size, dtype, extra_rows=2)
    ref = paged_attention_reference(*b.attention_args())
    out = paged_attention_triton(*b.attention_args(kernel_device))
    assert_close_rel(out, ref)
    tail = b.query_start_loc[-1].item()
    assert torch.equal(out[tail:].cpu(), torch.zeros_like(ref[tail:]))


# (dtype, kv_heads, group, head_dim, block_size, seq_lens, num_splits)
