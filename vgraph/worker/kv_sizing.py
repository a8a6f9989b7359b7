"""How many KV blocks fit: from a profiling run on CUDA, from a size option on CPU."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config import CacheConfig
from .huge_pages import prefault_in_background, zeros_on_huge_pages

logger = logging.getLogger("vgraph")


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the cache's: the model's, or float8_e4m3fn (--kv-cache-dtype fp8)

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer: an fp8 cache's blocks are half a 16-bit one's, so the same
        memory holds twice the tokens."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        """The dtype as the startup log names it (float8_e4m3fn, bfloat16, ...)."""
        return str(self.dtype).removeprefix("torch.")


def kv_cache_scales(model: Any, cache: CacheConfig) -> Optional[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The per-layer (k_scale, v_scale) tensors the attention op reads for an fp8 cache, or
    None for an unquantized one. Scales of 1.0 (a checkpoint without k_scale/v_scale) are
    logged, as vLLM warns, since values beyond +-448 then saturate."""
    if not cache.fp8_kv_cache:
        return None
    if model.kv_scales_loaded:
        logger.info("fp8 KV cache: k_scale/v_scale read from the checkpoint")
    else:
        logger.warning("fp8 KV cache: the checkpoint has no k_scale/v_scale, so every scale is 1.0 "
                       "(K/V beyond +-448 saturate; accuracy may suffer)")
    return model.kv_cache_scales()


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory of the largest step the scheduler may run (measured on CUDA), and of the
    device once it ran. Peaks leave out the step's scratch KV cache."""

    peak_bytes: int  # torch's peak allocation: weights + activations + sampler
    peak_reserved_bytes: int  # torch's peak reservation: peak_bytes + what fragmentation wasted
    resident_bytes: int  # allocated before the step ran (weights)
    tokens: int  # tokens in the profiled step
    total_bytes: int  # the device's memory
    free_bytes: int  # free after the step, the allocator's cache emptied
    reserved_bytes: int  # reserved by torch's allocator at that same moment

    @property
    def activation_bytes_per_token(self) -> float:
        return max(0, self.peak_bytes - self.resident_bytes) / max(1, self.tokens)


def kv_cache_budget(total: int, free: int, torch_reserved: int, torch_peak_allocated: int,
                    torch_peak_reserved: int, utilization: float, graph_reserve: int = 0) -> int:
    """Bytes the KV cache may take so that the device never holds more than
    ``total * utilization`` at the worst step (vLLM's accounting). Subtracted:

    - non-torch memory: used on the device (``total - free``) but not reserved by torch's
      allocator, so invisible to its statistics: the CUDA context, cuBLAS/NCCL workspaces,
      other processes;
    - torch's peak allocation in the profiled step (weights, activations, sampler);
    - fragmentation: what the allocator reserved beyond that at its peak, and cannot hand out;
    - what CUDA graph capture will take (``graph_reserve``).

    ``free`` and ``torch_reserved`` must be read at the same moment. The old formula took
    ``max(peak, total - free)``, dropping the non-torch memory whenever the peak was larger:
    at high utilization the KV cache then overcommitted the device.
    """
    non_torch = max(0, total - free - torch_reserved)
    fragmentation = max(0, torch_peak_reserved - torch_peak_allocated)
    used = non_torch + torch_peak_allocated + fragmentation + graph_reserve
    return int(total * utilization) - used


@dataclass(frozen=True)
class Companion:
    """Another model that will share the device with this one (a speculative draft model,
    loaded after this runner sizes its cache): memory it takes up front (weights, working
    memory, its spare blocks) and the bytes of its own KV per block of this cache (its pool
    grows with this one's)."""

    fixed_bytes: int
    bytes_per_block: int


