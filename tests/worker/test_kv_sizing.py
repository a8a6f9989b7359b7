"""KV cache sizing: the memory budget from a profile, the cap, and what the profiled step runs."""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vgraph.config import CacheConfig
from vgraph.worker import runner as runner_module
from vgraph.worker.dummy import dummy_lengths, dummy_prefill
from vgraph.worker.huge_pages import HUGE_PAGE_BYTES, zeros_on_huge_pages
from vgraph.worker.kv_sizing import (Companion, KVSpec, MemoryProfile, allocate_kv_caches, kv_cache_budget,
                                    num_blocks_for)
from vgraph.worker.sampler import SamplingMetadata

GIB = 1 << 30
CUDA = torch.device("cuda")  # nothing here touches the device: the profile carries its numbers

# An 80 GiB GPU after profiling an 8B model at 0.95: 16 GiB of weights (16.5 reserved once the
# cache is emptied), a step that peaks at 24 GiB allocated and 25 GiB reserved, and 3 GiB
# outside torch's allocator (CUDA context, cuBLAS workspaces).
TOTAL, UTIL = 80 * GIB, 0.95
PEAK, PEAK_RESERVED, NON_TORCH, RESERVED = 24 * GIB, 25 * GIB, 3 * GIB, 16 * GIB + GIB // 2
FREE = TOTAL - RESERVED - NON_TORCH


def _at_worst_step(kv_bytes: int) -> int:
    """What the device holds at the largest step once the KV cache exists."""
    return NON_TORCH + PEAK_RESERVED + kv_bytes


def test_budget_keeps_the_worst_step_within_utilization():
    budget = kv_cache_budget(TOTAL, FREE, RESERVED, PEAK, PEAK_RESERVED, UTIL)
    assert budget == int(TOTAL * UTIL) - NON_TORCH - PEAK - (PEAK_RESERVED - PEAK)
    assert _at_worst_step(budget) == int(TOTAL * UTIL)


def test_the_old_formula_overcommitted_the_device():
    """``total * util - max(peak, total - free)`` drops the non-torch 3 GiB and the
    fragmentation because the peak is larger: the worst step needs the whole 80 GiB."""
    old = TOTAL * UTIL - max(PEAK, TOTAL - FREE)
    assert _at_worst_step(old) == TOTAL > TOTAL * UTIL
    assert kv_cache_budget(TOTAL, FREE, RESERVED, PEAK, PEAK_RESERVED, UTIL) == old - 4 * GIB


def test_budget_leaves_the_graph_reserve_free():
    base = kv_cache_budget(TOTAL, FREE, RESERVED, PEAK, PEAK_RESERVED, UTIL)
    assert kv_cache_budget(TOTAL, FREE, RESERVED, PEAK, PEAK_RESERVED, UTIL, graph_reserve=GIB) == base - GIB


def _profile(total: int = TOTAL) -> MemoryProfile:
    return MemoryProfile(peak_bytes=PEAK, peak_reserved_bytes=PEAK_RESERVED, resident_bytes=16 * GIB,
                         tokens=8192, total_bytes=total, free_bytes=total - RESERVED - NON_TORCH,
                         reserved_bytes=RESERVED)


SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)  # 2 MiB


def test_an_fp8_kv_cache_block_is_half_a_bf16_one():
    """--kv-cache-dtype fp8: the same memory holds twice the tokens."""
    fp8 = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float8_e4m3fn)
    assert SPEC.bytes_per_block == 2 * 1024 * 1024 and fp8.bytes_per_block == SPEC.bytes_per_block // 2
    assert fp8.dtype_name == "float8_e4m3fn"
    cache = CacheConfig(kv_cache_dtype="fp8", cpu_kv_cache_gib=1.0)
    assert cache.kv_torch_dtype(torch.bfloat16) == torch.float8_e4m3fn
    assert CacheConfig().kv_torch_dtype(torch.bfloat16) == torch.bfloat16
    cpu = torch.device("cpu")
    assert num_blocks_for(fp8, cache, cpu) == 2 * num_blocks_for(SPEC, cache, cpu)


def test_cuda_blocks_come_from_the_budget():
    cache = CacheConfig(gpu_memory_utilization=UTIL)
    blocks = num_blocks_for(SPEC, cache, CUDA, _profile(), graph_reserve=GIB)
    budget = kv_cache_budget(TOTAL, FREE, RESERVED, PEAK, PEAK_RESERVED, UTIL, GIB)
    assert blocks == budget // SPEC.bytes_per_block


