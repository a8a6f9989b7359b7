"""A compiled piece at run time: one artifact for the dynamic token count, plus one per
``compile_sizes`` entry, chosen by the token count of each call. When the forward context
carries PIECEWISE CUDA graphs (piecewise_graphs.py), the call goes through the piece's graph
for that token count instead.

The model's tail (the piece after its last attention) may run on fewer rows than the batch:
when the model declares that tail row-wise and the forward context names the only rows
whose hidden states are used (``ForwardContext.output_rows``: the sampled rows of a batch
with prefills), the runner gathers those rows of its token-dimension arguments and the piece
runs on them alone. A prefill of P tokens then computes the last layer's MLP (and o_proj)
for one row instead of P: on an 8-layer model about a tenth of a prefill's GEMM work."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from vgraph.ops.forward_context import current_forward_context

from .capture_safety import call_opaque


@dataclass(frozen=True)
class TokenDim:
    """Where a piece's runtime token count is read: an int argument, or dim 0 of a tensor."""

    arg_index: int
    is_int: bool

    def read(self, args: tuple) -> int:
        value = args[self.arg_index]
        return int(value) if self.is_int else value.shape[0]


def find_token_dim(example_args: list, token_symbol: Any) -> Optional[TokenDim]:
    """The first argument carrying the symbolic token count (None for a fully static piece)."""
    for i, arg in enumerate(example_args):
        if isinstance(arg, torch.SymInt) and arg.node.expr == token_symbol:
            return TokenDim(i, True)
        if isinstance(arg, torch.Tensor) and arg.dim() > 0 and isinstance(arg.shape[0], torch.SymInt) \
                and arg.shape[0].node.expr == token_symbol:
            return TokenDim(i, False)
    return None


@dataclass(frozen=True)
class RowArgs:
    """The arguments of a row-wise piece that carry the token dimension: tensors with it as
    their (contiguous) dim 0, and ints equal to the token count."""

    tensors: tuple[int, ...]
    ints: tuple[int, ...]

    def select(self, args: tuple, rows: torch.Tensor) -> tuple:
        """``args`` restricted to ``rows`` (int64, on the tensors' device)."""
        out = list(args)
        for i in self.tensors:
            out[i] = args[i].index_select(0, rows)
        for i in self.ints:
            out[i] = rows.shape[0]
        return tuple(out)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Contiguous, for a tensor whose only symbolic size is dim 0 (checked in plain ints, so
    no guard is added to the traced graph's shape environment)."""
    expected = 1
    for dim in range(t.dim() - 1, -1, -1):
        if dim > 0 and t.shape[dim] == 1:
            continue
        if t.stride(dim) != expected:
            return False
        if dim > 0:
            expected *= t.shape[dim]
    return True


def find_row_args(example_args: list, token_symbol: Any) -> Optional[RowArgs]:
    """Where a piece's example arguments carry the token dimension, or None when the piece
    could not run on a subset of rows as compiled: the symbol also sits elsewhere (another
    dim, a stride, an expression), another symbol appears, or a token tensor is not
    contiguous (the gathered rows are, and the compiled code checks strides)."""
    tensors, ints = [], []
    for i, arg in enumerate(example_args):
        if isinstance(arg, torch.SymInt):
            if arg.node.expr != token_symbol:
                return None
            ints.append(i)
        elif isinstance(arg, torch.Tensor):
            sizes = (*arg.shape, *arg.stride())
            if not any(isinstance(s, torch.SymInt) for s in sizes):
                continue  # a weight
            if not (isinstance(arg.shape[0], torch.SymInt) and arg.shape[0].node.expr == token_symbol) \
                    or any(isinstance(s, torch.SymInt) for s in sizes[1:]) or not _rows_contiguous(arg):
                return None
            tensors.append(i)
    return RowArgs(tuple(tensors), tuple(ints)) if tensors else None


def _unflatten(single_output: bool) -> Callable[[Any], Any]:
    # The split module expects what the piece returned. A loaded artifact returns a flat list;
    # one compiled in this process returns a single-output piece's tensor as is.
    if single_output:
        return lambda out: out[0] if isinstance(out, (list, tuple)) else out
    return tuple


class PieceRunner(torch.nn.Module):
    """Stands in for a piece's submodule inside the split graph."""

    def __init__(self, dynamic: Callable, static: dict[int, Callable], token_dim: Optional[TokenDim],
                 single_output: bool, row_args: Optional[RowArgs] = None) -> None:
        super().__init__()
        self.dynamic, self.static, self.token_dim = dynamic, static, token_dim
        self.row_args = row_args  # set on the model's row-wise tail only
        self._unflatten = _unflatten(single_output)

    def forward(self, *args: Any) -> Any:
        ctx = current_forward_context()
        if self.row_args is not None and ctx is not None and ctx.output_rows is not None \
                and ctx.piecewise is None:
            args = self.row_args.select(args, ctx.output_rows)
        num_tokens = self.token_dim.read(args) if self.token_dim is not None else None
        fn = self.dynamic
        if self.static and num_tokens is not None:
            fn = self.static.get(num_tokens, self.dynamic)
        if ctx is not None and ctx.piecewise is not None and num_tokens is not None:
            return self._unflatten(ctx.piecewise.run(self, fn, args, num_tokens))
        return self._unflatten(call_opaque(fn, args))
