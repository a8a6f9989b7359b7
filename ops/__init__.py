"""vgraph's custom ops, registered under ``torch.ops.vgraph`` on import.

Each op has a schema, a fake (meta) implementation for tracing, a default implementation in
plain torch, and a CUDA implementation that runs a Triton kernel. Ops are defined straight
on the dispatcher (``registration.vgraph_op``), which costs a few microseconds per call where
``torch.library.custom_op``'s wrapper cost tens. The plain-torch ``*_reference`` functions
define each op's numerics and are the test oracle; for most ops they are the CPU
implementation itself. The CPU hot spots of a decode step have their own kernels, checked
against the references: paged attention (ops/cpu_attention.py: decode rows in C++, read in
place from the paged cache; longer prefills gathered and run through SDPA), the KV-cache
write, and ``packed_linear``, a float32 GEMM over weights packed into column panels. On CUDA
a 16-bit projection of one row (a batch-1 decode step) runs a GEMV kernel (``linear``). The C++
sources live in ops/csrc and are built on first use by ops/native_build.py. This package
depends on torch and triton only, so fusion-pass research can use it on any model.
"""
from __future__ import annotations

from .activation import silu_and_mul
from .all_reduce_norm import all_reduce_fused_add_rms_norm, all_reduce_fused_add_rms_norm_static_fp8_quant
from .attention import paged_attention, paged_attention_decode_split_kv
from .dense_linear import linear, linear_silu_and_mul
from .fp8 import dynamic_per_token_scaled_fp8_quant, fp8_gemm, static_scaled_fp8_quant
from .fused_quant import (fused_add_rms_norm_static_fp8_quant, rms_norm_dynamic_per_token_fp8_quant,
                          rms_norm_static_fp8_quant, silu_and_mul_static_fp8_quant)
from .kernels.host import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from .kv_cache import reshape_and_cache
from .linear import packed_linear
from .lora import lora_add
from .norm import fused_add_rms_norm, rms_norm
from .rotary import rotary_qk
from .unified_attention import unified_attention



def build_cpu_kernels() -> dict[str, str | None]:
    """Builds (or loads from the cache) every C++ CPU kernel now, so a server pays the
    first-use build before it reports ready rather than on its first request, and moves the hot
    ops' CPU calls to their C++ dispatcher kernels. Returns each library's name and why it is
    unavailable (None when it loaded)."""
    from . import cpu_attention_native, cpu_dispatch, kv_cache, linear, lora
    kernels = {"paged_attention_cpu": cpu_attention_native._KERNEL,
               "prefill_attention_cpu": cpu_attention_native._PREFILL_KERNEL,
               "kv_cache_cpu": kv_cache._NATIVE, "linear_cpu": linear._KERNEL, "lora_cpu": lora._NATIVE}
    built = {name: (None if kernel.load() is not None else kernel.unavailable) for name, kernel in kernels.items()}
    # Then the hot ops' C++ dispatcher kernels (ops/cpu_dispatch.py), which call those.
    built[cpu_dispatch.LIBRARY] = None if cpu_dispatch.install() else cpu_dispatch.unavailable()
    return built


__all__ = [
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_qk",
    "static_scaled_fp8_quant", "dynamic_per_token_scaled_fp8_quant", "fp8_gemm",
    "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_fp8_quant", "silu_and_mul_static_fp8_quant",
    "all_reduce_fused_add_rms_norm", "all_reduce_fused_add_rms_norm_static_fp8_quant",
    "reshape_and_cache", "packed_linear", "linear", "linear_silu_and_mul", "lora_add", "paged_attention", "paged_attention_decode_split_kv", "unified_attention",
    "FP8_DTYPE", "FP8_MAX", "FP8_MIN_SCALE", "build_cpu_kernels",
]
