"""``vgraph::linear`` and ``vgraph::linear_silu_and_mul``: a model's 16-bit projections on CUDA.

Why ops of their own: a batch-1 decode step is a weight stream, and there torch's GEMM
library reached 2.4-3.9 TB/s on an H200's 8B-shaped projections and 0.3-2.4 TB/s on the
0.5B-shaped ones, where vgraph's one-row kernel (ops/kernels/gemv.py) reached 3.3-4.2 and
0.6-2.6 (``python -m perf.decode_kernels_ab``). So a call with one or two rows of a bf16/fp16
weight takes the GEMV kernel (batch 1 reaches the compiled forward padded to two rows), and every other call (prefill, a batch of decode rows, fp32, CPU) is
``F.linear`` as before. Which one runs is decided per call from the row count, so one compiled
graph serves both: the batch-1 and -2 FULL CUDA graphs capture the GEMV, larger buckets the library.

``linear_silu_and_mul`` is a [gate | up] projection followed by SwiGLU; at one or two rows both
come out of one kernel (the activation kernel and the [M, 2d] intermediate disappear), otherwise it
is ``F.linear`` then ``vgraph::silu_and_mul``.

Heads (>= ``LIBRARY_FROM_ROWS`` output rows) stay with the library: at 128k-152k rows the two
were within 3% of each other, either way.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .kernels import lazy
from .kernels.host import GEMV_MAX_ROWS
from .registration import vgraph_op

kernels = lazy("gemv")

ONE_ROW_DTYPES = (torch.bfloat16, torch.float16)
LIBRARY_FROM_ROWS = 65536


def one_row_kernel(x: Tensor, weight: Tensor) -> bool:
    """Does this call take the GEMV kernel (on CUDA)? One or two rows (a batch-1 step of the
    compiled forward has two: ``COMPILED_MIN_ROWS``) of a 16-bit weight, both contiguous along
    K, and not a vocabulary-sized head."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS and weight.dtype in ONE_ROW_DTYPES
            and x.dtype == weight.dtype
            and weight.shape[0] < LIBRARY_FROM_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1)


def _check(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear wants x [..., K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")


def _half(weight: Tensor) -> int:
    if weight.shape[0] % 2:
        raise ValueError(f"a [gate | up] weight has an even row count; got {tuple(weight.shape)}")
    return weight.shape[0] // 2


@vgraph_op("vgraph::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x @ weight.T (+ bias)``."""
    _check(x, weight, bias)
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    _check(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@linear.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    if one_row_kernel(x, weight):
        return kernels.gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_and_mul_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    gate_up = F.linear(x, weight, bias)
    d = _half(weight)
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]


@vgraph_op("vgraph::linear_silu_and_mul", mutates_args=())
def linear_silu_and_mul(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``silu(g) * u`` for ``[g | u] = x @ weight.T (+ bias)``."""
    _check(x, weight, bias)
    return linear_silu_and_mul_reference(x, weight, bias)


@linear_silu_and_mul.register_fake
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    _check(x, weight, bias)
    return x.new_empty((*x.shape[:-1], _half(weight)))


@linear_silu_and_mul.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    _check(x, weight, bias)
    if one_row_kernel(x, weight):
        return kernels.gemv_silu_mul_triton(x, weight, bias)
    return torch.ops.vgraph.silu_and_mul(F.linear(x, weight, bias))
