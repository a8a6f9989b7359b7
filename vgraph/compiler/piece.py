"""A compiled piece at run time: one artifact for the dynamic token count, plus one per
``compile_sizes`` entry, chosen by the token count of each call. When the forward context
carries PIECEWISE CUDA graphs (piecewise_graphs.py), the call goes through the piece's graph
for that token count instead."""
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


def _unflatten(single_output: bool) -> Callable[[Any], Any]:
    # The split module expects what the piece returned. A loaded artifact returns a flat list;
    # one compiled in this process returns a single-output piece's tensor as is.
    if single_output:
        return lambda out: out[0] if isinstance(out, (list, tuple)) else out
    return tuple


class PieceRunner(torch.nn.Module):
    """Stands in for a piece's submodule inside the split graph."""

    def __init__(self, dynamic: Callable, static: dict[int, Callable], token_dim: Optional[TokenDim],
                 single_output: bool) -> None:
        super().__init__()
        self.dynamic, self.static, self.token_dim = dynamic, static, token_dim
        self._unflatten = _unflatten(single_output)

    def forward(self, *args: Any) -> Any:
        num_tokens = self.token_dim.read(args) if self.token_dim is not None else None
        fn = self.dynamic
        if self.static and num_tokens is not None:
            fn = self.static.get(num_tokens, self.dynamic)
        ctx = current_forward_context()
        if ctx is not None and ctx.piecewise is not None and num_tokens is not None:
            return self._unflatten(ctx.piecewise.run(self, fn, args, num_tokens))
        return self._unflatten(call_opaque(fn, args))