def test_cuda_pool_is_capped_at_what_the_seats_can_use(caplog):
    """Every seat at max_model_len needs at most ``max_useful_blocks``; a large GPU with a small
    model would otherwise build a pool of tens of millions of blocks."""
    cache = CacheConfig(gpu_memory_utilization=UTIL)
    uncapped = num_blocks_for(SPEC, cache, CUDA, _profile())
    with caplog.at_level(logging.INFO, logger="vgraph"):
        assert num_blocks_for(SPEC, cache, CUDA, _profile(), max_useful_blocks=1000) == 1000
    capped = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert len(capped) == 1 and f"{uncapped}" in capped[0] and "1000" in capped[0]


def test_cuda_without_room_is_a_clear_error():
    cache = CacheConfig(gpu_memory_utilization=0.3)
    with pytest.raises(RuntimeError, match="no memory left for the KV cache.*non-torch 3.00 GiB"):
        num_blocks_for(SPEC, cache, CUDA, _profile())


def test_a_draft_models_share_is_left_free_and_grows_with_the_pool():
    """The draft loads after the target sized its cache, on the same GPU: its weights and
    working memory come off the budget, and each target block costs the draft's block too."""
    cache = CacheConfig(gpu_memory_utilization=UTIL)
    draft = Companion(fixed_bytes=3 * GIB, bytes_per_block=SPEC.bytes_per_block // 4)
    blocks = num_blocks_for(SPEC, cache, CUDA, _profile(), graph_reserve=GIB, companion=draft)
    budget = kv_cache_budget(TOTAL, FREE, RESERVED, PEAK, PEAK_RESERVED, UTIL, GIB)
    assert blocks == (budget - 3 * GIB) // (SPEC.bytes_per_block + draft.bytes_per_block)
    assert blocks * (SPEC.bytes_per_block + draft.bytes_per_block) + 3 * GIB <= budget


def test_the_draft_models_share_is_read_from_its_checkpoint():
    from tests.checkpoints import tiny_checkpoint
    from vgraph.spec.config import SpeculativeConfig
    from vgraph.spec.draft_model import DRAFT_WORKING_BYTES, draft_memory
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_checkpoint(arch="llama")
    hf = AutoConfig.from_pretrained(path)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).state_dict().values())
    target = SimpleNamespace(cache=SimpleNamespace(block_size=16), scheduler=SimpleNamespace(max_num_seqs=4),
                             max_model_len=64)
    fixed, per_block = draft_memory(SpeculativeConfig(method="draft_model", model=path), target, torch.bfloat16)
    head_dim = hf.hidden_size // hf.num_attention_heads
    assert per_block == 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 16 * 2
    assert fixed == params * 2 + DRAFT_WORKING_BYTES + (2 * 4 + 4) * per_block


def test_given_block_count_wins():
    assert num_blocks_for(SPEC, CacheConfig(num_gpu_blocks=7), CUDA, None, max_useful_blocks=3) == 7


def test_profiled_step_samples_on_the_sort_path():
    """The profiled step's sampler must run its most memory-hungry path (a sort over the
    vocabulary per row, for top-k/top-p), or its memory is missing from the budget."""
    lens = dummy_lengths(4096, 1024, 8)
    sched = dummy_prefill(lens, 16, 1 << 20)
    for vocab in (32, 151936):
        md = SamplingMetadata.from_requests([c.request for c in sched.chunks], vocab)
        assert not md.all_greedy
        assert not (md.no_top_k and md.no_top_p), "apply_top_k_top_p would skip its sort"


class FakeAllocator:
    """torch.cuda's memory statistics for a device running one profiled step: 16 GiB of
    weights, 2 GiB cached from loading, 3 GiB outside torch; the step takes 8 GiB of
    activations, and the allocator reserves 1 GiB beyond them (fragmentation)."""

    def __init__(self) -> None:
        self.total, self.other, self.allocated, self.cached = 80 * GIB, 3 * GIB, 16 * GIB, 2 * GIB
        self.peak_allocated = self.peak_reserved = 0

    def reserved(self) -> int:
        return self.allocated + self.cached

    def alloc(self, nbytes: int, extra_reserved: int = 0) -> None:
        self.allocated += nbytes
        self.cached = max(0, self.cached - nbytes) + extra_reserved
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved())

    def release(self, nbytes: int) -> None:
        self.allocated -= nbytes
        self.cached += nbytes

    def empty_cache(self) -> None:
        self.cached = 0

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        stats = {"synchronize": lambda device=None: None, "empty_cache": self.empty_cache,
                 "reset_peak_memory_stats": self.reset_peak_memory_stats,
                 "memory_allocated": lambda device=None: self.allocated,
                 "memory_reserved": lambda device=None: self.reserved(),
                 "max_memory_allocated": lambda device=None: self.peak_allocated,
                 "max_memory_reserved": lambda device=None: self.peak_reserved,
                 "mem_get_info": lambda device=None: (self.total - self.other - self.reserved(), self.total)}
        for name, fn in stats.items():
            monkeypatch.setattr(torch.cuda, name, fn)


