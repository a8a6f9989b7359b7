"""The fusion targets: a norm or activation with the fp8 quantization of its output.

Each fused op computes exactly what the unfused sequence computes (the references below are
literally that composition), so a fusion pass changes speed, never tokens.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .activation import silu_and_mul_reference
from .fp8 import (check_static_scale, dynamic_per_token_scaled_fp8_quant_reference,
                  static_scaled_fp8_quant_reference)
from .kernels import lazy
from .kernels.host import FP8_DTYPE
from .norm import fused_add_rms_norm_reference, rms_norm_reference
from .registration import vgraph_op

# Triton kernels, imported on first use (kernels.lazy): CPU calls never need them.
act_kernels = lazy("activation")
norm_kernels = lazy("norm")


def rms_norm_static_fp8_quant_reference(x: Tensor, weight: Tensor, scale: Tensor,
                                        eps: float) -> Tensor:
    return static_scaled_fp8_quant_reference(rms_norm_reference(x, weight, eps), scale)


def fused_add_rms_norm_static_fp8_quant_reference(x: Tensor, residual: Tensor, weight: Tensor,
                                                  scale: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    normed, new_residual = fused_add_rms_norm_reference(x, residual, weight, eps)
    return static_scaled_fp8_quant_reference(normed, scale), new_residual


def rms_norm_dynamic_per_token_fp8_quant_reference(x: Tensor, weight: Tensor,
                                                   eps: float) -> tuple[Tensor, Tensor]:
    return dynamic_per_token_scaled_fp8_quant_reference(rms_norm_reference(x, weight, eps))


def silu_and_mul_static_fp8_quant_reference(x: Tensor, scale: Tensor) -> Tensor:
    return static_scaled_fp8_quant_reference(silu_and_mul_reference(x), scale)


def _fp8_like(x: Tensor) -> Tensor:
    return torch.empty_like(x, dtype=FP8_DTYPE)


@vgraph_op("vgraph::rms_norm_static_fp8_quant", mutates_args=())
def rms_norm_static_fp8_quant(x: Tensor, weight: Tensor, scale: Tensor, eps: float) -> Tensor:
    """``static_scaled_fp8_quant(rms_norm(x, weight, eps), scale)`` in one pass."""
    check_static_scale(scale)
    return rms_norm_static_fp8_quant_reference(x, weight, scale, eps)


@rms_norm_static_fp8_quant.register_fake
def _(x: Tensor, weight: Tensor, scale: Tensor, eps: float) -> Tensor:
    return _fp8_like(x)


@rms_norm_static_fp8_quant.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, scale: Tensor, eps: float) -> Tensor:
    check_static_scale(scale)
    return norm_kernels.rms_norm_triton(x, weight, eps, quant=norm_kernels.QUANT_STATIC, scale=scale)


@vgraph_op("vgraph::fused_add_rms_norm_static_fp8_quant", mutates_args=())
def fused_add_rms_norm_static_fp8_quant(x: Tensor, residual: Tensor, weight: Tensor,
                                        scale: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``fused_add_rms_norm`` then static fp8 quant of the normed output; returns (q, residual')."""
    check_static_scale(scale)
    return fused_add_rms_norm_static_fp8_quant_reference(x, residual, weight, scale, eps)


@fused_add_rms_norm_static_fp8_quant.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _fp8_like(x), torch.empty_like(x)


@fused_add_rms_norm_static_fp8_quant.register_kernel("cuda")
def _(x: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    check_static_scale(scale)
    return norm_kernels.rms_norm_triton(x, weight, eps, residual=residual,
                                        quant=norm_kernels.QUANT_STATIC, scale=scale)


@vgraph_op("vgraph::rms_norm_dynamic_per_token_fp8_quant", mutates_args=())
def rms_norm_dynamic_per_token_fp8_quant(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``rms_norm`` then per-token dynamic fp8 quant; returns (q, scales[..., 1])."""
    return rms_norm_dynamic_per_token_fp8_quant_reference(x, weight, eps)


@rms_norm_dynamic_per_token_fp8_quant.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _fp8_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@rms_norm_dynamic_per_token_fp8_quant.register_kernel("cuda")
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return norm_kernels.rms_norm_triton(x, weight, eps, quant=norm_kernels.QUANT_DYNAMIC)


@vgraph_op("vgraph::silu_and_mul_static_fp8_quant", mutates_args=())
def silu_and_mul_static_fp8_quant(x: Tensor, scale: Tensor) -> Tensor:
    """``static_scaled_fp8_quant(silu_and_mul(x), scale)`` in one pass."""
    check_static_scale(scale)
    return silu_and_mul_static_fp8_quant_reference(x, scale)


@silu_and_mul_static_fp8_quant.register_fake
def _(x: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=FP8_DTYPE)


@silu_and_mul_static_fp8_quant.register_kernel("cuda")
def _(x: Tensor, scale: Tensor) -> Tensor:
    check_static_scale(scale)
    return act_kernels.silu_and_mul_triton(x, scale=scale)
