"""How many KV blocks fit: from a profiling run on CUDA, from a size option on CPU."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import CacheConfig

logger = logging.getLogger("vgraph")


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory of the largest step the scheduler may run (measured on CUDA)."""

    peak_bytes: int  # weights + activations + sampler of the profiled step, without its scratch KV
    resident_bytes: int  # allocated before the step ran (weights)
    tokens: int  # tokens in the profiled step

    @property
    def activation_bytes_per_token(self) -> float:
        return max(0, self.peak_bytes - self.resident_bytes) / max(1, self.tokens)


def num_blocks_for(spec: KVSpec, cache: CacheConfig, device: torch.device,
                   profile_peak_bytes: int = 0, max_useful_blocks: int | None = None) -> int:
    """Blocks for the pool. ``profile_peak_bytes``: peak device memory of a max-size forward.

    On CPU the pool is also capped at ``max_useful_blocks`` (every seat filled to
    max_model_len), so a small model does not allocate and zero a whole gigabyte for nothing.
    """
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * cache.gpu_memory_utilization - max(profile_peak_bytes, total - free)
        blocks = int(budget // spec.bytes_per_block)
        if blocks <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache: {total * cache.gpu_memory_utilization / 2**30:.1f} GiB "
                f"allowed by gpu_memory_utilization={cache.gpu_memory_utilization}, "
                f"{profile_peak_bytes / 2**30:.1f} GiB used by weights and activations; raise "
                "--gpu-memory-utilization or lower --max-num-batched-tokens")
        return blocks
    blocks = max(1, int(cache.cpu_kv_cache_gib * 2**30 // spec.bytes_per_block))
    return min(blocks, max_useful_blocks) if max_useful_blocks else blocks


def allocate_kv_caches(spec: KVSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [(torch.zeros(shape, dtype=spec.dtype, device=device),
             torch.zeros(shape, dtype=spec.dtype, device=device)) for _ in range(spec.num_layers)]
