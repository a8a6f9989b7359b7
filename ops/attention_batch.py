"""Random paged-attention batches, laid out the way the runner lays them out.

Shared by ``vgraph ops check`` and the op benchmark: each sequence's K/V sit in shuffled
cache blocks, and the metadata describes a flat batch of (context_len, query_len) sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import reshape_and_cache_reference


@dataclass
class RandomPagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    softmax_scale: float

    def to(self, device: str) -> "RandomPagedBatch":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return RandomPagedBatch(**moved)

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.query_start_loc,
                self.seq_lens, self.max_query_len, self.softmax_scale)


def random_paged_batch(specs: list[tuple[int, int]], kv_heads: int, group: int, head_dim: int,
                       block_size: int, dtype: torch.dtype) -> RandomPagedBatch:
    """specs: (context_len, query_len) per sequence; all their K/V are written to the cache."""
    seq_lens = [c + q for c, q in specs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks).tolist()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    block_table = torch.zeros(len(specs), max(max(blocks_per_seq), 1), dtype=torch.int32)
    for i, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        blocks = torch.tensor([order.pop() for _ in range(n_blocks)], dtype=torch.int64)
        block_table[i, :n_blocks] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        reshape_and_cache_reference(torch.randn(seq_len, kv_heads, head_dim).to(dtype),
                                    torch.randn(seq_len, kv_heads, head_dim).to(dtype),
                                    k_cache, v_cache, slots)
    q_lens = torch.tensor([q for _, q in specs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn(int(query_start_loc[-1]), kv_heads * group, head_dim).to(dtype)
    return RandomPagedBatch(q, k_cache, v_cache, block_table, query_start_loc,
                            torch.tensor(seq_lens, dtype=torch.int32), int(q_lens.max()),
                            head_dim ** -0.5)
