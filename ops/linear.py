"""``vgraph::packed_linear``: float32 ``x @ W^T + b`` on CPU over a weight packed once.

On CPU a decode step is a handful of rows times every weight matrix, and torch's BLAS call
for ``F.linear`` runs far below the memory bandwidth at those row counts. The C++ kernel
(``csrc/linear_cpu.cpp``) reads a weight packed into 16-column panels front to back once
per call, and takes prefill-sized calls too: there it matches or beats BLAS on the weight
unpacked for it (measured 2154 rows on the perf model's projections, 256 and 2048 rows on
46-92 MB weights; the one loss, 0.95x, was 2048 rows on the 92 MB one), and needs no
transient copy of the weight. ``perf/suites/ops.py`` measures it against ``F.linear``.

Layout: ``pack_weight`` turns ``W [N, K]`` into ``[ceil(N / 16), K, 16]``, zero past column
N, so panel p holds output columns ``16p .. 16p + 15`` contiguous along k. The op's default
implementation unpacks and calls ``F.linear``: it defines the op, serves devices and dtypes
without the kernel, and is the oracle in tests.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu_dispatch import python_kernel
from .native_build import NativeKernel, load_library
from .registration import vgraph_op

PANEL = 16
ENV_SWITCH = "VGRAPH_CPU_LINEAR"  # "torch": do not pack; every projection calls F.linear
DENSE_MIN_ROWS = 128  # fewer rows always take the packed kernel (see linear_tuning)


def pack_weight(weight: Tensor) -> Tensor:
    """``[N, K]`` -> ``[ceil(N / 16), K, 16]`` float32, contiguous; padding columns are zero."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = F.pad(weight.detach().to(torch.float32), (0, 0, 0, panels * PANEL - n))
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack_weight(packed: Tensor, out_features: int) -> Tensor:
    """The ``[out_features, K]`` weight ``packed`` came from (a copy)."""
    panels, k, width = packed.shape
    return packed.transpose(1, 2).reshape(panels * width, k)[:out_features]


def packed_linear_reference(x: Tensor, packed: Tensor, bias: Optional[Tensor],
                            out_features: int) -> Tensor:
    return F.linear(x, unpack_weight(packed, out_features).to(x.dtype), bias)


def _panel_width_problem(lib: ctypes.CDLL) -> Optional[str]:
    if lib.vgraph_linear_panel_width() != PANEL:
        return "linear_cpu.cpp's panel width differs from PANEL"
    return None


def _kernel() -> NativeKernel:
    return NativeKernel(
        "linear_cpu", "vgraph_linear",
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
         ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32],
        None, "the packed CPU linear", _panel_width_problem)


_KERNEL = _kernel()
_ROWS_KERNEL = NativeKernel(
    "linear_cpu", "vgraph_linear_rows",
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
     ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32],
    None, "the CPU linear over a row-major weight", _panel_width_problem)


def kernel_isa() -> Optional[str]:
    """The instruction set the packed kernel's tiles were built for: "avx512" (6x64 tiles in
    zmm registers), "avx2" (6x16 tiles) or "portable"; None when the kernel is unavailable.
    Chosen at build time by ``-march=native``, so it follows the CPU (and the kernel cache
    key, which holds the CPU's flags)."""
    if _KERNEL.load() is None:
        return None
    isa = load_library(_KERNEL.library).vgraph_linear_isa
    isa.argtypes, isa.restype = [], ctypes.c_char_p
    return isa().decode()


def packing_enabled() -> bool:
    """Whether CPU float32 models should pack their projections (the kernel builds here)."""
    if os.environ.get(ENV_SWITCH, "").lower() == "torch":
        return False
    return _KERNEL.load() is not None


