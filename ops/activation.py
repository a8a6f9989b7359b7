"""``vgraph::silu_and_mul``: the SwiGLU activation on a packed [gate | up] projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .kernels import lazy
from .registration import vgraph_op

# Triton kernels, imported on first use (kernels.lazy): CPU calls never need them.
kernels = lazy("activation")


def _check_even(x: Tensor) -> int:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul expects [..., 2*d] (gate | up); got shape {tuple(x.shape)}")
    return x.shape[-1] // 2


def silu_and_mul_reference(x: Tensor) -> Tensor:
    d = _check_even(x)
    return F.silu(x[..., :d]) * x[..., d:]


@vgraph_op("vgraph::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x of last dim 2d."""
    return silu_and_mul_reference(x)


@silu_and_mul.register_fake
def _(x: Tensor) -> Tensor:
    d = _check_even(x)
    return x.new_empty((*x.shape[:-1], d))


@silu_and_mul.register_kernel("cuda")
def _(x: Tensor) -> Tensor:
    _check_even(x)
    return kernels.silu_and_mul_triton(x)
