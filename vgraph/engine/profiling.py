"""Peak device memory of the largest forward the scheduler may run, to size the KV cache."""
from __future__ import annotations

import torch

from ..config import SchedulerConfig
from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from ..worker.kv_sizing import KVSpec, allocate_kv_caches


@torch.inference_mode()
def profile_peak_bytes(model: torch.nn.Module, spec: KVSpec, sched: SchedulerConfig,
                       max_model_len: int, device: torch.device) -> int:
    """Runs one forward over ``max_num_batched_tokens`` dummy tokens and returns peak bytes.

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
    with set_forward_context(ForwardContext(meta, caches, float(model.softmax_scale))):
        hidden = model(torch.zeros(tokens, dtype=torch.long, device=device), positions.to(device))
        model.compute_logits(hidden[-sched.max_num_seqs:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    scratch = sum(blocks_per_seq) * spec.bytes_per_block
    del caches
    torch.cuda.empty_cache()
    return int(peak - scratch)  # weights + activations, without the scratch cache