def num_blocks_for(spec: KVSpec, cache: CacheConfig, device: torch.device,
                   profile: MemoryProfile | None = None, graph_reserve: int = 0,
                   max_useful_blocks: int | None = None, companion: Companion | None = None) -> int:
    """Blocks for the pool: ``cache.num_gpu_blocks`` when given; else on CUDA what the memory
    ``profile`` leaves (``graph_reserve`` kept free for CUDA graphs, and a ``companion``'s
    share), on CPU ``cpu_kv_cache_gib`` worth.

    Either is capped at ``max_useful_blocks`` (every seat filled to max_model_len): more
    cannot be used at once, and a large device with a small model would otherwise build a
    pool of tens of millions of blocks for nothing.
    """
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    if device.type == "cuda":
        if profile is None:
            raise ValueError("sizing the KV cache on CUDA needs a memory profile (or num_gpu_blocks)")
        blocks = _blocks_from_profile(spec, cache, profile, graph_reserve, companion)
    else:
        blocks = max(1, int(cache.cpu_kv_cache_gib * 2**30 // spec.bytes_per_block))
    return _capped(blocks, max_useful_blocks)


def _blocks_from_profile(spec: KVSpec, cache: CacheConfig, p: MemoryProfile, graph_reserve: int,
                         companion: Companion | None = None) -> int:
    util = cache.gpu_memory_utilization
    fixed = companion.fixed_bytes if companion else 0
    budget = kv_cache_budget(p.total_bytes, p.free_bytes, p.reserved_bytes, p.peak_bytes,
                             p.peak_reserved_bytes, util, graph_reserve + fixed)
    gib = 2**30
    breakdown = (f"{p.total_bytes * util / gib:.2f} GiB allowed by gpu_memory_utilization={util}; "
                 f"torch peak {p.peak_bytes / gib:.2f} GiB (+{(p.peak_reserved_bytes - p.peak_bytes) / gib:.2f} "
                 f"fragmentation), non-torch {max(0, p.total_bytes - p.free_bytes - p.reserved_bytes) / gib:.2f} "
                 f"GiB, CUDA graphs {graph_reserve / gib:.2f} GiB")
    per_block = spec.bytes_per_block
    if companion:
        breakdown += (f", the draft model {fixed / gib:.2f} GiB and {companion.bytes_per_block} bytes of its KV "
                      f"per block")
        per_block += companion.bytes_per_block
    blocks = int(max(0, budget) // per_block)
    if blocks <= 0:
        raise RuntimeError(f"no memory left for the KV cache: {breakdown}; raise "
                           "--gpu-memory-utilization or lower --max-num-batched-tokens")
    logger.info("KV cache budget %.2f GiB: %s", budget / gib, breakdown)
    return blocks


def _capped(blocks: int, max_useful_blocks: int | None) -> int:
    if not max_useful_blocks or blocks <= max_useful_blocks:
        return blocks
    logger.info("KV cache capped at %d blocks, from the %d that fit: max_num_seqs x max_model_len "
                "uses no more", max_useful_blocks, blocks)
    return max_useful_blocks


def usable_max_model_len(max_model_len: int, num_blocks: int, block_size: int, device: torch.device) -> int:
    """The longest sequence the KV cache can hold, warning when it is below ``max_model_len``.

    Why: a sequence alone must fit in the pool (else preemption could never make room), so
    the scheduler ends generation at the pool's capacity. Without this limit a request that
    asked for more came back cut short with finish reason "length" and no explanation; with
    it, the engine rejects such requests up front and reports the real limit.
    """
    capacity = num_blocks * block_size
    if capacity >= max_model_len:
        return max_model_len
    knob = "--kv-cache-gib (cpu_kv_cache_gib)" if device.type == "cpu" else "--gpu-memory-utilization"
    logger.warning("the KV cache holds %d tokens (%d blocks of %d), fewer than max_model_len %d: "
                   "sequences (prompt + output) are limited to %d tokens and longer requests are "
                   "rejected; raise %s or --num-gpu-blocks for the full length, or set "
                   "--max-model-len %d", capacity, num_blocks, block_size, max_model_len, capacity,
                   knob, capacity)
    return capacity


def allocate_kv_caches(spec: KVSpec, num_blocks: int, device: torch.device,
                       prefault: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) pool, left unwritten on CUDA: zeroing a 64 GiB pool took 4.7 s of
    an H200's warm start, and nothing reads a slot before a step has written it.

    Why nothing does: a slot gets K/V only from ``reshape_and_cache``, which the attention op
    (``unified_attention``) runs on the step's new tokens before it attends, so a sequence's
    keys 0..seq_len-1 are all written when they are read (a prefix-cache hit reads blocks an
    earlier request wrote; the block pool hands out a cached block only with its hash chain).
    The attention kernels read keys below ``seq_len`` only: the Triton kernel loads every key
    tile and block-table entry under a ``k_pos < seq_len`` mask with ``other=0`` (a masked
    value is 0, never the garbage times a zero weight, which would be NaN for a NaN), and a
    row with ``seq_len`` 0 (padding, and every row of a FULL graph's capture) returns before
    any load; the CPU kernels walk keys 0..seq_len-1 the same way. Padding rows write
    nowhere (slot -1). tests/worker/test_kv_garbage.py runs the engine over pools filled with
    NaN and checks it gives the same tokens.

    On CPU the pool is on huge pages, which the decode attention streams faster
    (vgraph/worker/huge_pages.py); there it is zero anyway, and free: the kernel maps zeroed
    pages when they are first touched. ``prefault`` (CPU): map them all now, in the
    background (``prefault_in_background``), so that no step pays for a first touch."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def pool() -> torch.Tensor:
        if device.type == "cpu":
            return zeros_on_huge_pages(shape, spec.dtype)
        return torch.empty(shape, dtype=spec.dtype, device=device)
    caches = [(pool(), pool()) for _ in range(spec.num_layers)]
    if prefault and device.type == "cpu":
        if prefault_in_background([t for pair in caches for t in pair]) is not None:
            logger.info("KV cache: mapping its %.2f GiB in the background", num_blocks * spec.bytes_per_block / 2**30)
    return caches
