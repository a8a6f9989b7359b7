"""``vgraph::lora_add``: many LoRA adapters applied to one batch, each row by its own slot.

Multi-LoRA serving keeps every resident adapter of a projection in fixed-size stacked
buffers, one slot per adapter, and gives each token of the flat batch the slot of its
request (-1: the base model alone). The op adds ``x @ A[slot].T @ B[slot].T`` to the base
projection's output in two steps, as Punica/S-LoRA do: *shrink* (``x`` onto the rank space,
``[T, slices * R]``) and *expand* (each slice's rank block back onto its output columns).

Layout (why stacked and fixed: loading an adapter copies into these buffers in place, so a
CUDA graph captured over them stays valid and nothing recompiles):
  ``lora_a``  [slots, slices * R, in]: slice s of slot i is rows ``s*R .. s*R + R - 1``
  ``lora_b``  one [slots, out_s, R] per slice; the slices' outputs are the base output's
              columns in order (a fused q|k|v or gate|up projection has 3 or 2 slices)
  ``token_slots`` [T] int32/int64, the slot of each row of ``x``; -1 adds nothing
The scaling (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA) is folded into B when an
adapter is loaded, and an adapter of rank below R is zero-padded, which adds exact zeros.

The default implementation (the reference and oracle) gathers each row's A and B and runs
batched matmuls. The CPU kernel groups rows by slot: one GEMM per resident adapter, which
reads each adapter's weights once (see ``perf/lora_op.py`` for the comparison). CUDA runs
Triton shrink/expand kernels (kernels/lora.py) with no host sync, so they can be captured.
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from .kernels import lazy
from .registration import vgraph_op

# Triton kernels, imported on first use (kernels.lazy): CPU calls never need them.
kernels = lazy("lora")


def _check(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> None:
    """Shape rules of the op; raises ValueError saying which operand breaks which."""
    if base.dim() != 2 or x.dim() != 2 or lora_a.dim() != 3:
        raise ValueError(f"lora_add expects base [T, out], x [T, in], lora_a [slots, slices*R, in]; got "
                         f"{tuple(base.shape)}, {tuple(x.shape)}, {tuple(lora_a.shape)}")
    if not lora_b or any(b.dim() != 3 for b in lora_b):
        raise ValueError("lora_add expects lora_b as one [slots, out_s, R] tensor per slice")
    slots, rows, in_features = lora_a.shape
    rank = lora_b[0].shape[2]
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, lora_a {in_features}")
    if rows != len(lora_b) * rank:
        raise ValueError(f"lora_a holds {rows} rank rows, {len(lora_b)} slices of rank {rank} need "
                         f"{len(lora_b) * rank}")
    if any(b.shape[0] != slots or b.shape[2] != rank for b in lora_b):
        raise ValueError(f"every lora_b must be [{slots}, out_s, {rank}]; got "
                         f"{[tuple(b.shape) for b in lora_b]}")
    if sum(b.shape[1] for b in lora_b) != base.shape[1]:
        raise ValueError(f"the slices' outputs {[b.shape[1] for b in lora_b]} do not sum to the base "
                         f"output's {base.shape[1]} columns")
    if token_slots.dim() != 1 or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be a 1-D int32/int64 tensor, got {token_slots.dtype} "
                         f"{tuple(token_slots.shape)}")


def lora_add_reference(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor],
                       token_slots: Tensor) -> Tensor:
    """Each row's own A and B gathered, then batched matmuls in float32."""
    _check(base, x, lora_a, lora_b, token_slots)
    rank = lora_b[0].shape[2]
    active = (token_slots >= 0).unsqueeze(-1)
    index = token_slots.clamp(min=0).long()
    shrunk = torch.bmm(lora_a[index].float(), x.float().unsqueeze(-1)).squeeze(-1)  # [T, slices*R]
    shrunk = torch.where(active, shrunk, 0.0)
    deltas = [torch.bmm(b[index].float(), shrunk[:, i * rank:(i + 1) * rank].unsqueeze(-1)).squeeze(-1)
              for i, b in enumerate(lora_b)]
    return base + torch.cat(deltas, dim=-1).to(base.dtype)


@vgraph_op("vgraph::lora_add", mutates_args=())
def lora_add(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> Tensor:
    """``base + x @ A[slot].T @ B[slot].T`` row by row (see the module docstring for layouts)."""
    return lora_add_reference(base, x, lora_a, lora_b, token_slots)


@lora_add.register_fake
def _(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> Tensor:
    _check(base, x, lora_a, lora_b, token_slots)
    return torch.empty_like(base)


def lora_add_grouped(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor],
                     token_slots: Tensor) -> Tensor:
    """The CPU kernel: rows grouped by slot, one shrink GEMM and one expand GEMM per slice for
    each slot in use. Why: a decode batch is a few rows per adapter, and gathering A and B per
    row (the reference) copies every adapter's weights once per row instead of once."""
    _check(base, x, lora_a, lora_b, token_slots)
    out = base.clone()
    rank = lora_b[0].shape[2]
    offsets = [0]
    for b in lora_b:
        offsets.append(offsets[-1] + b.shape[1])
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(-1)
        shrunk = x.index_select(0, rows) @ lora_a[slot].to(x.dtype).t()
        for i, b in enumerate(lora_b):
            delta = shrunk[:, i * rank:(i + 1) * rank] @ b[slot].to(x.dtype).t()
            out[:, offsets[i]:offsets[i + 1]].index_add_(0, rows, delta.to(out.dtype))
    return out


@lora_add.register_kernel("cpu")
def _(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> Tensor:
    return lora_add_grouped(base, x, lora_a, lora_b, token_slots)


@lora_add.register_kernel("cuda")
def _(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> Tensor:
    _check(base, x, lora_a, lora_b, token_slots)
    shrunk = kernels.lora_shrink_triton(x, lora_a, token_slots)
    return kernels.lora_expand_triton(base, shrunk, lora_b, token_slots)
