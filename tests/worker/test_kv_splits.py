"""The split-KV policy: how many ways a decode batch's KV is split, from the device's SM count
and the context length; no GPU needed (the SM count is a parameter, or patched)."""
from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from vgraph.ops.kernels import common
from vgraph.ops.kernels.host import wave_efficient_splits
from vgraph.worker.runner_requests import RunnerStep
from vgraph.worker import batch as batch_module
from vgraph.worker.batch import BatchBuilder
from vgraph.worker.dispatch import Decision, Path, default_capture_sizes
from vgraph.worker.dummy import dummy_decode

H100_SMS = 132
CUDA = torch.device("cuda")
SLOTS_PER_SM = batch_module._SPLIT_KV_PROGRAMS_PER_SM
MIN_KEYS = batch_module._SPLIT_KV_MIN_KEYS_PER_SPLIT
MAX_SPLITS = batch_module._SPLIT_KV_MAX_SPLITS


def _builder(kv_heads: int = 8, max_model_len: int = 32768, device: torch.device = CUDA) -> BatchBuilder:
    return BatchBuilder(16, device, num_kv_heads=kv_heads, max_model_len=max_model_len)


def test_sixteen_long_sequences_split_to_fill_the_gpu():
    """The case the old rule got wrong: 16 x 8 = 128 programs was 'enough', about one per SM."""
    splits = _builder().kv_splits(16, 1, 32768, num_sms=H100_SMS)
    assert splits > 1
    assert 16 * 8 * splits >= 0.8 * H100_SMS * SLOTS_PER_SM


@pytest.mark.parametrize("device,num_seqs,max_query_len,max_seq_len", [
    (torch.device("cpu"), 1, 1, 131072),  # CPU: no split-KV kernel
    (CUDA, 1, 2, 131072),                 # not pure decode
    (CUDA, 1, 1, 255),                    # too short even for a batch far under one program per SM
    (CUDA, 17, 1, 2047),                  # 136 programs fill 132 SMs once: long contexts only
])
def test_no_split(device, num_seqs, max_query_len, max_seq_len):
    assert _builder(device=device).kv_splits(num_seqs, max_query_len, max_seq_len, num_sms=H100_SMS) == 1


@pytest.mark.parametrize("kv_heads,max_seq_len,cap", [(8, 1024, 16), (8, 256, 4), (2, 1024, 16), (8, 8192, 64)])
def test_batch_one_splits_short_contexts(kv_heads, max_seq_len, cap):
    """Batch 1 is a handful of programs on 132 SMs: a FULL graph's count (baked for
    max_model_len) splits from 256 keys on, one split per 64 keys of max_model_len at most,
    and close to that cap (the grid stays far under one wave)."""
    splits = _builder(kv_heads).kv_splits(1, 1, max_seq_len, num_sms=H100_SMS)
    assert 0.85 * cap <= splits <= cap


def _cap(programs: int, max_seq_len: int) -> int:
    keys = batch_module._SPLIT_KV_UNDERFILLED_KEYS_PER_SPLIT if programs < H100_SMS else MIN_KEYS
    return min(max_seq_len // keys, MAX_SPLITS)


def _wave_efficiency(programs: int, splits: int, slots: int) -> float:
    waves = programs * splits / slots
    return waves / math.ceil(waves)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("max_seq_len", [2048, 4096, 32768, 131072])
def test_every_decode_bucket_fills_the_gpu_as_far_as_the_context_allows(kv_heads, max_seq_len):
    """For each FULL bucket: no split when the grid already fills most of a wave; otherwise a
    count whose last wave is at least 85% as full as the best allowed count's, and, when the
    context allows enough splits for a whole wave, at least 2/3 of one (>= 2.6 programs/SM)."""
    builder, slots = _builder(kv_heads), H100_SMS * SLOTS_PER_SM
    for bucket in default_capture_sizes(256):
        splits = builder.kv_splits(bucket, 1, max_seq_len, num_sms=H100_SMS)
        programs = bucket * kv_heads
        cap = _cap(programs, max_seq_len)
        assert 1 <= splits <= cap, (bucket, splits)
        if programs >= 0.8 * slots:
            assert splits == 1, "a grid that already fills the GPU is not split"
            continue
        best = max(_wave_efficiency(programs, s, slots) for s in range(1, cap + 1))
        assert _wave_efficiency(programs, splits, slots) >= 0.85 * best, (bucket, splits)
        if programs * cap >= slots:
            assert programs * splits >= 0.65 * slots, (bucket, splits)


def test_the_count_follows_the_sm_count():
    builder = _builder()
    assert builder.kv_splits(4, 1, 32768, num_sms=132) > builder.kv_splits(4, 1, 32768, num_sms=32)


def test_wave_efficient_splits():
    assert wave_efficient_splits(128, 528, 64) == 4  # 512 of 528 slots: one nearly full wave
    assert wave_efficient_splits(500, 528, 64) == 1  # already most of a wave
    assert wave_efficient_splits(8, 528, 1) == 1
    assert wave_efficient_splits(0, 528, 64) == 1


def test_sm_count_is_read_once(monkeypatch):
    calls = []

    def props(index):
        calls.append(index)
        return types.SimpleNamespace(multi_processor_count=132)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    common.sm_count.cache_clear()
    try:
        assert common.sm_count(torch.device("cuda", 0)) == 132
        assert common.sm_count(torch.device("cuda", 0)) == 132
        assert calls == [0]
    finally:
        common.sm_count.cache_clear()


def test_full_batches_bake_one_count_per_bucket(monkeypatch):
    """A FULL graph replays its captured split count for every context: the builder asks with
    the bucket size and max_model_len, never the batch's own lengths."""
    monkeypatch.setattr(batch_module, "sm_count", lambda device: H100_SMS)
    builder = _builder(max_model_len=32768)
    builder._dev = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # stay on the CPU
    for contexts in ([5], [5, 3000], [20000, 7, 12]):
        sched = RunnerStep([dummy_decode(1, c, 16, 4096).chunks[0] for c in contexts])
        meta = builder.build(sched, Decision(Path.FULL, 8, len(contexts))).attn_metadata
        assert meta.max_seq_len == 32768
        assert meta.num_kv_splits == builder.kv_splits(8, 1, 32768, num_sms=H100_SMS) > 1
