"""The pieces of tensor parallelism that need no second process: how checkpoint tensors are cut
into shards, and how the engine's step reaches the workers' copies of the requests."""
from __future__ import annotations

import pytest
import torch

from vgraph.core.request import Request, RequestStatus
from vgraph.core.scheduler import ScheduledRequest, SchedulerOutput
from vgraph.distributed.mirror import RequestMirror, StepEncoder
from vgraph.distributed.sharding import check_divisible, shard_for_rank, vocab_range
from vgraph.distributed.state import TPGroup
from vgraph.sampling_params import SamplingParams

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


def _scheduled(*items: tuple[Request, int]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(r, n) for r, n in items])


def _same_view(engine_side: SchedulerOutput, worker_side: SchedulerOutput) -> None:
    for a, b in zip(engine_side.scheduled, worker_side.scheduled, strict=True):
        assert (a.request.request_id, a.start_position, a.num_new_tokens, a.produces_token) == \
               (b.request.request_id, b.start_position, b.num_new_tokens, b.produces_token)
        assert a.token_ids == b.token_ids
        assert a.request.block_ids == b.request.block_ids
        assert a.request.output_token_ids == b.request.output_token_ids


def test_the_mirror_follows_prefill_decode_preemption_and_finish():
    enc, mirror = StepEncoder(vocab_size=64), RequestMirror()
    a = Request("a", list(range(3, 23)), SamplingParams(seed=1), block_ids=[4, 9])
    b = Request("b", [5, 6, 7], SamplingParams(), block_ids=[2])
    step = _scheduled((a, 16), (b, 3))
    msg = enc.encode(step)
    assert [n.request_id for n in msg.new] == ["a", "b"]
    _same_view(step, mirror.apply(msg))
    # a finishes its prompt, b decodes its first token into a new block
    a.num_computed_tokens, b.num_computed_tokens = 16, 3
    b.output_token_ids.append(40)
    b.block_ids.append(7)
    step = _scheduled((a, 4), (b, 1))
    msg = enc.encode(step)
    assert msg.new == [] and msg.scheduled[1].new_output_tokens == [40]
    assert (msg.scheduled[1].blocks_from, msg.scheduled[1].new_blocks) == (1, [7])  # only the new block
    _same_view(step, mirror.apply(msg))
    assert mirror.requests["a"].generator is not None, "a seeded request gets its generator on the worker"
    # b is preempted and readmitted on other blocks; a finishes
    a.status = RequestStatus.FINISHED_LENGTH
    b.num_computed_tokens, b.block_ids = 0, [11]
    step = _scheduled((b, 4))
    msg = enc.encode(step)
    assert msg.forget == ["a"] and (msg.scheduled[0].blocks_from, msg.scheduled[0].new_blocks) == (0, [11])
    _same_view(step, mirror.apply(msg))
    assert set(mirror.requests) == {"b"}
