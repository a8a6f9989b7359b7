"""LoRA shrink and expand kernels (``vgraph::lora_add`` on CUDA), indexed per token.

Each program handles one token and one block of output columns, reading the token's slot
from ``token_slots`` on the device: no host sync and no data-dependent grid, so a CUDA graph
captures them once for a batch size and replays them whatever adapters the slots hold. A
slot of -1 masks every adapter load (shrink writes zeros, expand copies the base row).

These are per-token GEMVs: right for decode batches, where each token's adapter differs and
the weights are read from L2; prefill-sized batches would want segment-grouped tiles
(tl.dot over a run of tokens sharing a slot), which is later work measured on a GPU.
"""
from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl

from .common import next_pow2

_BLOCK_N = 32
_BLOCK_K = 128


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, n_rows, k_dim,
                   stride_xt, stride_as, stride_an, stride_ot,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[t, n] = sum_k x[t, k] * A[slot(t), n, k], in float32; zero where slot(t) < 0.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # A row without an adapter reads nothing: its bound on k is 0 (a scalar mask term
    # would do the same, but the interpreter rejects a block & scalar mask).
    k_bound = tl.where(slot >= 0, k_dim, 0)
    slot = tl.maximum(slot, 0)
    col_mask = cols < n_rows
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_bound
        xk = tl.load(x_ptr + t * stride_xt + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_an + ks[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(out_ptr + t * stride_ot + cols, acc, mask=col_mask)


@triton.jit
def _expand_kernel(base_ptr, h_ptr, b_ptr, slots_ptr, out_ptr, out_cols, rank, col_offset, h_offset,
                   stride_bt, stride_ht, stride_bs, stride_bn, stride_ot,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # out[t, off + n] = base[t, off + n] + sum_r h[t, h_off + r] * B[slot(t), n, r].
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    r_mask = rs < tl.where(slot >= 0, rank, 0)  # no adapter: nothing read, delta 0
    slot = tl.maximum(slot, 0)
    col_mask = cols < out_cols
    h = tl.load(h_ptr + t * stride_ht + h_offset + rs, mask=r_mask, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + cols[:, None] * stride_bn + rs[None, :],
                mask=col_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(b * h[None, :], axis=1)
    base = tl.load(base_ptr + t * stride_bt + col_offset + cols, mask=col_mask, other=0.0)
    y = base.to(tl.float32) + delta
    tl.store(out_ptr + t * stride_ot + col_offset + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with stride 1."""
    return t if t.stride(-1) == 1 else t.contiguous()


def lora_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """``[T, in]`` -> float32 ``[T, slices * R]``: each row times its slot's stacked A."""
    x, lora_a = _unit_rows(x), _unit_rows(lora_a)
    tokens, (_, n_rows, k_dim) = x.shape[0], lora_a.shape
    out = torch.empty(tokens, n_rows, dtype=torch.float32, device=x.device)
    if tokens > 0 and n_rows > 0:
        grid = (tokens, triton.cdiv(n_rows, _BLOCK_N))
        _shrink_kernel[grid](x, lora_a, token_slots, out, n_rows, k_dim,
                             x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
                             BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4)
    return out


def lora_expand_triton(base: torch.Tensor, shrunk: torch.Tensor, lora_b: List[torch.Tensor],
                       token_slots: torch.Tensor) -> torch.Tensor:
    """``base`` plus each slice's rank block of ``shrunk`` times its slot's B, as a new tensor."""
    base = _unit_rows(base)
    out = torch.empty_like(base)
    tokens, rank = base.shape[0], lora_b[0].shape[2]
    col_offset = 0
    for i, b in enumerate(lora_b):
        b = _unit_rows(b)
        cols = b.shape[1]
        if tokens > 0 and cols > 0:
            grid = (tokens, triton.cdiv(cols, _BLOCK_N))
            _expand_kernel[grid](base, shrunk, b, token_slots, out, cols, rank, col_offset, i * rank,
                                 base.stride(0), shrunk.stride(0), b.stride(0), b.stride(1), out.stride(0),
                                 BLOCK_N=_BLOCK_N, BLOCK_R=next_pow2(rank), num_warps=4)
        col_offset += cols
    return out
