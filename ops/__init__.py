"""vgraph's custom ops, registered under ``torch.ops.vgraph`` on import.

Each op has a schema, a fake (meta) implementation for tracing, a CPU implementation in
plain torch, and a CUDA implementation that runs a Triton kernel. The plain-torch
``*_reference`` functions define each op's numerics and are the test oracle; for most ops
they are the CPU implementation itself, while paged attention has a batched CPU kernel
(ops/cpu_attention.py) checked against its readable per-sequence reference. This package depends on torch and triton only, so fusion-pass research can
use it on any model.
"""
from __future__ import annotations

from .activation import silu_and_mul
from .attention import paged_attention, paged_attention_decode_split_kv
from .fp8 import dynamic_per_token_scaled_fp8_quant, fp8_gemm, static_scaled_fp8_quant
from .fused_quant import (fused_add_rms_norm_static_fp8_quant, rms_norm_dynamic_per_token_fp8_quant,
                          rms_norm_static_fp8_quant, silu_and_mul_static_fp8_quant)
from .kernels.common import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from .kv_cache import reshape_and_cache
from .norm import fused_add_rms_norm, rms_norm
from .unified_attention import unified_attention

__all__ = [
    "rms_norm", "fused_add_rms_norm", "silu_and_mul",
    "static_scaled_fp8_quant", "dynamic_per_token_scaled_fp8_quant", "fp8_gemm",
    "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_fp8_quant", "silu_and_mul_static_fp8_quant",
    "reshape_and_cache", "paged_attention", "paged_attention_decode_split_kv", "unified_attention",
    "FP8_DTYPE", "FP8_MAX", "FP8_MIN_SCALE",
]
