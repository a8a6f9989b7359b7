"""One- and two-row projections (``y = x @ W.T + b`` for one or two rows of ``x``): a decode
step at batch 1 or 2.

Why a kernel of its own: at one row a projection is a pure weight stream (every weight byte
is read once and used for one multiply-add), so its speed is the fraction of DRAM bandwidth
it reaches. A GEMM library picks tensor-core tiles padded to 8-64 rows and split-K schemes
for this case; which one it picks, and how close it gets, depends on the shape. This kernel
is the plain shape of the problem: program ``i`` owns ``BLOCK_N`` output features, walks
their rows of ``W`` ``BLOCK_K`` elements at a time (each row contiguous: coalesced 16-byte
loads), multiplies by the matching slice of ``x`` in fp32, and reduces across K once at the
end (the accumulator is a [BLOCK_N, BLOCK_K] tile, so the loop carries no reduction). A
second row keeps a second accumulator and reuses each weight tile: the weight is read once.

Measured (``python -m perf.decode_kernels_ab``, one H200, bf16, working sets past L2): against
cuBLAS at one row it took a Llama-3-8B layer's four projections from 121.5 to 108.9 us (qkv
15.2 -> 14.3, o 13.7 -> 10.2, gate_up 60.6 -> 55.3, down 32.0 -> 29.2) and a
Qwen2.5-0.5B layer's from 24.3 to 17.3 us (small shapes gain most: cuBLAS spent 4.5 us on a
2 MB qkv). ``config_for`` is the launch configuration that was within 3% of the best of 18 on
every one of those shapes; the lm_head-sized ones (>= 128k rows) were a tie, and stay with
the library. At two rows the same tiles hold twice the accumulators (128 registers a thread
instead of 79) and lost to cuBLAS on the 8B shapes (0.82-0.84x but o, 1.13x) while still
winning on the 0.5B's small ones (1.31-1.59x): ops/dense_linear.py routes by that.

Fused SwiGLU (``gemv_silu_mul_triton``): the gate and up halves of a stacked [gate | up]
weight are read by the same program (feature j's rows j and j + d), and the program writes
``silu(gate) * up`` directly: the activation kernel and its [1, 2d] round trip are gone. The
two dot products are rounded to the output dtype before the activation, as the unfused pair
(projection, then ``silu_and_mul``) rounds them.

RMSNorm prologue (``rms_norm_gemv_triton``, for ``vgraph::rms_norm_linear`` and
``vgraph::fused_add_rms_norm_linear``): the projection's input is the RMSNorm of x (plus a
residual), computed inside the kernel instead of by a norm kernel before it. Every program
sums the squares of the whole row itself (one pass over ``K`` elements it then reads again
from L2: 8 KB of bf16 for a 4096-wide model, next to the program's 64-256 KB of weight rows)
and normalizes each ``BLOCK_K`` slice as it loads it, with the norm kernel's roundings
(``norm._load_input``, ``norm._normalize``; the squares add in another order, so a value can
differ from the unfused pair's in its last bit); program 0 also writes the new residual. What it
saves at one row is the norm's launch and its [1, K] round trip: two kernels of a decoder
layer's ~11 (the 0.5B shape's 24 layers are launch-bound, module ops/dense_linear.py).

The first weight tile is loaded before ``pdl_enter``: no kernel of a step writes a weight, so
that load may run before the kernel before this one has finished. Under programmatic
dependent launch (ops/kernels/common.py) a program is scheduled while that kernel runs, and its
first ``BLOCK_K`` columns of ``W`` stream in meanwhile: for the 0.5B shape's qkv and o (K =
896, one tile) that is the whole weight. Only x, the residual and the outputs wait. The first
iteration is peeled for it and adds into the zeroed accumulator as the loop does, so the
result is the same bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .common import pdl_enter, pdl_launch
from .host import GEMV_MAX_ROWS
from .norm import _load_input, _normalize


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


def config_for(out_features: int, in_features: int, rows: int = 1) -> GemvConfig:
    """The launch configuration for a weight of this shape (module doc: how it was chosen).
    Two rows keep two accumulators: the long-row tile (16 x 1024, 8 warps) takes half the
    rows per program there, or it would take 236 registers a thread (ptxas, sm_90)."""
    if out_features >= 8192:
        return GemvConfig(block_n=16, block_k=256, num_warps=4)
    if in_features >= 8192:
        return GemvConfig(block_n=16 // rows, block_k=1024, num_warps=8)
    if out_features >= 4096:
        return GemvConfig(block_n=8, block_k=512, num_warps=4)
    return GemvConfig(block_n=4, block_k=1024, num_warps=4)


@triton.jit
def _load_x(x_ptr, k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + k).to(tl.float32)[None, :]
    return tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _load_w_tile(w_ptr, rows, k, K, EVEN_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of W in its own dtype (the kernels' weight loads, the one
    issued before ``pdl_enter`` included)."""
    if EVEN_K:
        return tl.load(w_ptr + rows[:, None] + k[None, :])
    return tl.load(w_ptr + rows[:, None] + k[None, :], mask=(k < K)[None, :], other=0.0)


