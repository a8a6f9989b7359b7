"""Tolerances the issue fixes for kernel-vs-reference checks, and the comparisons."""
from __future__ import annotations

import torch

# Max |out - ref| over max |ref|: 1e-5 for fp32, 2e-2 for half types.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Fails when the largest error exceeds the dtype's tolerance relative to ref's scale."""
    tol = REL_TOL[dtype or ref.dtype]
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), "non-finite values in output"
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (out - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= tol * max(scale, 1e-30), f"max error {err:.3g} > {tol:g} x scale {scale:.3g}"


def fp8_step(values: torch.Tensor) -> torch.Tensor:
    """Spacing of float8_e4m3fn numbers at each value (3 mantissa bits, min normal 2^-6)."""
    mag = values.double().abs().clamp_min(2.0 ** -6)
    return torch.exp2(torch.floor(torch.log2(mag)) - 3)


def assert_fp8_within_one_step(q: torch.Tensor, q_ref: torch.Tensor,
                               scale: torch.Tensor | None = None,
                               scale_ref: torch.Tensor | None = None,
                               input_dtype: torch.dtype = torch.float32) -> None:
    """fp8 outputs agree after dequantization to within one fp8 step of the reference.

    Dynamic scales must agree to the input dtype's tolerance: in bf16 the row maximum they
    derive from may itself differ by one bf16 step between kernel and reference.
    """
    assert q.dtype == torch.float8_e4m3fn and q_ref.dtype == torch.float8_e4m3fn
    a, b = q.cpu().double(), q_ref.cpu().double()
    step = fp8_step(b)
    if scale is not None:
        s, s_ref = scale.cpu().double(), scale_ref.cpu().double()
        rtol = 1e-6 if input_dtype == torch.float32 else REL_TOL[input_dtype]
        torch.testing.assert_close(s, s_ref, rtol=rtol, atol=0)
        a, b, step = a * s, b * s_ref, step * s_ref * (1 + rtol)
    bad = (a - b).abs() > step * (1 + 1e-9)
    assert not bad.any(), f"{int(bad.sum())} fp8 values differ by more than one step"
