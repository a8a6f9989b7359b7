"""The CUDA fp8 GEMM's use of ``torch._scaled_mm``, checked on CPU against a stand-in that
enforces PyTorch's rules for it (no GPU has run this path; these rules are what crashed)."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import Tensor

import vgraph.ops.fp8 as fp8
from vgraph.ops.fp8 import (dynamic_per_token_scaled_fp8_quant_reference, fp8_gemm_cuda,
                            fp8_gemm_reference, static_scaled_fp8_quant_reference)
from vgraph.ops.kernels.common import FP8_DTYPE, FP8_MAX

M, K, N = 8, 64, 48


class ScaledMM:
    """Computes ``_scaled_mm`` in fp32 and raises where PyTorch does (ATen's checks for
    tensor-wise and row-wise scaling); records the output dtype of each call."""

    def __init__(self) -> None:
        self.out_dtypes: list[torch.dtype] = []

    def __call__(self, a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor,
                 bias: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> Tensor:
        self._check_operands(a, b)
        out_dtype = out_dtype or a.dtype
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            self._check_row_wise(a, b, scale_a, scale_b, out_dtype)
        if bias is not None:
            if out_dtype == torch.float32:
                raise RuntimeError("Bias is not supported when out_dtype is set to Float32")
            if bias.dtype != out_dtype:
                raise RuntimeError(f"Bias must be {out_dtype} to compute {out_dtype} output")
        self.out_dtypes.append(out_dtype)
        out = (a.float() @ b.float()) * scale_a.float() * scale_b.float()
        return (out + bias.float() if bias is not None else out).to(out_dtype)

    @staticmethod
    def _check_operands(a: Tensor, b: Tensor) -> None:
        assert a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE, "operands stay in fp8"
        assert a.stride(1) == 1 and b.stride(0) == 1, "mat1 row-major, mat2 column-major"
        assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0

    @staticmethod
    def _check_row_wise(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor,
                        out_dtype: torch.dtype) -> None:
        if out_dtype != torch.bfloat16:
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert scale_a.is_contiguous() and scale_b.is_contiguous()


@pytest.fixture
def scaled_mm(monkeypatch: pytest.MonkeyPatch) -> ScaledMM:
    """An sm90 GPU on CPU: ``_scaled_mm`` stubbed; falling back to dequantizing is a failure."""
    fake = ScaledMM()
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def no_dequantized_fallback(*args, **kwargs) -> Tensor:
        raise AssertionError("fp8_gemm dequantized the weight instead of using _scaled_mm")
    monkeypatch.setattr(fp8, "fp8_gemm_reference", no_dequantized_fallback)
    return fake


def _operands(per_token: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    x, wf = torch.randn(M, K), torch.randn(N, K)
    if per_token:
        a, sa = dynamic_per_token_scaled_fp8_quant_reference(x)
    else:
        sa = torch.tensor([x.abs().max().item() / FP8_MAX])
        a = static_scaled_fp8_quant_reference(x, sa)
    sw = torch.tensor([wf.abs().max().item() / FP8_MAX])
    return a, sa, static_scaled_fp8_quant_reference(wf, sw), sw


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_scheme_and_dtype_runs_on_scaled_mm(scaled_mm, out_dtype, per_token, with_bias):
    """Static fp8 with biased projections (Qwen2 q/k/v) in fp32 used to pass the bias to an fp32
    ``_scaled_mm`` and crash; per-token fp8 in fp16/fp32 used to dequantize the weight."""
    a, sa, w, sw = _operands(per_token)
    bias = torch.randn(N).to(out_dtype) if with_bias else None
    out = fp8_gemm_cuda(a, sa, w, sw, out_dtype, bias)
    ref = fp8_gemm_reference(a, sa, w, sw, out_dtype, bias)  # the exact meaning, in fp32
    assert out.dtype == out_dtype and len(scaled_mm.out_dtypes) == 1
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[out_dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("out_dtype,expected", [(torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.float32),
                                                 (torch.float32, torch.float32)])
def test_per_token_product_keeps_fp32_accumulation_outside_bf16(scaled_mm, out_dtype, expected):
    """Row-wise ``_scaled_mm`` only outputs bf16: other dtypes run it to fp32 with unit scales
    and apply the row and column scales after, rather than rounding every output to bf16."""
    a, sa, w, sw = _operands(per_token=True)
    fp8_gemm_cuda(a, sa, w, sw, out_dtype)
    assert scaled_mm.out_dtypes == [expected]


def test_unaligned_shapes_still_fall_back_to_the_reference(monkeypatch):
    """K or N not a multiple of 16: ``_scaled_mm`` cannot run it; the exact reference does."""
    monkeypatch.setattr(torch, "_scaled_mm", ScaledMM())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    a, sa = dynamic_per_token_scaled_fp8_quant_reference(torch.randn(4, 40))
    w, sw = static_scaled_fp8_quant_reference(torch.randn(24, 40), torch.tensor([0.01])), torch.tensor([0.01])
    out = fp8_gemm_cuda(a, sa, w, sw, torch.float32)
    assert torch.equal(out, fp8_gemm_reference(a, sa, w, sw, torch.float32))
