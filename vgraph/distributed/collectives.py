"""The collectives of a tensor-parallel model, as torch.distributed functional collectives.

Why functional ones: ``torch.distributed._functional_collectives.all_reduce`` returns a new
tensor instead of writing in place, so Dynamo traces it as ``_c10d_functional.all_reduce`` then
``_c10d_functional.wait_tensor``, two ordinary graph nodes. The whole forward stays one graph,
vgraph's backend splits it only at attention as before, and Inductor compiles the collectives
inside the pieces, where passes can fuse around them (``wait_tensor(all_reduce(x))`` followed by
the residual add and RMSNorm is the all-reduce fusion's pattern). With one rank every helper
returns its input and nothing distributed is imported into the graph.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .state import TPGroup


def all_reduce(x: Tensor, group: TPGroup) -> Tensor:
    """The sum of ``x`` over the group's ranks (every rank gets the same tensor)."""
    if not group.is_parallel:
        return x
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group.group_name)


def all_gather_last_dim(x: Tensor, group: TPGroup) -> Tensor:
    """``[..., n]`` shards of every rank concatenated in rank order: ``[..., world_size * n]``.

    Functional all-gathers concatenate along dim 0, so the shards are gathered as they are and
    the rank dim is moved next to the last one. The ``_c10d_functional`` ops are called directly:
    the Python wrapper for them was renamed between the torch releases vgraph supports (2.11
    has ``all_gather_tensor`` only; 2.13 adds ``all_gather_single`` and deprecates the other), while
    the ops, which Dynamo traces either way, are the same in both."""
    if not group.is_parallel:
        return x
    import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional)

    functional = torch.ops._c10d_functional
    gathered = functional.wait_tensor(
        functional.all_gather_into_tensor(x.contiguous(), group.world_size, group.group_name))
    shards = gathered.view(group.world_size, *x.shape)
    return torch.movedim(shards, 0, -2).reshape(*x.shape[:-1], group.world_size * x.shape[-1])
