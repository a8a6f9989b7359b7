"""``vgraph::lora_add``: many LoRA adapters applied to one batch, each row by its own slot.

Multi-LoRA serving keeps every resident adapter of a projection in fixed-size stacked
buffers, one slot per adapter, and gives each token of the flat batch the slot of its
request (-1: the base model alone). The op adds ``x @ A[slot].T @ B[slot].T`` to the base
projection's output in two steps, as Punica/S-LoRA do: *shrink* (``x`` onto the rank space,
``[T, slices * R]``) and *expand* (each slice's rank block back onto its output columns).

Layout (why stacked and fixed: loading an adapter copies into these buffers in place, so a
CUDA graph captured over them stays valid and nothing recompiles):
  ``lora_a``  [slots, slices * R, in]: slice s of slot i is rows ``s*R .. s*R + R - 1``
  ``lora_b``  one [slots, out_s, R] per slice; the slices' outputs are the base output's
              columns in order (a fused q|k|v or gate|up projection has 3 or 2 slices)
  ``token_slots`` [T] int32/int64, the slot of each row of ``x``; -1 adds nothing
The scaling (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA) is folded into B when an
adapter is loaded, and an adapter of rank below R is zero-padded, which adds exact zeros.

The default implementation (the reference and oracle) gathers each row's A and B and runs
batched matmuls. On CPU one C++ call does the whole op (``lora_add_native``,
``csrc/lora_cpu.cpp``); where it does not apply (float16, no compiler) the torch form sorts
rows by slot and runs one GEMM per adapter in use and slice (``lora_add_grouped``). Why C++:
at a decode step the op's FLOPs are a few percent of the base projection's, and the torch
form's twenty-odd small ops per call made a compiled engine step of 32 rows over 4 rank-16
adapters cost 1.8x the base step (``python -m perf run lora``, perf/README.md). CUDA runs
Triton shrink/expand kernels (kernels/lora.py) with no host sync, so they can be captured in
CUDA graphs.
"""
from __future__ import annotations

import ctypes
import os
from typing import List, Optional

import torch
from torch import Tensor

from .kernels import lazy
from .native_build import NativeKernel
from .registration import vgraph_op

# Triton kernels, imported on first use (kernels.lazy): CPU calls never need them.
kernels = lazy("lora")

# The C++ CPU kernel's limits (csrc/lora_cpu.cpp kMaxSlices, kMaxRank) and dtypes (-> is_bf16).
MAX_SLICES, MAX_RANK = 4, 256
_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# VGRAPH_CPU_LORA=torch runs the torch form (lora_add_grouped) instead of the C++ kernel:
# to compare the two, or to rule the kernel out.
ENV_SWITCH = "VGRAPH_CPU_LORA"


def _check(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> None:
    """Shape rules of the op; raises ValueError saying which operand breaks which."""
    if base.dim() != 2 or x.dim() != 2 or lora_a.dim() != 3:
        raise ValueError(f"lora_add expects base [T, out], x [T, in], lora_a [slots, slices*R, in]; got "
                         f"{tuple(base.shape)}, {tuple(x.shape)}, {tuple(lora_a.shape)}")
    if not lora_b or any(b.dim() != 3 for b in lora_b):
        raise ValueError("lora_add expects lora_b as one [slots, out_s, R] tensor per slice")
    slots, rows, in_features = lora_a.shape
    rank = lora_b[0].shape[2]
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, lora_a {in_features}")
    if rows != len(lora_b) * rank:
        raise ValueError(f"lora_a holds {rows} rank rows, {len(lora_b)} slices of rank {rank} need "
                         f"{len(lora_b) * rank}")
    if any(b.shape[0] != slots or b.shape[2] != rank for b in lora_b):
        raise ValueError(f"every lora_b must be [{slots}, out_s, {rank}]; got "
                         f"{[tuple(b.shape) for b in lora_b]}")
    if sum(b.shape[1] for b in lora_b) != base.shape[1]:
        raise ValueError(f"the slices' outputs {[b.shape[1] for b in lora_b]} do not sum to the base "
                         f"output's {base.shape[1]} columns")
    if token_slots.dim() != 1 or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be a 1-D int32/int64 tensor, got {token_slots.dtype} "
                         f"{tuple(token_slots.shape)}")
    if not x.shape[0] == base.shape[0] == token_slots.shape[0]:
        raise ValueError(f"base, x and token_slots must have one row per token; got {base.shape[0]}, "
                         f"{x.shape[0]} and {token_slots.shape[0]}")