@triton.jit
def _load_w(w_ptr, rows, k, K, EVEN_K: tl.constexpr):
    return _load_w_tile(w_ptr, rows, k, K, EVEN_K).to(tl.float32)


@triton.jit
def _row_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, store_until,
              HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of one row of x (+ residual, rounded as the norm kernel rounds it), as sums of
    ``BLOCK_K``-wide partials (the norm kernel's block is wider, so the order differs: rstd
    can differ in its last bit); writes the new residual's first ``store_until`` elements (K
    in one program, 0 in the others)."""
    sum_sq = tl.zeros([BLOCK_K], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = k < K
        h = _load_input(x_ptr, res_ptr, res_out_ptr, k, mask, HAS_RESIDUAL, False)
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + k, h.to(res_out_ptr.dtype.element_ty), mask=k < store_until)
        sum_sq += h * h
    return 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / K + eps)


@triton.jit
def _load_row(x_ptr, res_ptr, nw_ptr, k, K, rstd, EVEN_K: tl.constexpr, NORM: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr):
    """A [1, BLOCK_K] slice of the projection's input row: x, or its RMSNorm (``rstd`` from
    ``_row_rstd``) rounded to x's dtype as the norm kernel's output is."""
    if NORM:
        mask = k < K
        h = _load_input(x_ptr, res_ptr, res_ptr, k, mask, HAS_RESIDUAL, False)
        return _normalize(h, rstd, nw_ptr, k, mask, x_ptr.dtype.element_ty)[None, :]
    return _load_x(x_ptr, k, K, EVEN_K)


@triton.jit
def _rstd_pair(x_ptr, res_ptr, res_out_ptr, K, eps, stride_xm, NORM: tl.constexpr,
               HAS_RESIDUAL: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Both rows' ``_row_rstd`` (1 where there is no norm or no second row); program 0 writes
    the new residual."""
    rstd0 = 1.0
    rstd1 = 1.0
    if NORM:
        store_until = tl.where(tl.program_id(0) == 0, K, 0)
        rstd0 = _row_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, store_until, HAS_RESIDUAL, BLOCK_K)
        if TWO_ROWS:
            rstd1 = _row_rstd(x_ptr + stride_xm, res_ptr + stride_xm, res_out_ptr + stride_xm, K, eps,
                              store_until, HAS_RESIDUAL, BLOCK_K)
    return rstd0, rstd1


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_xm, stride_ym,
                 res_ptr, nw_ptr, res_out_ptr, eps,
                 HAS_BIAS: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr = False):
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.where(n_mask, offs_n, 0).to(tl.int64) * stride_wn  # clamped: no mask on W loads
    offs_k = tl.arange(0, BLOCK_K)
    w_first = _load_w_tile(w_ptr, rows, offs_k, K, EVEN_K)  # before the wait: module doc
    pdl_enter(USE_PDL)
    rstd0, rstd1 = _rstd_pair(x_ptr, res_ptr, res_out_ptr, K, eps, stride_xm, NORM, HAS_RESIDUAL, TWO_ROWS,
                              BLOCK_K)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w = w_first.to(tl.float32)
    acc0 += w * _load_row(x_ptr, res_ptr, nw_ptr, offs_k, K, rstd0, EVEN_K, NORM, HAS_RESIDUAL)
    if TWO_ROWS:
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc1 += w * _load_row(x_ptr + stride_xm, res_ptr + stride_xm, nw_ptr, offs_k, K, rstd1, EVEN_K, NORM,
                              HAS_RESIDUAL)
    for kb in range(1, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        w = _load_w(w_ptr, rows, k, K, EVEN_K)
        acc0 += w * _load_row(x_ptr, res_ptr, nw_ptr, k, K, rstd0, EVEN_K, NORM, HAS_RESIDUAL)
        if TWO_ROWS:  # the second row reuses the weight tile: the weight is read once
            acc1 += w * _load_row(x_ptr + stride_xm, res_ptr + stride_xm, nw_ptr, k, K, rstd1, EVEN_K, NORM,
                                  HAS_RESIDUAL)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, (tl.sum(acc0, axis=1) + bias).to(out_ty), mask=n_mask)
    if TWO_ROWS:
        tl.store(y_ptr + stride_ym + offs_n, (tl.sum(acc1, axis=1) + bias).to(out_ty), mask=n_mask)