def _check(x: Tensor, packed: Tensor, bias: Optional[Tensor], out_features: int) -> None:
    if packed.dim() != 3 or packed.shape[2] != PANEL or packed.dtype != torch.float32:
        raise ValueError(f"packed weight must be float32 [panels, K, {PANEL}], got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    if not (packed.shape[0] - 1) * PANEL < out_features <= packed.shape[0] * PANEL:
        raise ValueError(f"out_features {out_features} does not fit {packed.shape[0]} panels")
    if x.shape[-1] != packed.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {packed.shape[1]}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({out_features},)")


def _check_dense(dense: Optional[Tensor], packed: Tensor, out_features: int) -> None:
    if dense is not None and tuple(dense.shape) != (out_features, packed.shape[1]):
        raise ValueError(f"dense weight shape {tuple(dense.shape)} != ({out_features}, {packed.shape[1]})")


def _as_rows(matrix: Tensor) -> Tensor:
    """``matrix`` as the kernels read it: unit-stride rows, a row stride of at least a row
    (a view that already is one is passed as it is, copying nothing)."""
    if matrix.stride(-1) != 1 or (matrix.shape[0] > 1 and matrix.stride(0) < matrix.shape[1]):
        return matrix.contiguous()
    return matrix


@vgraph_op("vgraph::packed_linear", mutates_args=())
def packed_linear(x: Tensor, packed: Tensor, bias: Optional[Tensor], out_features: int,
                  dense: Optional[Tensor] = None) -> Tensor:
    """``x [..., K] @ W^T + bias`` -> ``[..., out_features]`` with W given packed.

    ``dense``: the same weight unpacked, kept where startup measured BLAS faster at prefill
    sizes (``linear_tuning``); calls of at least ``DENSE_MIN_ROWS`` rows then use it."""
    _check(x, packed, bias, out_features)
    _check_dense(dense, packed, out_features)
    return packed_linear_reference(x, packed, bias, out_features)


@packed_linear.register_fake
def _(x: Tensor, packed: Tensor, bias: Optional[Tensor], out_features: int,
      dense: Optional[Tensor] = None) -> Tensor:
    _check(x, packed, bias, out_features)
    _check_dense(dense, packed, out_features)
    return x.new_empty(*x.shape[:-1], out_features)


@python_kernel("packed_linear")
def _packed_linear_cpu(x: Tensor, packed: Tensor, bias: Optional[Tensor], out_features: int,
                       dense: Optional[Tensor] = None) -> Tensor:
    """The CPU kernel in Python: every case (once installed, the C++ dispatcher kernel hands it
    all but the plain float32 one: ops/cpu_dispatch.py)."""
    _check(x, packed, bias, out_features)
    _check_dense(dense, packed, out_features)
    if dense is not None and x.numel() >= DENSE_MIN_ROWS * x.shape[-1]:
        return F.linear(x, dense, bias)
    function = _KERNEL.load()
    if function is None or x.dtype != torch.float32 or (bias is not None and bias.dtype != x.dtype):
        return packed_linear_reference(x, packed, bias, out_features)
    rows = _as_rows(x.reshape(-1, x.shape[-1]))
    packed = packed.contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0] > 0:
        function(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], packed.data_ptr(),
                 out_features, bias.data_ptr() if bias is not None else None, out.data_ptr(),
                 out.stride(0), torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


def _check_rows(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight is {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")


@vgraph_op("vgraph::rowmajor_linear", mutates_args=())
def rowmajor_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` on the packed kernel's tiles, for a weight that must stay
    unpacked (a tied lm_head: it is the embedding's storage). The kernel packs one group of
    panels at a time into a per-thread buffer; on CPU float32 it beat BLAS 1.4x at 64 rows and
    1.8x at 8 rows of a 32000 x 896 head (one Zen 4 core). Other devices and dtypes: F.linear."""
    _check_rows(x, weight, bias)
    return F.linear(x, weight, bias)


@rowmajor_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    _check_rows(x, weight, bias)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@python_kernel("rowmajor_linear")
def _rowmajor_linear_cpu(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The CPU kernel in Python (as ``_packed_linear_cpu``)."""
    _check_rows(x, weight, bias)
    function = _ROWS_KERNEL.load()
    if (function is None or x.dtype != torch.float32 or weight.dtype != torch.float32
            or (bias is not None and bias.dtype != torch.float32)):
        return F.linear(x, weight, bias)
    rows = _as_rows(x.reshape(-1, x.shape[-1]))
    weight = _as_rows(weight)
    bias = bias.contiguous() if bias is not None else None
    n = weight.shape[0]
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0] > 0 and n > 0:
        function(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], weight.data_ptr(),
                 weight.stride(0), n, bias.data_ptr() if bias is not None else None, out.data_ptr(),
                 out.stride(0), torch.get_num_threads())
    return out.view(*x.shape[:-1], n)
