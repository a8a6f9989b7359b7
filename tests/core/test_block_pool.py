"""Block pool and KV cache manager: accounting, ref counts, LRU eviction, the hash chain."""
from __future__ import annotations

import tracemalloc

import pytest

from vgraph.core.block_pool import ROOT_HASH, BlockPool, hash_block_tokens
from vgraph.core.kv_cache_manager import KVCacheManager, token_slice
from vgraph.core.request import Request
from vgraph.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=8), cache_salt=salt)


def make_manager(num_blocks: int = 8, caching: bool = True, max_model_len: int = 64) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, BS, caching), max_model_len)


def admit(manager: KVCacheManager, request: Request) -> int:
    """Looks up the prefix cache and allocates the rest of the prompt, as the scheduler does."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return num_hit


# -- BlockPool ------------------------------------------------------------------------------

def test_allocate_and_free_accounting():
    pool = BlockPool(4, BS, enable_prefix_caching=True)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    blocks = pool.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and pool.num_free_blocks == 1 and pool.usage == 0.75
    assert all(pool.ref_cnt(b) == 1 for b in blocks)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a failed allocation takes nothing
    pool.free(blocks)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(RuntimeError):
        pool.free([blocks[0]])


def test_lru_eviction_of_cached_blocks():
    pool = BlockPool(4, BS, enable_prefix_caching=True)
    a, b, c, d = pool.allocate(4)
    for block, name in ((a, b"a"), (b, b"b"), (c, b"c")):
        assert pool.cache_block(block, hash_block_tokens(None, [ord(name)] * BS))
    pool.free([b])
    pool.free([a])
    pool.free([c])
    pool.free([d])  # unhashed: reused before any cached block
    assert pool.free_queue() == [d, b, a, c]
    # A hit on a free cached block takes it out of the queue; freeing it again makes it newest.
    pool.touch([b])
    assert pool.ref_cnt(b) == 1 and pool.num_free_blocks == 3
    pool.free([b])
    assert pool.free_queue() == [d, a, c, b]
    hash_a = pool.block_hash(a)
    assert pool.allocate(2) == [d, a]
    assert pool.get_cached_block(hash_a) is None and pool.block_hash(a) is None  # evicted
    assert pool.num_cached_blocks == 2


def test_cached_hash_survives_free_until_evicted():
    pool = BlockPool(2, BS, enable_prefix_caching=True)
    (block,) = pool.allocate(1)
    block_hash = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_block(block, block_hash)
    pool.free([block])
    assert pool.get_cached_block(block_hash) == block
    pool.allocate(1)  # takes the other (unhashed) block first
    assert pool.get_cached_block(block_hash) == block


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2, BS, enable_prefix_caching=True)
    first, second = pool.allocate(2)
    block_hash = hash_block_tokens(None, [1, 2, 3, 4])
    assert pool.cache_block(first, block_hash)
    assert not pool.cache_block(second, block_hash)
    assert pool.get_cached_block(block_hash) == first and pool.block_hash(second) is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, BS, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    assert not pool.cache_block(block, hash_block_tokens(None, [1, 2, 3, 4]))
    assert pool.num_cached_blocks == 0


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, BS, enable_prefix_caching=True)
    (block,) = pool.allocate(1)
    block_hash = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_block(block, block_hash)
    assert not pool.reset_prefix_cache()
    pool.free([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(block_hash) is None and pool.block_hash(block) is None


def test_hash_chain_depends_on_prefix_and_salt():
    tokens = [5, 6, 7, 8]
    root = hash_block_tokens(None, tokens)
    assert root == hash_block_tokens(None, list(tokens))
    assert hash_block_tokens(ROOT_HASH, tokens) == root  # None means the root parent
    under_a = hash_block_tokens(hash_block_tokens(None, [1, 1, 1, 1]), tokens)
    under_b = hash_block_tokens(hash_block_tokens(None, [2, 2, 2, 2]), tokens)
    assert len({root, under_a, under_b}) == 3
    assert hash_block_tokens(None, tokens, b"tenant") != root
    assert len(root) == 32


def test_a_huge_pool_is_built_without_a_record_per_block():
    """0.9 of an H200 with a tiny model is ~33M blocks: a record per block took ~9 s and ~4.6 GB
    of host memory. Building 10M blocks must allocate a bounded, small amount."""
    tracemalloc.start()
    try:
        pool = BlockPool(10**7, BS, enable_prefix_caching=True)
        built, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert built < 64 * 1024, f"{built} bytes to build the pool"
    assert pool.num_free_blocks == 10**7 and pool.usage == 0.0
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2] and pool.ref_cnt(1) == 1 and pool.ref_cnt(3) == 0
    assert pool.num_free_blocks == 10**7 - 3
    pool.free(blocks)
    assert pool.num_free_blocks == 10**7


def test_free_queue_segments_keep_eviction_order():
    """Released unhashed blocks (latest first), then never-used ones, then hashed ones (least
    recently freed first): the order one queue over every block would have."""
    pool = BlockPool(8, BS, enable_prefix_caching=True)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, hash_block_tokens(None, [1] * BS))
    pool.cache_block(c, hash_block_tokens(None, [3] * BS))
    pool.free([c, b, a, d])
    assert pool.free_queue() == [d, b, 4, 5, 6, 7, c, a]
    assert pool.allocate(3) == [d, b, 4]
    assert pool.reset_prefix_cache() is False  # three blocks are referenced


def test_a_prefix_hit_on_a_never_used_block_takes_it_out_of_order():
    pool = BlockPool(6, BS, enable_prefix_caching=True)
    pool.touch([3])
    assert pool.ref_cnt(3) == 1 and pool.num_free_blocks == 5
    assert pool.free_queue() == [0, 1, 2, 4, 5]
    assert pool.allocate(4) == [0, 1, 2, 4]
    pool.free([3])
    assert pool.free_queue() == [3, 5] and pool.allocate(2) == [3, 5]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    with pytest.raises(ValueError, match="not a free block"):
        BlockPool(2, BS, True).touch([2])


def test_reset_keeps_free_blocks_in_place():
    pool = BlockPool(3, BS, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, hash_block_tokens(None, [1] * BS))
    pool.free([a, b])
    assert pool.reset_prefix_cache() and pool.block_hash(a) is None
    assert pool.free_queue() == [b, 2, a] and pool.allocate(3) == [b, 2, a]


# -- KVCacheManager -------------------------------------------------------------------------

def test_token_slice_matches_all_token_ids():
    request = make_request("r", [1, 2, 3, 4, 5])
    request.output_token_ids.extend([6, 7, 8])
    for start in range(9):
        for end in range(start, 9):
            assert token_slice(request, start, end) == request.all_token_ids[start:end]


def test_allocate_slots_grows_and_fails_atomically():
    manager = make_manager(num_blocks=3)
    request = make_request("r", range(6))
    assert manager.allocate_slots(request, 6)
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 2)  # fits in block 2
    assert len(request.block_ids) == 2
    other = make_request("o", range(9))
    before = manager.num_free_blocks
    assert not manager.allocate_slots(other, 9)  # needs 3, one free
    assert other.block_ids == [] and manager.num_free_blocks == before
    manager.free(request)
    assert request.block_ids == [] and manager.num_free_blocks == 3


def test_allocate_beyond_max_model_len_is_a_bug():
    manager = make_manager(max_model_len=8)
    with pytest.raises(ValueError):
        manager.allocate_slots(make_request("r", range(9)), 9)


def test_prefix_hits_are_shared_and_ref_counted():
    manager = make_manager(num_blocks=8)
    pool = manager.pool
    prompt = list(range(10))  # two full blocks and a partial one
    first = make_request("a", prompt)
    assert admit(manager, first) == 0
    second = make_request("b", prompt + [99])
    assert admit(manager, second) == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    assert [pool.ref_cnt(b) for b in first.block_ids] == [2, 2, 1]
    assert pool.prefix_cache_queries == 10 + 11 and pool.prefix_cache_hits == 8
    manager.free(first)
    assert [pool.ref_cnt(b) for b in second.block_ids] == [1, 1, 1]
    manager.free(second)
    assert manager.num_free_blocks == 8


def test_hit_never_covers_whole_prompt():
    manager = make_manager()
    prompt = list(range(8))  # exactly two blocks
    admit(manager, make_request("a", prompt))
    hits, num_hit = manager.get_computed_blocks(make_request("b", prompt))
    assert len(hits) == 1 and num_hit == BS


def test_hits_on_free_blocks_count_against_free_space():
    manager = make_manager(num_blocks=3)
    first = make_request("a", range(9))  # 3 blocks, the first two get cached
    admit(manager, first)
    manager.free(first)
    second = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])  # 2 hits + 2 new = 4 > 3
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8
    assert not manager.allocate_slots(second, second.num_tokens - num_hit, hits)
    assert manager.num_free_blocks == 3 and second.block_ids == []
    assert all(manager.pool.ref_cnt(b) == 0 for b in hits)


def test_same_block_tokens_under_different_prefix_do_not_hit():
    manager = make_manager()
    admit(manager, make_request("a", [1, 1, 1, 1, 7, 7, 7, 7, 0]))
    hits, _ = manager.get_computed_blocks(make_request("b", [2, 2, 2, 2, 7, 7, 7, 7, 0]))
    assert hits == []


def test_salt_isolates_prefixes():
    manager = make_manager()
    prompt = list(range(9))
    admit(manager, make_request("a", prompt, salt="alice"))
    assert manager.get_computed_blocks(make_request("b", prompt, salt="bob"))[1] == 0
    assert manager.get_computed_blocks(make_request("c", prompt))[1] == 0
    assert manager.get_computed_blocks(make_request("d", prompt, salt="alice"))[1] == 8


def test_generated_tokens_fill_cacheable_blocks():
    manager = make_manager()
    request = make_request("a", range(6))
    admit(manager, request)
    for token in (100, 101, 102):  # decode tokens 6, 7 and 8 fill block 1
        request.output_token_ids.append(token)
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        manager.cache_blocks(request, request.num_computed_tokens)
    assert manager.pool.num_cached_blocks == 2
    follow_up = make_request("b", request.all_token_ids + [5])
    assert manager.get_computed_blocks(follow_up)[0] == request.block_ids[:2]


def test_free_releases_tail_first():
    manager = make_manager(num_blocks=4)
    request = make_request("a", range(13))  # 4 blocks, 3 full
    admit(manager, request)
    blocks = list(request.block_ids)
    manager.free(request)
    # The partial (unhashed) block goes to the front; cached ones tail-first, prefix last.
    assert manager.pool.free_queue() == [blocks[3], blocks[2], blocks[1], blocks[0]]


def test_caching_disabled_never_hits():
    manager = make_manager(caching=False)
    prompt = list(range(9))
    admit(manager, make_request("a", prompt))
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert manager.pool.prefix_cache_queries == 0