@triton.jit
def _swiglu(gate, up, out_ty: tl.constexpr):
    gate = gate.to(out_ty).to(tl.float32)  # rounded as the unfused projection's output is
    up = up.to(out_ty).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(out_ty)


@triton.jit
def _gemv_silu_mul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_xm, stride_ym,
                          res_ptr, nw_ptr, res_out_ptr, eps,
                          HAS_BIAS: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr,
                          HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr = False):
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # N: the activation's width
    n_mask = offs_n < N
    feature = tl.where(n_mask, offs_n, 0).to(tl.int64)
    gate_rows = feature * stride_wn
    up_rows = (feature + N) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    gate_first = _load_w_tile(w_ptr, gate_rows, offs_k, K, EVEN_K)  # before the wait: module doc
    up_first = _load_w_tile(w_ptr, up_rows, offs_k, K, EVEN_K)
    pdl_enter(USE_PDL)
    rstd0, rstd1 = _rstd_pair(x_ptr, res_ptr, res_out_ptr, K, eps, stride_xm, NORM, HAS_RESIDUAL, TWO_ROWS,
                              BLOCK_K)
    w_gate = gate_first.to(tl.float32)
    w_up = up_first.to(tl.float32)
    x0 = _load_row(x_ptr, res_ptr, nw_ptr, offs_k, K, rstd0, EVEN_K, NORM, HAS_RESIDUAL)
    gate0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    gate0 += w_gate * x0
    up0 += w_up * x0
    if TWO_ROWS:
        x1 = _load_row(x_ptr + stride_xm, res_ptr + stride_xm, nw_ptr, offs_k, K, rstd1, EVEN_K, NORM,
                       HAS_RESIDUAL)
        gate1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        up1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        gate1 += w_gate * x1
        up1 += w_up * x1
    for kb in range(1, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        w_gate = _load_w(w_ptr, gate_rows, k, K, EVEN_K)
        w_up = _load_w(w_ptr, up_rows, k, K, EVEN_K)
        x0 = _load_row(x_ptr, res_ptr, nw_ptr, k, K, rstd0, EVEN_K, NORM, HAS_RESIDUAL)
        gate0 += w_gate * x0
        up0 += w_up * x0
        if TWO_ROWS:
            x1 = _load_row(x_ptr + stride_xm, res_ptr + stride_xm, nw_ptr, k, K, rstd1, EVEN_K, NORM,
                           HAS_RESIDUAL)
            gate1 += w_gate * x1
            up1 += w_up * x1
    gate_bias = tl.zeros([BLOCK_N], tl.float32)
    up_bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        gate_bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        up_bias = tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, _swiglu(tl.sum(gate0, axis=1) + gate_bias, tl.sum(up0, axis=1) + up_bias, out_ty),
             mask=n_mask)
    if TWO_ROWS:
        tl.store(y_ptr + stride_ym + offs_n,
                 _swiglu(tl.sum(gate1, axis=1) + gate_bias, tl.sum(up1, axis=1) + up_bias, out_ty), mask=n_mask)


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if (x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_ROWS or weight.dim() != 2
            or x.shape[1] != weight.shape[1]):
        raise ValueError(f"gemv wants x [1 or 2, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("gemv wants a weight and an x contiguous along K")


@dataclass(frozen=True)
class NormPrologue:
    """The RMSNorm a GEMV applies to its input first: ``weight``, ``eps``, and the residual
    added before it (``None``: a plain ``rms_norm``)."""
    weight: torch.Tensor
    eps: float
    residual: Optional[torch.Tensor] = None


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                config: Optional[GemvConfig] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias[N])`` -> ``[M, N]`` in x's dtype, M = 1 or 2;
    ``config`` defaults to ``config_for`` the weight's shape."""
    _check_rows(x, weight)
    n, k = weight.shape
    config = config or config_for(n, k, x.shape[0])
    return _launch(_gemv_kernel, x, weight, bias, n, config, out)


