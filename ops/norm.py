"""RMSNorm ops: ``vgraph::rms_norm`` and ``vgraph::fused_add_rms_norm``.

Numerics follow Hugging Face's Llama RMSNorm so that fp32 models match it token for token:
normalize in fp32, cast to the activation dtype, then multiply by the weight.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kernels import lazy
from .registration import vgraph_op

# Triton kernels, imported on first use (kernels.lazy): CPU calls never need them.
kernels = lazy("norm")


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * y.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor,
                                 eps: float) -> tuple[Tensor, Tensor]:
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


@vgraph_op("vgraph::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: ``weight * (x / rms(x))``."""
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@rms_norm.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return kernels.rms_norm_triton(x, weight, eps)


@vgraph_op("vgraph::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
    """``residual' = x + residual`` then RMSNorm of it; returns ``(normed, residual')``."""
    return fused_add_rms_norm_reference(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@fused_add_rms_norm.register_kernel("cuda")
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return kernels.rms_norm_triton(x, weight, eps, residual=residual)
