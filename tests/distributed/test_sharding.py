"""The piece of tensor parallelism that needs no second process: how checkpoint tensors are cut
into shards. (How each step reaches every rank's copies of the requests: tests/core/test_step_plan.py.)"""
from __future__ import annotations

import pytest
import torch

from vgraph.distributed.sharding import check_divisible, shard_for_rank, vocab_range
from vgraph.distributed.state import TPGroup

RANKS = [TPGroup(r, 2, "0") for r in range(2)]


def test_column_row_and_replicated_shards_rebuild_the_tensor():
    w = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    cols = [shard_for_rank("model.layers.0.self_attn.qkv_proj.weight", "q", w, g, 10) for g in RANKS]
    torch.testing.assert_close(torch.cat(cols, 0), w)  # column-parallel: output rows
    rows = [shard_for_rank("model.layers.0.mlp.down_proj.weight", None, w, g, 10) for g in RANKS]
    torch.testing.assert_close(torch.cat(rows, 1), w)  # row-parallel: input columns
    bias = torch.ones(8)
    biases = [shard_for_rank("model.layers.0.self_attn.o_proj.bias", None, bias, g, 10) for g in RANKS]
    torch.testing.assert_close(biases[0] + biases[1], bias)  # added once, after the all-reduce
    norm = torch.ones(6)
    assert all(shard_for_rank("model.norm.weight", None, norm, g, 10) is norm for g in RANKS)
    assert shard_for_rank("model.layers.0.mlp.down_proj.weight", None, w, TPGroup(), 10) is w


def test_vocab_shards_are_padded_and_cover_the_vocabulary_once():
    emb = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)  # V = 5 over 2 ranks: 3 rows each
    shards = [shard_for_rank("model.embed_tokens.weight", None, emb, g, 5) for g in RANKS]
    assert [s.shape[0] for s in shards] == [3, 3]
    assert [vocab_range(5, g) for g in RANKS] == [(0, 3), (3, 5)]
    torch.testing.assert_close(torch.cat(shards)[:5], emb)
    assert shards[1][2].abs().sum() == 0  # the padding row


def test_fused_checkpoint_weights_and_odd_sizes_are_refused():
    with pytest.raises(ValueError, match="stored fused"):
        shard_for_rank("model.layers.0.self_attn.qkv_proj.weight", None, torch.ones(4, 2), RANKS[0], 8)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_divisible(2, 4, 3, 8)
    check_divisible(1, 3, 3, 7)
