"""Per-request view of the block pool: block tables, prefix-cache lookups and registration.

The scheduler asks three things of it: how much of a new request's prefix is already cached
(``get_computed_blocks``), whether the blocks for this step's tokens can be had
(``allocate_slots``, all or nothing, so a failed request is left untouched and the scheduler can
preempt and retry), and to release a request (``free``). After each step it registers the
blocks that became full (``cache_blocks``) so later requests can share them.
"""
from __future__ import annotations

from typing import Optional, Protocol

from .block_pool import BlockHash, BlockPool, hash_block_tokens
from .request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TokenSequence(Protocol):
    """A prompt and the tokens generated after it (the scheduler's request, the runner's copy)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]


def token_slice(request: TokenSequence, start: int, end: int) -> list[int]:
    """``(prompt + output)[start:end]`` without concatenating the whole sequence.

    ``all_token_ids`` builds a new list of every token; per-step callers only need a few.
    """
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    output = request.output_token_ids
    if start >= num_prompt:
        return output[start - num_prompt:end - num_prompt]
    return prompt[start:] + output[:end - num_prompt]


class KVCacheManager:
    """Owns the mapping from requests to blocks of one ``BlockPool``."""

    def __init__(self, pool: BlockPool, max_model_len: int) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_model_len = max_model_len
        # Width of the runner's block table.
        self.max_blocks_per_request = cdiv(max_model_len, pool.block_size)
        # Chain hashes of each request's full blocks, computed once and extended as it grows.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's full blocks: (block ids, tokens covered).

        At most ``(num_tokens - 1) // block_size`` blocks are returned, so at least the last
        token is computed and yields logits for the next one. Looks only; no reference taken.
        """
        if not self.pool.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._hashes(request, max_hit_blocks)[:max_hit_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[int]] = None) -> bool:
        """Makes room for ``num_new_tokens`` more tokens; all or nothing.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks`` (only at
        admission, when the request holds no blocks); they are not yet counted in
        ``request.num_computed_tokens``. On success the hits and the new blocks are appended to
        ``request.block_ids``; the caller advances ``num_computed_tokens`` past the hits.
        Returns False, changing nothing, when the free queue cannot supply the blocks.
        """
        hits = new_computed_blocks or []
        num_tokens = request.num_computed_tokens + num_new_tokens
        if not hits and num_tokens <= len(request.block_ids) * self.block_size and num_tokens <= self.max_model_len:
            return True  # a decode inside its last block: the common case, nothing to allocate
        if hits and request.block_ids:
            raise ValueError(f"request {request.request_id}: prefix hits can only be added at admission")
        num_tokens = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id}: {num_tokens} tokens exceed "
                             f"max_model_len={self.max_model_len}")
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - len(request.block_ids) - len(hits))
        # Hits on free blocks leave the free queue too, so they compete with the new blocks.
        num_free_hits = sum(1 for block_id in hits if self.pool.ref_cnt(block_id) == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return False
        if not request.block_ids and self.pool.enable_prefix_caching:
            self.pool.record_prefix_lookup(request.num_tokens, len(hits) * self.block_size)
        if hits:
            self.pool.touch(hits)
            request.block_ids.extend(hits)
            self._num_cached_blocks[request.request_id] = len(hits)
        if num_new_blocks:
            request.block_ids.extend(self.pool.allocate(num_new_blocks))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's blocks that are full and computed up to ``num_computed_tokens``.

        Prompt and generated tokens alike: a block filled during decoding is as shareable as a
        prompt block (multi-turn chats resend the previous answer).
        """
        if not self.pool.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        for index in range(start, num_full):
            self.pool.cache_block(request.block_ids[index], hashes[index])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so its tail is evicted before its prefix.

        The prefix is the part other requests are most likely to share.
        """
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        self._block_hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chain hashes of the request's first ``num_blocks`` full blocks (extending the memo)."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        num_blocks = min(num_blocks, request.num_tokens // self.block_size)
        size = self.block_size
        for index in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            salt = request.prefix_salt if index == 0 else None
            tokens = token_slice(request, index * size, (index + 1) * size)
            hashes.append(hash_block_tokens(parent, tokens, salt))
        return hashes