class ScratchKV:
    """The profiling run's scratch KV cache: its bytes are released when it is dropped."""

    def __init__(self, allocator: FakeAllocator, nbytes: int) -> None:
        self.allocator, self.nbytes = allocator, nbytes
        allocator.alloc(nbytes)

    def __del__(self) -> None:
        self.allocator.release(self.nbytes)


def test_profile_records_what_the_budget_needs(monkeypatch):
    """ModelRunner._profile_memory on a modelled device: peaks without the scratch KV, and the
    device's free and torch-reserved memory read together after the cache is emptied."""
    device = FakeAllocator()
    device.install(monkeypatch)
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    monkeypatch.setattr(runner_module, "allocate_kv_caches",
                        lambda s, blocks, dev: ScratchKV(device, blocks * s.bytes_per_block))

    steps = []

    def step(graphs: object, sched: object) -> None:
        """The widest prefill peaks at 8 GiB; the decode of every seat (sampler) at less."""
        size = 8 * GIB if not steps else GIB
        steps.append(sched)
        device.alloc(size, extra_reserved=GIB if len(steps) == 1 else 0)
        device.release(size)

    config = SimpleNamespace(cache=CacheConfig(), max_model_len=32,
                             scheduler=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4))
    fake_runner = SimpleNamespace(device=CUDA, config=config, spec=spec, model=None, softmax_scale=1.0,
                                  builder=None, _step=step, kv_scales=None)
    profile = runner_module.ModelRunner._profile_memory(fake_runner)
    assert (profile.peak_bytes, profile.peak_reserved_bytes) == (24 * GIB, 25 * GIB)
    assert (profile.resident_bytes, profile.tokens) == (16 * GIB, 64)
    assert (profile.total_bytes, profile.reserved_bytes) == (80 * GIB, 16 * GIB)
    assert profile.total_bytes - profile.free_bytes - profile.reserved_bytes == 3 * GIB
    prefill, decode = steps
    assert prefill.num_batched_tokens == 64, "the most tokens in one step"
    assert len(decode.chunks) == 4 and decode.num_batched_tokens == 4, "the most sampled rows"


def _anon_huge_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_cpu_kv_pools_are_zeroed_and_start_on_a_huge_page():
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=128, dtype=torch.float32)
    caches = allocate_kv_caches(spec, 40, torch.device("cpu"))  # 5 MiB a pool
    assert len(caches) == 2
    for k, v in caches:
        for pool in (k, v):
            assert pool.shape == (40, 128, 4, 64) and pool.dtype == torch.float32 and pool.is_contiguous()
            assert pool.data_ptr() % HUGE_PAGE_BYTES == 0 and not pool.any()
    k, v = caches[0]
    assert k.data_ptr() != v.data_ptr()
    small = zeros_on_huge_pages((3, 5), torch.bfloat16)  # under one huge page: plain zeros
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16 and not small.any()


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="no transparent huge pages on this machine")
def test_the_kernel_backs_a_cpu_pool_with_huge_pages():
    pool = zeros_on_huge_pages((64, 128, 8, 64), torch.float32)  # 16 MiB, mapped when touched
    before = _anon_huge_kib()
    pool.fill_(1.0)
    # At least one 2 MiB page (how many the kernel finds free depends on fragmentation).
    assert _anon_huge_kib() - before >= HUGE_PAGE_BYTES // 1024, "the pool got no huge page"
    del pool


def _resident_kib() -> int:
    import re
    return int(re.search(r"^Rss:\s+(\d+)", Path("/proc/self/smaps_rollup").read_text(), re.M).group(1))


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="Linux only")
def test_a_prefaulted_cpu_pool_is_mapped_in_the_background_and_stays_zero():
    """``kv_cache_prefault``: every page of the pool is mapped by a background thread (no step
    pays a first touch), and the pool's contents are untouched."""
    import threading
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    blocks = 1024  # 16 MiB a layer's K or V: 64 MiB in all
    before = _resident_kib()
    caches = allocate_kv_caches(spec, blocks, torch.device("cpu"), prefault=True)
    for thread in threading.enumerate():
        if thread.name == "vgraph-kv-prefault":
            thread.join(timeout=60)
    pool_kib = blocks * spec.bytes_per_block // 1024
    assert _resident_kib() - before >= 0.9 * pool_kib, "the pages are mapped before any step touched them"
    assert all(not t.any() for pair in caches for t in pair)
