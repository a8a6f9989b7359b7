"""How a checkpoint's full tensors become one rank's shards (Megatron-style tensor parallelism).

- Column-parallel (q/k/v, gate/up): each rank keeps a contiguous block of output rows, that is
  its heads (q and kv heads alike) or its slice of the intermediate size. No communication.
- Row-parallel (o_proj, down_proj): each rank keeps the matching block of input columns; the
  partial products are summed by an all-reduce after the layer. A bias is added once, so rank 0
  holds it and the others hold zeros.
- Vocab-parallel (embed_tokens, lm_head): each rank keeps ``ceil(V / N)`` vocabulary rows (the
  last rank's padded with zero rows); the embedding masks ids outside its range and all-reduces,
  the lm_head's logits are gathered and the padding cut off.
- Everything else (norms, q/k norms, fp8 scales) is replicated.
- LoRA adapters follow their base layers (``shard_lora``): on a column-parallel projection each
  rank keeps A whole and B's block of output rows; on a row-parallel one, A's block of input
  columns and B whole, its partial delta joining the layer's partial product before the
  all-reduce (x A^T B^T = sum over ranks of x_r A_r^T B^T).

Shards are cut from the checkpoint tensor before it is copied into the parameter, so the model
holds only its shard, and CPU float32 projections are packed (models/linear.py) after that, from
the shard.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .state import TPGroup

_COLUMN = ("qkv_proj", "gate_up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def check_divisible(world_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """ValueError naming every size a tensor-parallel group of ``world_size`` cannot split evenly
    (kv heads are not replicated across ranks: a GQA model needs num_key_value_heads % N == 0)."""
    if world_size == 1:
        return
    sizes = {"num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
             "intermediate_size": intermediate_size}
    bad = [f"{name}={value}" for name, value in sizes.items() if value % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {', '.join(bad)}; "
                         "choose a size that divides all of them")


def vocab_rows(vocab_size: int, world_size: int) -> int:
    """Vocabulary rows each rank holds: ``ceil(V / N)``, padding included."""
    return -(-vocab_size // world_size)


def vocab_range(vocab_size: int, group: TPGroup) -> tuple[int, int]:
    """``[start, end)`` of the token ids this rank's embedding and lm_head rows stand for."""
    rows = vocab_rows(vocab_size, group.world_size)
    start = min(group.rank * rows, vocab_size)
    return start, min(start + rows, vocab_size)


def shard_lora(module: str, a: Tensor, b: Tensor, group: TPGroup) -> tuple[Tensor, Tensor]:
    """This rank's part of the LoRA pair (A [r, in], B [out, r]) on the HF projection ``module``."""
    if not group.is_parallel:
        return a, b
    n, rank = group.world_size, group.rank
    if module in ("o_proj", "down_proj"):
        size = a.shape[1] // n
        return a.narrow(1, rank * size, size), b
    size = b.shape[0] // n
    return a, b.narrow(0, rank * size, size)


def _module_kind(param_name: str) -> Optional[str]:
    if param_name.endswith(_VOCAB):
        return "vocab"
    module, _, leaf = param_name.rpartition(".")
    last = module.rpartition(".")[2]
    if last in _COLUMN and leaf in ("weight", "bias"):
        return "column"
    if last in _ROW and leaf == "weight":
        return "row"
    if last in _ROW and leaf == "bias":
        return "row_bias"
    return None


def shard_for_rank(param_name: str, shard: Optional[str], tensor: Tensor, group: TPGroup,
                   vocab_size: int) -> Tensor:
    """This rank's part of the checkpoint ``tensor`` loaded into ``param_name`` (the fused part
    ``shard`` of it, for q/k/v and gate/up); the tensor itself when replicated or at one rank."""
    if not group.is_parallel:
        return tensor
    kind = _module_kind(param_name)
    if kind is None:
        return tensor
    n, rank = group.world_size, group.rank
    if kind == "vocab":
        start, end = vocab_range(vocab_size, group)
        part = tensor[start:end]
        missing = vocab_rows(vocab_size, n) - part.shape[0]
        return torch.cat([part, part.new_zeros(missing, *part.shape[1:])]) if missing else part
    if kind == "row_bias":
        return tensor if rank == 0 else torch.zeros_like(tensor)
    dim = 0 if kind == "column" else 1
    if kind == "column" and shard is None:
        raise ValueError(f"{param_name} is stored fused in the checkpoint; tensor parallelism shards the "
                         "q/k/v and gate/up projections from their separate weights")
    if tensor.shape[dim] % n:
        raise ValueError(f"{param_name}: dim {dim} of size {tensor.shape[dim]} does not split into {n} shards")
    size = tensor.shape[dim] // n
    return tensor.narrow(dim, rank * size, size)
