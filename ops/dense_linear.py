"""``vgraph::linear`` and ``vgraph::linear_silu_and_mul``: a model's 16-bit projections on CUDA.

Why ops of their own: a batch-1 decode step is a weight stream, and at one row torch's GEMM
library reached 2.5-4.2 TB/s on an H200's 8B-shaped projections and 0.3-2.4 TB/s on the
0.5B-shaped ones, where vgraph's GEMV kernel (ops/kernels/gemv.py) reached 3.1-4.2 and
0.6-2.6 (``python -m perf.decode_kernels_ab``: results/decode-kernels-cuda*.json). Which one
runs is decided per call from its shape (``takes_gemv``), so one compiled graph serves every
batch: a FULL CUDA graph captures whichever its bucket's rows take.

- One row (a batch-1 decode step, compiled or eager): the kernel, for every projection but a
  head.
- Two rows (batch 2): the kernel only for small weights (fewer than ``TWO_ROW_MAX_OUT`` rows of fewer than
  ``TWO_ROW_MAX_IN``). Its second accumulator doubles the registers, and on the 8B shapes it
  lost to the library (qkv 0.83x, gate_up 0.82x, down 0.84x, o 1.13x) while on the 0.5B's
  qkv, o and down it won (1.44x, 1.59x, 1.31x); gate_up, 9728 rows, lost (0.75x).
- Anything else (prefill, larger decode batches, fp32, heads of >= ``LIBRARY_FROM_ROWS`` rows,
  where the two were within 5%): ``F.linear`` as before.

``linear_silu_and_mul`` is a [gate | up] projection followed by SwiGLU. Where its stacked
weight takes the kernel, both come out of one kernel (the activation kernel and the [M, 2d]
intermediate disappear: 8B 62.1 -> 57.4 us, 0.5B 10.4 -> 6.9 us at one row); otherwise it is
``F.linear`` then ``vgraph::silu_and_mul``.

``rms_norm_linear`` / ``fused_add_rms_norm_linear`` are an RMSNorm (after a residual add)
followed by either projection, made by the compiler pass ``passes/norm_linear.py`` where a
norm's output feeds only that projection. Where the projection takes the kernel, the norm
runs inside it (``gemv.rms_norm_gemv_triton``: its launch and its [M, K] round trip are
gone; the row's squares add in another order, so a value can move in its last bit); otherwise,
and on every other device, they are the two ops in turn.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .kernels import lazy
from .kernels.host import GEMV_MAX_ROWS
from .registration import vgraph_op

_vg = torch.ops.vgraph

kernels = lazy("gemv")

GEMV_DTYPES = (torch.bfloat16, torch.float16)
LIBRARY_FROM_ROWS = 65536
TWO_ROW_MAX_OUT = 4096
TWO_ROW_MAX_IN = 8192


def takes_gemv(x: Tensor, weight: Tensor) -> bool:
    """Does this call run vgraph's GEMV kernel (on CUDA)? See the module doc for the rule and
    the measurements behind it."""
    if (x.dim() != 2 or weight.dtype not in GEMV_DTYPES or x.dtype != weight.dtype
            or weight.shape[0] >= LIBRARY_FROM_ROWS or x.stride(-1) != 1 or weight.stride(-1) != 1):
        return False
    rows = x.shape[0]
    if rows == 1:
        return True
    return (rows == GEMV_MAX_ROWS and weight.shape[0] < TWO_ROW_MAX_OUT
            and weight.shape[1] < TWO_ROW_MAX_IN)


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
    if takes_gemv(x, weight):
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
    if takes_gemv(x, weight):  # shapes checked at tracing (the fake) and by the kernel's launcher
        return kernels.gemv_silu_mul_triton(x, weight, bias)
    return torch.ops.vgraph.silu_and_mul(F.linear(x, weight, bias))


def _project(x: Tensor, weight: Tensor, bias: Optional[Tensor], silu_mul: bool) -> Tensor:
    """The projection a fused norm feeds: ``vgraph::linear`` or ``vgraph::linear_silu_and_mul``."""
    return (_vg.linear_silu_and_mul if silu_mul else _vg.linear)(x, weight, bias)


def _check_norm(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Optional[Tensor], silu_mul: bool) -> None:
    _check(x, weight, bias)
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not match x {tuple(x.shape)}")
    if silu_mul:
        _half(weight)


def _normed_out(x: Tensor, weight: Tensor, silu_mul: bool) -> Tensor:
    return x.new_empty((*x.shape[:-1], _half(weight) if silu_mul else weight.shape[0]))


def _takes_fused(x: Tensor, weight: Tensor, *others: Tensor) -> bool:
    return takes_gemv(x, weight) and all(t.is_contiguous() and t.dtype == x.dtype for t in (x, *others))


@vgraph_op("vgraph::rms_norm_linear", mutates_args=())
def rms_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Optional[Tensor],
                    silu_mul: bool) -> Tensor:
    """``linear(rms_norm(x))`` (``silu_mul``: ``linear_silu_and_mul``)."""
    _check_norm(x, norm_weight, weight, bias, silu_mul)
    return _project(_vg.rms_norm(x, norm_weight, eps), weight, bias, silu_mul)


@rms_norm_linear.register_fake
def _(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Optional[Tensor],
      silu_mul: bool) -> Tensor:
    _check_norm(x, norm_weight, weight, bias, silu_mul)
    return _normed_out(x, weight, silu_mul)


@rms_norm_linear.register_kernel("cuda")
def _(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Optional[Tensor],
      silu_mul: bool) -> Tensor:
    if _takes_fused(x, weight):
        return kernels.rms_norm_gemv_triton(x, kernels.NormPrologue(norm_weight, eps), weight, bias, silu_mul)[0]
    return _project(_vg.rms_norm(x, norm_weight, eps), weight, bias, silu_mul)


@vgraph_op("vgraph::fused_add_rms_norm_linear", mutates_args=())
def fused_add_rms_norm_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                              bias: Optional[Tensor], silu_mul: bool) -> tuple[Tensor, Tensor]:
    """``fused_add_rms_norm`` then the projection of its normed output; returns
    ``(projection, residual')``."""
    _check_norm(x, norm_weight, weight, bias, silu_mul)
    normed, new_residual = _vg.fused_add_rms_norm(x, residual, norm_weight, eps)
    return _project(normed, weight, bias, silu_mul), new_residual


@fused_add_rms_norm_linear.register_fake
def _(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Optional[Tensor],
      silu_mul: bool) -> tuple[Tensor, Tensor]:
    _check_norm(x, norm_weight, weight, bias, silu_mul)
    return _normed_out(x, weight, silu_mul), torch.empty_like(x)


@fused_add_rms_norm_linear.register_kernel("cuda")
def _(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Optional[Tensor],
      silu_mul: bool) -> tuple[Tensor, Tensor]:
    if _takes_fused(x, weight, residual):
        return kernels.rms_norm_gemv_triton(x, kernels.NormPrologue(norm_weight, eps, residual), weight, bias,
                                            silu_mul)
    normed, new_residual = _vg.fused_add_rms_norm(x, residual, norm_weight, eps)
    return _project(normed, weight, bias, silu_mul), new_residual
