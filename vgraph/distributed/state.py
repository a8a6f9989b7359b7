"""This process's tensor-parallel group: its rank, the group's size and the torch.distributed
group name the model's functional collectives use.

One group per process (a worker is one rank of one engine), set once by ``init_tensor_parallel``
before the model is built; an engine without tensor parallelism never touches torch.distributed
and reads the default, rank 0 of 1.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    # The process group's name (``ProcessGroup.group_name``): functional collectives take it as a
    # plain string, which Dynamo keeps as a constant in the traced graph.
    group_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")
        if self.world_size > 1 and self.group_name is None:
            raise ValueError("a tensor-parallel group of more than one rank needs its process group's name")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1


_SINGLE = TPGroup()
_current: TPGroup = _SINGLE


def tp_group() -> TPGroup:
    """The group of this process: rank 0 of 1 unless ``init_tensor_parallel`` ran."""
    return _current


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         timeout_s: float, device: Optional[torch.device] = None) -> TPGroup:
    """Joins the group (``torch.distributed.init_process_group`` at ``init_method``, a
    ``tcp://127.0.0.1:PORT`` the executor chose) and makes it this process's group.

    ``timeout_s`` bounds every collective: a rank that never arrives (it died) makes the others
    fail after that long instead of waiting forever."""
    import torch.distributed as dist

    global _current
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: one engine rank per process")
    kwargs = {"device_id": device} if device is not None and device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    _current = TPGroup(rank, world_size, dist.group.WORLD.group_name)
    return _current


def destroy_tensor_parallel() -> None:
    """Leaves the group (the worker's last act); the process is rank 0 of 1 again."""
    import torch.distributed as dist

    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = _SINGLE
