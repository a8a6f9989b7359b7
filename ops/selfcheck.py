"""Runs every Triton kernel against its plain-torch reference on small random inputs.

Used by ``vgraph ops check``: on a CUDA machine it checks the compiled kernels, elsewhere the
interpreted ones (the caller must set ``TRITON_INTERPRET=1`` before triton is imported).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import activation, dense_linear, fp8, fused_quant, lora, norm, rotary
from .kernels import activation as act_k
from .kernels import fp8 as fp8_k
from .kernels import gemv as gemv_k
from .kernels import lora as lora_k
from .kernels import norm as norm_k
from .kernels import rotary as rotary_k

REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@dataclass
class CheckResult:
    op: str
    dtype: torch.dtype
    max_rel_error: float
    tolerance: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.max_rel_error <= self.tolerance


def _max_rel_error(out, ref) -> float:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    worst = 0.0
    for o, r in zip(outs, refs):
        o, r = o.detach().cpu().double(), r.detach().cpu().double()
        if not torch.isfinite(o).all():
            return float("inf")
        scale = max(r.abs().max().item(), 1e-30) if r.numel() else 1.0
        worst = max(worst, (o - r).abs().max().item() / scale if r.numel() else 0.0)
    return worst


def _rotary_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q and k as the model passes them (head views of one qkv row per token), cos and sin."""
    qkv = torch.randn(7, (6 + 2 + 2) * 64, dtype=dtype)
    q, k = qkv[:, :384].view(7, 6, 64), qkv[:, 384:512].view(7, 2, 64)
    angles = torch.randn(7, 32)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _cases(dtype: torch.dtype) -> list[tuple[str, Callable, Callable, tuple, float]]:
    """(op name, kernel launcher, reference, CPU inputs, tolerance) for each op."""
    x, r = torch.randn(7, 1000, dtype=dtype), torch.randn(7, 1000, dtype=dtype)
    w = (1 + 0.1 * torch.randn(1000)).to(dtype)
    gate_up = torch.randn(7, 2 * 1000, dtype=dtype)
    s = torch.tensor([0.01])
    tol = REL_TOL[dtype]
    fp8_tol = 1 / 8  # one e4m3 step (3 mantissa bits) relative to the largest value
    Q = norm_k
    return [
        ("rms_norm", lambda a, b: norm_k.rms_norm_triton(a, b, 1e-6), lambda a, b: norm.rms_norm_reference(a, b, 1e-6), (x, w), tol),
        ("fused_add_rms_norm", lambda a, c, b: norm_k.rms_norm_triton(a, b, 1e-6, residual=c),
         lambda a, c, b: norm.fused_add_rms_norm_reference(a, c, b, 1e-6), (x, r, w), tol),
        ("silu_and_mul", act_k.silu_and_mul_triton, activation.silu_and_mul_reference, (gate_up,), tol),
        ("rotary_qk", rotary_k.rotary_qk_triton, rotary.rotary_qk_reference, _rotary_inputs(dtype), tol),
        ("static_scaled_fp8_quant", fp8_k.static_scaled_fp8_quant_triton, fp8.static_scaled_fp8_quant_reference, (x, s), fp8_tol),
        ("dynamic_per_token_scaled_fp8_quant", fp8_k.dynamic_per_token_scaled_fp8_quant_triton,
         fp8.dynamic_per_token_scaled_fp8_quant_reference, (x,), fp8_tol),
        ("rms_norm_static_fp8_quant", lambda a, b, c: Q.rms_norm_triton(a, b, 1e-6, quant=Q.QUANT_STATIC, scale=c),
         lambda a, b, c: fused_quant.rms_norm_static_fp8_quant_reference(a, b, c, 1e-6), (x, w, s), fp8_tol),
        ("fused_add_rms_norm_static_fp8_quant",
         lambda a, c, b, d: Q.rms_norm_triton(a, b, 1e-6, residual=c, quant=Q.QUANT_STATIC, scale=d),
         lambda a, c, b, d: fused_quant.fused_add_rms_norm_static_fp8_quant_reference(a, c, b, d, 1e-6), (x, r, w, s), fp8_tol),
        ("rms_norm_dynamic_per_token_fp8_quant", lambda a, b: Q.rms_norm_triton(a, b, 1e-6, quant=Q.QUANT_DYNAMIC),
         lambda a, b: fused_quant.rms_norm_dynamic_per_token_fp8_quant_reference(a, b, 1e-6), (x, w), fp8_tol),
        ("silu_and_mul_static_fp8_quant", lambda a, b: act_k.silu_and_mul_triton(a, scale=b),
         fused_quant.silu_and_mul_static_fp8_quant_reference, (gate_up, s), fp8_tol),
    ] + _gemv_cases(dtype) + _lora_cases(dtype) + _attention_cases(dtype)