def lora_add_reference(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor],
                       token_slots: Tensor) -> Tensor:
    """Each row's own A and B gathered, then batched matmuls in float32."""
    _check(base, x, lora_a, lora_b, token_slots)
    rank = lora_b[0].shape[2]
    active = (token_slots >= 0).unsqueeze(-1)
    index = token_slots.clamp(min=0).long()
    shrunk = torch.bmm(lora_a[index].float(), x.float().unsqueeze(-1)).squeeze(-1)  # [T, slices*R]
    shrunk = torch.where(active, shrunk, 0.0)
    deltas = [torch.bmm(b[index].float(), shrunk[:, i * rank:(i + 1) * rank].unsqueeze(-1)).squeeze(-1)
              for i, b in enumerate(lora_b)]
    return base + torch.cat(deltas, dim=-1).to(base.dtype)


@vgraph_op("vgraph::lora_add", mutates_args=())
def lora_add(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> Tensor:
    """``base + x @ A[slot].T @ B[slot].T`` row by row (see the module docstring for layouts)."""
    return lora_add_reference(base, x, lora_a, lora_b, token_slots)


@lora_add.register_fake
def _(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> Tensor:
    _check(base, x, lora_a, lora_b, token_slots)
    return torch.empty_like(base)


def lora_add_grouped(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor],
                     token_slots: Tensor) -> Tensor:
    """The CPU torch form (the C++ kernel's fallback): rows sorted by slot (one host sync for
    the segment sizes), then per slot in use one shrink GEMM and one expand GEMM per slice
    over its contiguous segment, and one scatter-add of the sorted deltas onto the base. Why:
    the work follows the adapters the batch uses, each adapter's weights are read once, and a
    segment needs no per-slot gather. On the perf model's shapes (one thread) it beat running
    every slot densely with a one-hot mask 1.5x at a decode batch of 32 over 4 rank-16
    adapters, and the per-row gathers of the reference by 20x."""
    _check(base, x, lora_a, lora_b, token_slots)
    slots, rank = lora_a.shape[0], lora_b[0].shape[2]
    order = torch.argsort(token_slots, stable=True)
    counts = torch.bincount(token_slots.long() + 1, minlength=slots + 1).tolist()  # [0]: rows of -1
    ordered = x.index_select(0, order)
    delta = x.new_zeros(base.shape)
    start = counts[0]  # the -1 rows sort first and keep a zero delta
    for slot in range(slots):
        end = start + counts[slot + 1]
        if end == start:
            continue
        shrunk = ordered[start:end] @ lora_a[slot].to(x.dtype).t()
        column = 0
        for i, b in enumerate(lora_b):
            delta[start:end, column:column + b.shape[1]] = shrunk[:, i * rank:(i + 1) * rank] @ b[slot].to(x.dtype).t()
            column += b.shape[1]
        start = end
    return base.index_add(0, order, delta.to(base.dtype))


class _Args(ctypes.Structure):
    """Mirror of ``LoraArgs`` in ``csrc/lora_cpu.cpp``, field for field."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("base", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("lora_a", ctypes.c_void_p), ("lora_b", ctypes.c_void_p * MAX_SLICES),
        ("slice_out", ctypes.c_int64 * MAX_SLICES), ("token_slots", ctypes.c_void_p),
        ("x_stride", ctypes.c_int64), ("base_stride", ctypes.c_int64), ("out_stride", ctypes.c_int64),
        ("tokens", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
        ("rank", ctypes.c_int64), ("slices", ctypes.c_int64), ("num_slots", ctypes.c_int64),
        ("token_slots_are_int64", ctypes.c_int32), ("is_bf16", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


def _struct_problem(lib: ctypes.CDLL) -> Optional[str]:
    if lib.vgraph_lora_add_args_size() != ctypes.sizeof(_Args):
        return "the C++ argument struct and its ctypes mirror differ"
    if lib.vgraph_lora_add_max_rank() != MAX_RANK:
        return f"the C++ kernel's rank limit is {lib.vgraph_lora_add_max_rank()}, ops/lora.py says {MAX_RANK}"
    return None


_NATIVE = NativeKernel("lora_cpu", "vgraph_lora_add", [ctypes.POINTER(_Args)], ctypes.c_int64,
                       "CPU lora_add", _struct_problem)


def _native_applies(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor]) -> bool:
    """What the C++ kernel takes: one float32 or bfloat16 dtype throughout, unit-stride rows of
    x and base, contiguous slot buffers (the model's always are), at most MAX_SLICES slices of
    rank at most MAX_RANK. Anything else (float16, say) runs ``lora_add_grouped``."""
    dtype = base.dtype
    return (dtype in _NATIVE_DTYPES and x.dtype == dtype and lora_a.dtype == dtype
            and all(b.dtype == dtype and b.is_contiguous() for b in lora_b)
            and lora_a.is_contiguous() and x.stride(1) == 1 and base.stride(1) == 1
            and len(lora_b) <= MAX_SLICES and lora_b[0].shape[2] <= MAX_RANK
            and os.environ.get(ENV_SWITCH, "").lower() != "torch")


def lora_add_native(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> Tensor:
    """The CPU kernel: the whole op in one C++ call (``csrc/lora_cpu.cpp``: rows counted into
    slot order, then shrink and expand per slot group over every thread). Why: the torch form
    is some twenty small ops per projection, and at a decode step their dispatch, not their
    FLOPs, is what LoRA costs. Falls back to ``lora_add_grouped`` where the kernel does not
    apply or cannot be built here."""
    _check(base, x, lora_a, lora_b, token_slots)
    function = _NATIVE.load()
    if function is None or not _native_applies(base, x, lora_a, lora_b):
        return lora_add_grouped(base, x, lora_a, lora_b, token_slots)
    slots = token_slots.contiguous()
    out = torch.empty(base.shape, dtype=base.dtype, device=base.device)
    args = _Args(x=x.data_ptr(), base=base.data_ptr(), out=out.data_ptr(), lora_a=lora_a.data_ptr(),
                 lora_b=(ctypes.c_void_p * MAX_SLICES)(*(b.data_ptr() for b in lora_b)),
                 slice_out=(ctypes.c_int64 * MAX_SLICES)(*(b.shape[1] for b in lora_b)),
                 token_slots=slots.data_ptr(), x_stride=x.stride(0), base_stride=base.stride(0),
                 out_stride=out.stride(0), tokens=x.shape[0], in_features=x.shape[1],
                 out_features=base.shape[1], rank=lora_b[0].shape[2], slices=len(lora_b),
                 num_slots=lora_a.shape[0], token_slots_are_int64=int(slots.dtype == torch.int64),
                 is_bf16=_NATIVE_DTYPES[base.dtype], num_threads=torch.get_num_threads())
    failed = function(ctypes.byref(args))
    if failed:
        raise ValueError(f"token {int(failed) - 1} has LoRA slot {int(slots[int(failed) - 1])}, outside "
                         f"[-1, {lora_a.shape[0]})" if failed > 0 else "the C++ lora_add kernel refused its operands")
    return out


@lora_add.register_kernel("cpu")
def _(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> Tensor:
    return lora_add_native(base, x, lora_a, lora_b, token_slots)


@lora_add.register_kernel("cuda")
def _(base: Tensor, x: Tensor, lora_a: Tensor, lora_b: List[Tensor], token_slots: Tensor) -> Tensor:
    _check(base, x, lora_a, lora_b, token_slots)
    token_slots = token_slots.contiguous()  # the kernels read slot t at offset t
    shrunk = kernels.lora_shrink_triton(x, lora_a, token_slots)
    return kernels.lora_expand_triton(base, shrunk, lora_b, token_slots)
