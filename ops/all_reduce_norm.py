"""All-reduce fused with the residual add and RMSNorm that follow it under tensor parallelism.

A row-parallel projection (o_proj, down_proj) ends with a sum all-reduce over the
tensor-parallel group; the decoder then adds the residual and normalizes. These ops are that
whole sequence as one call, so that a backend with a fused all-reduce + norm kernel can run
it in one launch (one pass over the activations instead of three). ``AllReduceRMSNormFusionPass``
(passes/all_reduce_norm.py) rewrites the compiled graph to them.

- ``all_reduce_fused_add_rms_norm(x, residual, weight, eps, group_name) -> (normed, residual')``
- ``all_reduce_fused_add_rms_norm_static_fp8_quant(x, residual, weight, scale, eps, group_name)
  -> (q, residual')``: the same with the normed output quantized to fp8 (static scale)

``group_name`` is the process group's registered name (``ProcessGroup.group_name``), the same
string the functional collective ``_c10d_functional.all_reduce`` carries: the op reads no
rank, so one compiled graph serves every rank of the group.

Implementations. The default (CPU, and the reference in tests): the sum all-reduce through
torch.distributed's functional collective on the named group (gloo on CPU), then the
plain-torch add + RMSNorm reference. CUDA: vgraph ships no fused all-reduce + norm kernel
(one needs a one-shot/two-shot all-reduce over peer-mapped buffers, like TensorRT-LLM's or
FlashInfer's, which vgraph does not build), so the CUDA kernel runs the unfused sequence this
op stands for: the NCCL all-reduce, then vgraph's Triton ``fused_add_rms_norm`` (or its fp8
variant). The graph shape is the fused one either way; a fused kernel slots in here.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import check_static_scale
from .fused_quant import fused_add_rms_norm_static_fp8_quant_reference
from .kernels.host import FP8_DTYPE
from .norm import fused_add_rms_norm_reference
from .registration import vgraph_op

_c10d = torch.ops._c10d_functional


def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    """Sum of ``x`` over the ranks of the named group (a new tensor), waited for."""
    return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))


def all_reduce_fused_add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                            group_name: str) -> tuple[Tensor, Tensor]:
    return fused_add_rms_norm_reference(all_reduce_sum(x, group_name), residual, weight, eps)


def all_reduce_fused_add_rms_norm_static_fp8_quant_reference(
        x: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, eps: float,
        group_name: str) -> tuple[Tensor, Tensor]:
    return fused_add_rms_norm_static_fp8_quant_reference(all_reduce_sum(x, group_name), residual,
                                                         weight, scale, eps)


@vgraph_op("vgraph::all_reduce_fused_add_rms_norm", mutates_args=())
def all_reduce_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                  group_name: str) -> tuple[Tensor, Tensor]:
    """``residual' = all_reduce_sum(x) + residual``, then RMSNorm of it: ``(normed, residual')``."""
    return all_reduce_fused_add_rms_norm_reference(x, residual, weight, eps, group_name)


@all_reduce_fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
      group_name: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@all_reduce_fused_add_rms_norm.register_kernel("cuda")
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
      group_name: str) -> tuple[Tensor, Tensor]:
    # No fused kernel is shipped: NCCL all-reduce, then the Triton add + RMSNorm.
    return torch.ops.vgraph.fused_add_rms_norm(all_reduce_sum(x, group_name), residual, weight, eps)


@vgraph_op("vgraph::all_reduce_fused_add_rms_norm_static_fp8_quant", mutates_args=())
def all_reduce_fused_add_rms_norm_static_fp8_quant(x: Tensor, residual: Tensor, weight: Tensor,
                                                   scale: Tensor, eps: float,
                                                   group_name: str) -> tuple[Tensor, Tensor]:
    """``all_reduce_fused_add_rms_norm`` with the normed output quantized to fp8 by a static
    scale: ``(q, residual')``."""
    check_static_scale(scale)
    return all_reduce_fused_add_rms_norm_static_fp8_quant_reference(x, residual, weight, scale, eps,
                                                                    group_name)


@all_reduce_fused_add_rms_norm_static_fp8_quant.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, eps: float,
      group_name: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, dtype=FP8_DTYPE), torch.empty_like(x)


@all_reduce_fused_add_rms_norm_static_fp8_quant.register_kernel("cuda")
def _(x: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, eps: float,
      group_name: str) -> tuple[Tensor, Tensor]:
    # No fused kernel is shipped: NCCL all-reduce, then the Triton add + RMSNorm + quant.
    return torch.ops.vgraph.fused_add_rms_norm_static_fp8_quant(
        all_reduce_sum(x, group_name), residual, weight, scale, eps)