def gemv_silu_mul_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         config: Optional[GemvConfig] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(g) * u`` where ``[g | u] = x [M, K] @ weight[2d, K].T (+ bias[2d])`` -> ``[M, d]``.
    ``config`` defaults to ``config_for`` the stacked weight, with half its rows per program
    (each program reads a gate row and an up row per feature)."""
    _check_rows(x, weight)
    return _launch(_gemv_silu_mul_kernel, x, weight, bias, _half_rows(weight), config or _swiglu_config(weight, x),
                   out)


def rms_norm_gemv_triton(x: torch.Tensor, norm: NormPrologue, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, silu_mul: bool = False,
                         config: Optional[GemvConfig] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``gemv_triton`` (``silu_mul``: ``gemv_silu_mul_triton``) of the RMSNorm of ``x`` (+
    ``norm.residual``); returns the projection and the new residual ``x + residual`` (``None``
    without a residual)."""
    _check_rows(x, weight)
    if norm.weight.shape != (x.shape[1],) or (norm.residual is not None and norm.residual.shape != x.shape):
        raise ValueError(f"the norm wants a weight [{x.shape[1]}] and a residual {tuple(x.shape)}; got "
                         f"{tuple(norm.weight.shape)}, {None if norm.residual is None else tuple(norm.residual.shape)}")
    if not x.is_contiguous() or (norm.residual is not None and not norm.residual.is_contiguous()):
        raise ValueError("the fused norm wants x and the residual contiguous")
    if silu_mul:
        kernel, width, config = _gemv_silu_mul_kernel, _half_rows(weight), config or _swiglu_config(weight, x)
    else:
        kernel, width, config = _gemv_kernel, weight.shape[0], config or config_for(*weight.shape, x.shape[0])
    residual_out = None if norm.residual is None else torch.empty_like(x)
    norm = NormPrologue(norm.weight.contiguous(), norm.eps, norm.residual)  # the kernel reads it at unit stride
    y = _launch(kernel, x, weight, bias, width, config, None, norm, residual_out)
    return y, residual_out


def _half_rows(weight: torch.Tensor) -> int:
    if weight.shape[0] % 2:
        raise ValueError(f"a [gate | up] weight has an even row count; got {weight.shape[0]}")
    return weight.shape[0] // 2


def _swiglu_config(weight: torch.Tensor, x: torch.Tensor) -> GemvConfig:
    stacked = config_for(weight.shape[0], weight.shape[1], x.shape[0])
    return GemvConfig(max(stacked.block_n // 2, 2), stacked.block_k, stacked.num_warps, stacked.num_stages)


def _launch(kernel, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], width: int,
            config: GemvConfig, out: Optional[torch.Tensor], norm: Optional[NormPrologue] = None,
            residual_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Either kernel over ``width`` outputs a row (a program per ``config.block_n`` of them),
    with the RMSNorm prologue when ``norm`` is given (``residual_out``: where program 0 writes
    the new residual)."""
    k = weight.shape[1]
    y = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device) if out is None else out
    residual = x if norm is None or norm.residual is None else norm.residual
    kernel[(triton.cdiv(width, config.block_n),)](
        x, weight, weight if bias is None else bias, y, width, k, weight.stride(0), x.stride(0), y.stride(0),
        residual, x if norm is None else norm.weight, residual if residual_out is None else residual_out,
        0.0 if norm is None else norm.eps,
        HAS_BIAS=bias is not None, TWO_ROWS=x.shape[0] == 2, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, NORM=norm is not None, HAS_RESIDUAL=residual_out is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(x.device))
    return y
