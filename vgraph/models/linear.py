"""The model's float projections: plain, fused (several outputs of one input), and packed.

``Linear`` and ``MergedLinear`` are what the model is built and loaded with. After loading, a
CPU float32 model swaps each of them for a ``PackedLinear`` holding the same weight packed
into 16-column panels (``vgraph::packed_linear``, see ops/linear.py for why) and drops the
unpacked copy, so memory does not double. Loading again unpacks first, so a model can be
reloaded in place. A tied ``lm_head`` shares the embedding's storage, and packing it would copy
what is often the largest matrix of a small model; it becomes a ``RowMajorLinear``, the same
tiles over a weight packed group by group as it runs. Except when it is small (at most
``PACKED_TIED_HEAD_BYTES``): then a packed copy costs little memory and saves that packing on
every call, which at one sampled row is most of the call (demo model's head, 4096 x 192: 50 us
row-major against 19 us packed; a 32000 x 896 head: 5.5 against 1.9 ms). Unpacking ties it again.

Prefill-sized calls of a shape for which startup measured torch's BLAS faster (see
ops/linear_tuning.py) keep the unpacked weight too, and the op uses it for those calls.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import logging

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph.*)
from vgraph.ops.linear import kernel_isa, pack_weight, unpack_weight
from vgraph.ops.linear_tuning import TUNING_ROWS, choose_prefill_kernels, describe

PACKED_TIED_HEAD_BYTES = 64 << 20  # a tied head up to this size gets a packed copy (module doc)

logger = logging.getLogger(__name__)


def empty_parameter(*shape: int, dtype: torch.dtype, device: Any) -> nn.Parameter:
    # Uninitialized: every weight is overwritten by load_weights, and random init of a
    # multi-GB model would cost seconds for nothing.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with uninitialized parameters. ``custom_op``: on CUDA, run as
    ``vgraph::linear``, whose one-row calls take vgraph's GEMV kernel (ops/dense_linear.py);
    off, ``F.linear`` (a model built for Inductor to generate its own kernels, a head)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: Any, custom_op: bool = False) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.custom_op = custom_op

    def forward(self, x: Tensor) -> Tensor:
        if self.custom_op and self.weight.is_cuda:
            return torch.ops.vgraph.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input stacked on the output dim, run as one GEMM.

    ``shards`` names each part and its output size in order; the loader copies each HF
    weight into its row range.
    """

    def __init__(self, in_features: int, shards: list[tuple[str, int]], bias: bool,
                 dtype: torch.dtype, device: Any, custom_op: bool = False) -> None:
        super().__init__(in_features, sum(size for _, size in shards), bias, dtype, device, custom_op)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards:
            self.shards[name] = (start, size)
            start += size

    def shard_view(self, param_name: str, shard: str) -> Tensor:
        """Where the loader copies ``shard``'s rows of ``param_name`` (weight or bias)."""
        start, size = self.shards[shard]
        return getattr(self, param_name).data.narrow(0, start, size)


class PackedLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` stored packed; ``weight`` unpacks a copy for inspection.

    ``shards`` is kept from a ``MergedLinear`` so that ``unpack`` rebuilds the same module.
    ``keep_dense``: also keep the unpacked weight, for prefill-sized calls (BLAS measured faster).
    """

    def __init__(self, source: Linear, keep_dense: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = source.weight.shape
        self.shards: Optional[dict[str, tuple[int, int]]] = getattr(source, "shards", None)
        self.weight_packed = nn.Parameter(pack_weight(source.weight), requires_grad=False)
        self.weight_dense = source.weight if keep_dense else None
        self.bias = source.bias
        # A tied head's Parameter (another module's), to tie the unpacked Linear to again; in a
        # tuple so that it is not registered as this module's parameter too.
        self._tied_to: tuple[nn.Parameter, ...] = (source.weight,) if tied else ()

    @property
    def weight(self) -> Tensor:
        return unpack_weight(self.weight_packed.data, self.out_features)

    @property
    def layout_name(self) -> str:
        """Its kind in the compile cache key (the dense weight is one more graph input)."""
        return "PackedLinear+dense" if self.weight_dense is not None else "PackedLinear"

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.vgraph.packed_linear(x, self.weight_packed, self.bias, self.out_features,
                                              self.weight_dense)

    def unpack(self) -> Linear:
        """The ``Linear`` (or ``MergedLinear``) this was packed from, with the same values."""
        device, bias = self.weight_packed.device, self.bias is not None
        if self.shards is None:
            module = Linear(self.in_features, self.out_features, bias, torch.float32, device)
        else:
            shards = [(name, size) for name, (_, size) in self.shards.items()]
            module = MergedLinear(self.in_features, shards, bias, torch.float32, device)
        if self._tied_to:
            module.weight = self._tied_to[0]
        else:
            module.weight.data.copy_(self.weight)
        module.bias = self.bias
        return module

    def extra_repr(self) -> str:
        dense = ", dense copy for prefill" if self.weight_dense is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed{dense}"


class RowMajorLinear(nn.Module):
    """``y = x @ W.T (+ b)`` on the packed kernel's tiles with ``W`` kept as it is (the same
    Parameter, so a tied lm_head stays tied to the embedding and reloads with it). Why: on a
    decode step BLAS ran a 0.5B model's 32000 x 896 tied head at ~89 GFLOP/s on two Zen 4
    cores, ~12% of the step, where the tiles reach well over 100 per core (ops/linear.py)."""

    def __init__(self, source: Linear) -> None:
        super().__init__()
        self.out_features, self.in_features = source.weight.shape
        self.weight = source.weight
        self.bias = source.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.vgraph.rowmajor_linear(x, self.weight, self.bias)

    def unpack(self) -> Linear:
        """The plain ``Linear`` over the same Parameters."""
        module = Linear(self.in_features, self.out_features, False, self.weight.dtype, self.weight.device)
        module.weight, module.bias = self.weight, self.bias
        return module


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


@torch.no_grad()
def pack_linears(model: nn.Module, tied: set[str]) -> int:
    """Packs every float32 ``Linear`` (fused ones included), keeping the unpacked weight of
    shapes whose prefill GEMM is BLAS; returns how many were packed. Those named in ``tied``
    (a tied lm_head) run the same kernel over their weight as it is, unless they are small
    (``PACKED_TIED_HEAD_BYTES``: then a packed copy, tied again when unpacked)."""
    float_linears = [(name, module) for name, module in model.named_modules()
                     if isinstance(module, Linear) and module.weight.dtype == torch.float32]
    row_major = {name for name, module in float_linears
                 if name in tied and module.weight.numel() * 4 > PACKED_TIED_HEAD_BYTES}
    for name, module in float_linears:
        if name in row_major:
            _swap(model, name, RowMajorLinear(module))
    targets = [(name, module) for name, module in float_linears if name not in row_major]
    if not targets:
        return 0
    # The lm_head only sees the rows the sampler needs: it stays on the packed kernel.
    choices = choose_prefill_kernels(tuple(m.weight.shape) for n, m in targets if n != "lm_head")
    logger.info("prefill GEMM per weight shape (up to %d rows, %d threads, packed kernel %s): %s",
                TUNING_ROWS, torch.get_num_threads(), kernel_isa(), describe(choices))
    kept = 0
    for name, module in targets:
        choice = choices.get(tuple(module.weight.shape)) if name != "lm_head" else None
        keep = choice is not None and choice.kernel == "blas"
        kept += module.weight.numel() * 4 if keep else 0
        _swap(model, name, PackedLinear(module, keep_dense=keep, tied=name in tied))
    if kept:
        logger.info("kept %.1f MiB of unpacked weights for BLAS prefill GEMMs", kept / 2**20)
    return len(targets)


@torch.no_grad()
def unpack_linears(model: nn.Module) -> None:
    """Undoes ``pack_linears`` (before loading weights into the model again)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (PackedLinear, RowMajorLinear)):
            _swap(model, name, module.unpack())
