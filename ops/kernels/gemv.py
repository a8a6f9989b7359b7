"""One-row projection (``y = x @ W.T + b`` for a single row of ``x``): a decode step at batch 1.

Why a kernel of its own: at one row a projection is a pure weight stream (every weight byte
is read once and used for one multiply-add), so its speed is the fraction of DRAM bandwidth
it reaches. A GEMM library picks tensor-core tiles padded to 8-64 rows and split-K schemes
for this case; which one it picks, and how close it gets, depends on the shape. This kernel
is the plain shape of the problem: program ``i`` owns ``BLOCK_N`` output features, walks
their rows of ``W`` ``BLOCK_K`` elements at a time (each row contiguous: coalesced 16-byte
loads), multiplies by the matching slice of ``x`` in fp32, and reduces across K once at the
end (the accumulator is a [BLOCK_N, BLOCK_K] tile, so the loop carries no reduction).
Whether it beats the library on a given GPU and shape is measured, not assumed
(``python -m perf.decode_kernels_ab``); the launch configuration is a ``GemvConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.where(n_mask, offs_n, 0).to(tl.int64) * stride_wn  # clamped: no mask on W loads
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        if EVEN_K:
            w = tl.load(w_ptr + rows[:, None] + k[None, :])
            x = tl.load(x_ptr + k)
        else:
            w = tl.load(w_ptr + rows[:, None] + k[None, :], mask=(k < K)[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                config: GemvConfig = GemvConfig(), out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [1, K] @ weight[N, K].T (+ bias[N])`` -> ``[1, N]`` in x's dtype."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv wants x [1, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("gemv wants a weight and an x contiguous along K")
    n, k = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight if bias is None else bias, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, num_warps=config.num_warps, num_stages=config.num_stages)
    return y
