"""The pool of paged KV-cache blocks: reference counts, an LRU free queue and the prefix cache.

Every layer's KV cache is one preallocated tensor cut into ``num_blocks`` blocks of
``block_size`` token slots; this pool only hands out block *ids*, so the same id addresses the
same slots in every layer.

A block is either referenced (``ref_cnt > 0``, owned by one or more running requests) or sits
in the free queue. A free block may still hold a valid, hashed prefix: it stays findable in the
prefix cache until the allocator takes it for something else. The free queue is therefore
ordered for eviction: blocks with no hash come first (reusing them loses nothing), then hashed
blocks least-recently-freed first.

The pool may have tens of millions of blocks (a large GPU, a small model), most never used,
so nothing is built per block: the free queue is three segments, in order: released unhashed
blocks (``OrderedDict``, the latest first), the never-used blocks (a counter over
``0..num_blocks-1``), released hashed blocks (``OrderedDict``, least recently freed first).
Only blocks that were handed out have a ref count or a hash entry. Inserts happen only at the
two ends, so these segments are exactly the one queue a block-per-entry structure would hold;
``OrderedDict`` gives O(1) pop-front, append and removal from the middle (a prefix-cache hit
on a free block pulls it out of the queue).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

BlockHash = bytes

# Parent of a sequence's first block. A fixed 32-byte value keeps every hashed message the same
# shape (32-byte parent + tokens), so a first block cannot collide with a later one.
ROOT_HASH: BlockHash = hashlib.sha256(b"vgraph-prefix-cache-root").digest()


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: Sequence[int],
                      salt: Optional[bytes] = None) -> BlockHash:
    """sha256(parent hash + the block's token ids [+ salt]).

    Chaining the parent makes a block's identity cover the whole prefix before it, so equal
    token blocks under different prefixes never share KV. The salt (only passed for a
    sequence's first block; the chain carries it onward) isolates tenants that must not share
    cache entries.
    """
    digest = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    digest.update(array("q", token_ids).tobytes())
    if salt:
        digest.update(salt)
    return digest.digest()


class BlockPool:
    """Fixed set of KV block ids ``0..num_blocks-1`` with ref counts and a prefix cache; built
    in O(1) whatever ``num_blocks`` is."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_cnt: dict[int, int] = {}  # referenced blocks only
        self._hash: dict[int, BlockHash] = {}  # hashed blocks only
        # The free queue's three segments (see the module docstring).
        self._free_unhashed: OrderedDict[int, None] = OrderedDict()
        self._next_unused = 0  # ids from here on were never handed out, except ``_claimed``
        self._claimed: set[int] = set()  # never-used ids taken out of order (prefix-cache hits)
        self._free_hashed: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        # Prefix-cache statistics, in tokens (the metrics endpoint reports hits / queries).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- accounting -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request (cached-but-free blocks included)."""
        never_used = self.num_blocks - self._next_unused - len(self._claimed)
        return len(self._free_unhashed) + never_used + len(self._free_hashed)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt.get(block_id, 0)

    def block_hash(self, block_id: int) -> Optional[BlockHash]:
        return self._hash.get(block_id)

    def free_queue(self) -> list[int]:
        """The free block ids in eviction order (first is reused first); for tests and debugging
        (it lists every never-used block)."""
        never_used = (b for b in range(self._next_unused, self.num_blocks) if b not in self._claimed)
        return [*self._free_unhashed, *never_used, *self._free_hashed]

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation -------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes ``num_blocks`` blocks from the front of the free queue, each with ref count 1.

        A hashed block taken here is evicted from the prefix cache: its slots are about to be
        overwritten. Raises ``RuntimeError`` when not enough blocks are free; callers check
        ``num_free_blocks`` first so that a failed request changes nothing.
        """
        free = self.num_free_blocks
        if num_blocks > free:
            raise RuntimeError(f"cannot allocate {num_blocks} blocks, only {free} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id = self._pop_free()
            self._evict(block_id)
            self._ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to each block (prefix-cache hits); a free one leaves the free queue."""
        for block_id in block_ids:
            count = self._ref_cnt.get(block_id, 0)
            if count == 0:
                self._remove_free(block_id)
            self._ref_cnt[block_id] = count + 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block, in the given order.

        A block whose count reaches zero joins the free queue: at the back if it is hashed (the
        most recently used prefix is evicted last), at the front if not (nothing to keep).
        """
        for block_id in block_ids:
            count = self._ref_cnt.get(block_id, 0) - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than referenced")
            if count > 0:
                self._ref_cnt[block_id] = count
                continue
            del self._ref_cnt[block_id]
            if block_id in self._hash:
                self._free_hashed[block_id] = None
            else:
                self._free_unhashed[block_id] = None
                self._free_unhashed.move_to_end(block_id, last=False)

    def _pop_free(self) -> int:
        """The front of the free queue (the caller checked that it is not empty)."""
        if self._free_unhashed:
            return self._free_unhashed.popitem(last=False)[0]
        while self._next_unused < self.num_blocks:
            block_id = self._next_unused
            self._next_unused += 1
            if block_id not in self._claimed:
                return block_id
            self._claimed.discard(block_id)  # taken earlier, out of order
        return self._free_hashed.popitem(last=False)[0]

    def _remove_free(self, block_id: int) -> None:
        """Takes a free block out of the queue, wherever it sits."""
        if block_id in self._free_unhashed:
            del self._free_unhashed[block_id]
        elif block_id in self._free_hashed:
            del self._free_hashed[block_id]
        elif self._next_unused <= block_id < self.num_blocks and block_id not in self._claimed:
            self._claimed.add(block_id)
        else:
            raise ValueError(f"block {block_id} is not a free block of this pool")

    # -- prefix cache -----------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> Optional[int]:
        """The block holding the prefix identified by ``block_hash``, if still cached."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Registers a full, computed block under its chain hash.

        When another block already holds the same prefix (two requests computed it at the same
        time) the existing entry wins and this block stays unhashed, to be reused first once
        freed. Returns whether the block was registered.
        """
        if not self.enable_prefix_caching or block_id in self._hash:
            return False
        if block_hash in self._cached:
            return False
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; only possible when no block is referenced.

        Used after weights change, when cached KV would be stale. Returns whether it reset.
        Free blocks keep their place in the queue.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        self._hash.clear()
        self._cached.clear()
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash.pop(block_id, None)
        if block_hash is not None:
            del self._cached[block_hash]