def _gemv_cases(dtype: torch.dtype) -> list:
    """The one-row projection kernels (a batch-1 decode step's), plain with a bias and fused
    with SwiGLU, at a K that the blocks do not divide."""
    x, w, b = torch.randn(1, 1000, dtype=dtype), (torch.randn(600, 1000) / 30).to(dtype), torch.randn(600, dtype=dtype)

    def projection(x, w, b):  # summed in fp32 and rounded once, as the kernel does
        return torch.nn.functional.linear(x.float(), w.float(), b.float()).to(x.dtype)

    def swiglu(x, w, b):
        return dense_linear.linear_silu_and_mul_reference(projection(x, w, b).float(), torch.eye(600), None).to(x.dtype)
    r, norm_w = torch.randn(1, 1000, dtype=dtype), (1 + 0.1 * torch.randn(1000)).to(dtype)

    def normed_projection(x, r, norm_w, w, b):  # the norm's output, then the projection
        return projection(norm.fused_add_rms_norm_reference(x, r, norm_w, 1e-6)[0], w, b)

    def fused_norm(x, r, norm_w, w, b):
        return gemv_k.rms_norm_gemv_triton(x, gemv_k.NormPrologue(norm_w, 1e-6, r), w, b)[0]
    return [("linear (one row)", gemv_k.gemv_triton, projection, (x, w, b), REL_TOL[dtype]),
            # gate and up are each rounded once: a last-bit difference in either doubles in the product
            ("linear_silu_and_mul (one row)", gemv_k.gemv_silu_mul_triton, swiglu, (x, w, b), 2 * REL_TOL[dtype]),
            # the norm's output is rounded before the projection: a last-bit difference there moves it
            ("fused_add_rms_norm_linear (one row)", fused_norm, normed_projection, (x, r, norm_w, w, b),
             2 * REL_TOL[dtype])]


def _lora_cases(dtype: torch.dtype) -> list:
    """The shrink + expand kernels on a fused two-slice projection, rows of 3 slots and none."""
    slots, rank, outs = 3, 16, (200, 72)
    x, base = torch.randn(9, 136, dtype=dtype), torch.randn(9, sum(outs), dtype=dtype)
    lora_a = (0.1 * torch.randn(slots, len(outs) * rank, 136)).to(dtype)
    b0, b1 = ((0.1 * torch.randn(slots, out, rank)).to(dtype) for out in outs)
    token_slots = torch.tensor([0, -1, 2, 1, 1, -1, 0, 2, 2], dtype=torch.int32)

    def kernel(base, x, a, b0, b1, slots_):
        return lora_k.lora_expand_triton(base, lora_k.lora_shrink_triton(x, a, slots_), [b0, b1], slots_)

    def reference(base, x, a, b0, b1, slots_):
        return lora.lora_add_reference(base, x, a, [b0, b1], slots_)
    return [("lora_add", kernel, reference, (base, x, lora_a, b0, b1, token_slots), REL_TOL[dtype])]


def _attention_cases(dtype: torch.dtype) -> list:
    from .attention_selfcheck import attention_cases
    return attention_cases(dtype)


def run_checks(device: str, dtypes=(torch.float32, torch.bfloat16)) -> list[CheckResult]:
    results = []
    for dtype in dtypes:
        torch.manual_seed(0)
        for name, kernel, reference, inputs, tol in _cases(dtype):
            start = time.perf_counter()
            out = kernel(*(t.to(device) for t in inputs))
            seconds = time.perf_counter() - start
            results.append(CheckResult(name, dtype, _max_rel_error(out, reference(*inputs)), tol, seconds))
    return results
