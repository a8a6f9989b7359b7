"""Device memory planning before the KV cache is sized: the peak of the largest forward the
scheduler may run, and an estimate of what CUDA graph capture will take on top of it.

Graphs are captured after the KV cache exists (they bake its addresses in), so their memory
cannot be measured before the cache is sized; it is estimated from the profiled activations
instead, reserved, and compared with the measurement in the capture log line.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SchedulerConfig
from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from ..worker.dispatch import Buckets, CudaGraphMode
from ..worker.kv_sizing import KVSpec, allocate_kv_caches

# Device memory of a captured graph itself (its kernel nodes and their parameters), besides
# the pool and buffers: deliberately generous, since running out of memory mid-capture is
# worse than a few hundred KV blocks fewer.
FULL_GRAPH_BYTES = 4 << 20
PIECE_GRAPH_BYTES = 256 << 10


@dataclass(frozen=True)
class MemoryProfile:
    peak_bytes: int  # weights + activations of the profiled forward, without its scratch KV cache
    resident_bytes: int  # allocated before the forward ran (weights), without the scratch cache
    tokens: int  # tokens in the profiled forward

    @property
    def activation_bytes_per_token(self) -> float:
        return max(0, self.peak_bytes - self.resident_bytes) / max(1, self.tokens)


@torch.inference_mode()
def profile_memory(model: torch.nn.Module, spec: KVSpec, sched: SchedulerConfig,
                   max_model_len: int, device: torch.device) -> MemoryProfile:
    """Runs one forward over ``max_num_batched_tokens`` dummy tokens and measures it.

    The dummy tokens form as many sequences of at most ``max_model_len`` tokens as needed,
    with a scratch KV cache just large enough for them (freed before returning).
    """
    tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_model_len)
    lens = [min(max_model_len, tokens - s) for s in range(0, tokens, max_model_len)]
    blocks_per_seq = [-(-n // spec.block_size) for n in lens]
    caches = allocate_kv_caches(spec, sum(blocks_per_seq), device)
    table = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = torch.arange(first, first + n)
        first += n
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = AttentionMetadata(slot_mapping=torch.full((tokens,), -1, device=device), block_table=table.to(device),
                             query_start_loc=qsl.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                             max_query_len=max(lens), max_seq_len=max(lens))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    with set_forward_context(ForwardContext(meta, caches, float(model.softmax_scale))):
        hidden = model(torch.zeros(tokens, dtype=torch.long, device=device), positions.to(device))
        model.compute_logits(hidden[-sched.max_num_seqs:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    scratch = sum(blocks_per_seq) * spec.bytes_per_block
    del caches
    torch.cuda.empty_cache()
    return MemoryProfile(int(peak - scratch), int(resident - scratch), tokens)


def estimate_cudagraph_bytes(profile: MemoryProfile, model: torch.nn.Module, buckets: Buckets,
                             mode: CudaGraphMode, max_model_len: int, block_size: int) -> int:
    """Device memory CUDA graph capture will take (see cudagraph.py for what it holds):

    - the shared pool: one forward's activations at the largest captured size;
    - PIECEWISE buffers: per compiled piece (L + 1), staged attention output and the
      outputs (q, k, v, residual) at the largest token bucket;
    - FULL buffers: the persistent decode inputs and the hidden-state output;
    - the graphs themselves, at a generous fixed size each.
    """
    full = list(buckets.full) if mode.has_full else []
    pieces_sizes = list(buckets.piecewise) if mode.has_piecewise else []
    if not full and not pieces_sizes:
        return 0
    elt = torch.empty((), dtype=model.dtype).element_size()
    largest = max(full + pieces_sizes)
    pool = profile.activation_bytes_per_token * largest
    num_pieces = model.num_layers + 1
    q_width, kv_width = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    piece_io = elt * (2 * q_width + 2 * kv_width + model.hidden_size)
    piece_buffers = num_pieces * piece_io * max(pieces_sizes, default=0)
    per_seq = model.hidden_size * elt + 3 * 8 + 2 * 4 + 4 * -(-max_model_len // block_size)
    full_buffers = per_seq * max(full, default=0)
    graphs = len(full) * FULL_GRAPH_BYTES + len(pieces_sizes) * num_pieces * PIECE_GRAPH_BYTES
    return int(pool + piece_buffers + full_buffers + graphs)
