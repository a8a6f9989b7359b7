"""fp8 (e4m3) quantization and the fp8 GEMM.

Conventions used across vgraph: fp8 is ``torch.float8_e4m3fn``, saturating at +-448. A static
scale is a one-element fp32 tensor that the input is divided by; a dynamic per-token scale is
``max|row| / 448``, floored at ``FP8_MIN_SCALE`` so that an all-zero row gives zeros.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .kernels import lazy
from .kernels.host import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from .registration import vgraph_op

# Triton kernels, imported on first use (kernels.lazy): CPU calls never need them.
kernels = lazy("fp8")


def check_static_scale(scale: Tensor) -> None:
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"a static fp8 scale is a one-element float32 tensor; got "
                         f"{scale.dtype} of shape {tuple(scale.shape)}")


def static_scaled_fp8_quant_reference(x: Tensor, scale: Tensor) -> Tensor:
    return (x.float() / scale.reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dynamic_per_token_scaled_fp8_quant_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    xf = x.float()
    scales = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


@vgraph_op("vgraph::static_scaled_fp8_quant", mutates_args=())
def static_scaled_fp8_quant(x: Tensor, scale: Tensor) -> Tensor:
    """Quantizes with one per-tensor scale: ``clamp(x / scale, -448, 448)`` as e4m3."""
    check_static_scale(scale)
    return static_scaled_fp8_quant_reference(x, scale)


@static_scaled_fp8_quant.register_fake
def _(x: Tensor, scale: Tensor) -> Tensor:
    return torch.empty_like(x, dtype=FP8_DTYPE)


@static_scaled_fp8_quant.register_kernel("cuda")
def _(x: Tensor, scale: Tensor) -> Tensor:
    check_static_scale(scale)
    return kernels.static_scaled_fp8_quant_triton(x, scale)


def _check_rows(x: Tensor) -> None:
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"per-token quantization needs a non-empty last dim; got {tuple(x.shape)}")


@vgraph_op("vgraph::dynamic_per_token_scaled_fp8_quant", mutates_args=())
def dynamic_per_token_scaled_fp8_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """Quantizes each row with its own scale; returns ``(q, scales[..., 1])``."""
    _check_rows(x)
    return dynamic_per_token_scaled_fp8_quant_reference(x)


@dynamic_per_token_scaled_fp8_quant.register_fake
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    return (torch.empty_like(x, dtype=FP8_DTYPE),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))


@dynamic_per_token_scaled_fp8_quant.register_kernel("cuda")
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    _check_rows(x)
    return kernels.dynamic_per_token_scaled_fp8_quant_triton(x)


# ---------------------------------------------------------------------------- fp8 GEMM


def _check_gemm(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor) -> None:
    if a.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_gemm takes e4m3 operands; got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_gemm: a is [M, K] and w is [N, K]; got {tuple(a.shape)} and {tuple(w.shape)}")
    if a_scale.numel() not in (1, a.shape[0]) or w_scale.numel() not in (1, w.shape[0]):
        raise ValueError("fp8_gemm: a_scale is per-tensor or per-row [M, 1]; w_scale per-tensor or per-channel [N, 1]")


def fp8_gemm_reference(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                       out_dtype: torch.dtype, bias: Optional[Tensor] = None) -> Tensor:
    """Dequantize both operands to fp32, multiply in fp32, add bias, cast: the exact meaning."""
    a32 = a.float() * a_scale.float().reshape(-1, 1)
    w32 = w.float() * w_scale.float().reshape(-1, 1)
    out = a32 @ w32.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _scaled_mm_usable(a: Tensor, w: Tensor) -> bool:
    """Whether torch._scaled_mm can run this product on this GPU: fp8 tensor cores (sm89+)
    and K, N multiples of 16 (cuBLASLt's fp8 alignment)."""
    if torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    return a.shape[1] % 16 == 0 and w.shape[0] % 16 == 0


def _needs_fp32_epilogue(a_scale: Tensor, w_scale: Tensor, out_dtype: torch.dtype,
                         has_bias: bool) -> bool:
    """Whether ``torch._scaled_mm`` cannot finish the product itself, so it runs with fp32
    output and the rest (scales, bias, cast) follows in fp32.

    PyTorch rejects a bias with fp32 output, and row-wise scales (a per-token activation
    scale) with any output but bf16. The alternative for fp16/fp32 models, dequantizing the
    whole weight on every call, costs a weight-sized buffer and a full-precision GEMM per
    layer per step; the fp32 epilogue costs one [M, N] fp32 buffer and keeps the fp32
    accumulation (a bf16 output would round each value to 8 bits, coarser than fp16).
    """
    per_tensor = a_scale.numel() == 1 and w_scale.numel() == 1
    if per_tensor:
        return has_bias and out_dtype == torch.float32
    return out_dtype != torch.bfloat16


def _scaled_mm_fused(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                     out_dtype: torch.dtype, bias: Optional[Tensor]) -> Tensor:
    """Scales and bias in ``_scaled_mm``'s epilogue (per-tensor, or row-wise with bf16 out)."""
    if a_scale.numel() == 1 and w_scale.numel() == 1:
        sa, sw = a_scale.float().reshape(()), w_scale.float().reshape(())
    else:  # row-wise: a per row [M, 1], w per column of the output [1, N]
        sa = a_scale.float().reshape(-1, 1).expand(a.shape[0], 1).contiguous()
        sw = w_scale.float().reshape(1, -1).expand(1, w.shape[0]).contiguous()
    bias_arg = bias.to(out_dtype) if bias is not None else None
    return torch._scaled_mm(a.contiguous(), w.t(), scale_a=sa, scale_b=sw, bias=bias_arg,
                            out_dtype=out_dtype)


def _scaled_mm_fp32_epilogue(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor,
                             out_dtype: torch.dtype, bias: Optional[Tensor]) -> Tensor:
    """``_scaled_mm`` to fp32 (per-tensor scales, or unit ones for row-wise), then the row and
    column scales and the bias in place in fp32, then one cast (see _needs_fp32_epilogue)."""
    per_tensor = a_scale.numel() == 1 and w_scale.numel() == 1
    if per_tensor:
        sa, sw = a_scale.float().reshape(()), w_scale.float().reshape(())
    else:
        sa = sw = torch.ones((), dtype=torch.float32, device=a.device)
    out = torch._scaled_mm(a.contiguous(), w.t(), scale_a=sa, scale_b=sw, out_dtype=torch.float32)
    if not per_tensor:
        out.mul_(a_scale.float().reshape(-1, 1)).mul_(w_scale.float().reshape(1, -1))
    if bias is not None:
        out.add_(bias.float())
    return out.to(out_dtype)


@vgraph_op("vgraph::fp8_gemm", mutates_args=())
def fp8_gemm(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, out_dtype: torch.dtype,
             bias: Optional[Tensor] = None) -> Tensor:
    """``(a * a_scale) @ (w * w_scale).T + bias`` for e4m3 ``a [M, K]`` and ``w [N, K]``."""
    _check_gemm(a, a_scale, w, w_scale)
    return fp8_gemm_reference(a, a_scale, w, w_scale, out_dtype, bias)


@fp8_gemm.register_fake
def _(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, out_dtype: torch.dtype,
      bias: Optional[Tensor] = None) -> Tensor:
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


@fp8_gemm.register_kernel("cuda")
def fp8_gemm_cuda(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, out_dtype: torch.dtype,
                  bias: Optional[Tensor] = None) -> Tensor:
    """fp8 tensor cores through ``torch._scaled_mm``, within the rules PyTorch sets for it."""
    _check_gemm(a, a_scale, w, w_scale)
    if not _scaled_mm_usable(a, w):
        # GPUs without fp8 tensor cores (before sm89) or unaligned shapes: dequantized product.
        return fp8_gemm_reference(a, a_scale, w, w_scale, out_dtype, bias)
    if _needs_fp32_epilogue(a_scale, w_scale, out_dtype, bias is not None):
        return _scaled_mm_fp32_epilogue(a, a_scale, w, w_scale, out_dtype, bias)
    return _scaled_mm_fused(a, a_scale, w, w_scale, out_dtype, bias)
