"""This process's place in the engine's ranks: its tensor-parallel group (rank, size and the
torch.distributed group name the model's functional collectives use) and its pipeline stage.

Ranks are numbered stage-major: ``rank = stage * tensor_parallel_size + tp_rank``, so the T
ranks of one stage are neighbours (on one node, where the all-reduces are) and stage s talks
only to the same tp rank of stages s - 1 and s + 1 (``PPStage.prev_rank``/``next_rank``).

One place per process (a worker is one rank of one engine), set once by ``init_tensor_parallel``
before the model is built; an engine without parallelism never touches torch.distributed and
reads the defaults: rank 0 of 1, the only stage.
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


@dataclass(frozen=True)
class PPStage:
    """This rank's pipeline stage, and the global ranks it exchanges activations with."""

    index: int = 0
    size: int = 1
    rank: int = 0  # global rank (all stages, all tp ranks)
    world_size: int = 1  # global: tensor_parallel_size * pipeline_parallel_size
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.size:
            raise ValueError(f"stage {self.index} is outside a pipeline of {self.size}")
        if self.world_size != self.size * self.tp_size:
            raise ValueError(f"world size {self.world_size} is not {self.size} stages x {self.tp_size} ranks")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def prev_rank(self) -> int:
        """The rank this one receives activations from (same tp rank, previous stage)."""
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        """The rank this one sends activations to (same tp rank, next stage)."""
        return self.rank + self.tp_size


_SINGLE = TPGroup()
_current: TPGroup = _SINGLE
_ONLY_STAGE = PPStage()
_stage: PPStage = _ONLY_STAGE


def tp_group() -> TPGroup:
    """The group of this process: rank 0 of 1 unless ``init_tensor_parallel`` ran."""
    return _current


def pp_stage() -> PPStage:
    """The stage of this process: the only one unless ``init_tensor_parallel`` ran with stages."""
    return _stage


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         timeout_s: float, device: Optional[torch.device] = None,
                         pipeline_parallel_size: int = 1) -> TPGroup:
    """Joins the ranks (``torch.distributed.init_process_group`` at ``init_method``, a
    ``tcp://HOST:PORT`` the executor chose) and makes this process's TP group and stage.
    ``world_size`` counts every rank of every stage; with one stage the TP group is the world.

    ``timeout_s`` bounds every collective and receive: a rank that never arrives (it died) makes
    the others fail after that long instead of waiting forever."""
    import torch.distributed as dist

    global _current, _stage
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: one engine rank per process")
    if world_size % pipeline_parallel_size:
        raise ValueError(f"world size {world_size} is not a multiple of {pipeline_parallel_size} stages")
    kwargs = {"device_id": device} if device is not None and device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    tp_size = world_size // pipeline_parallel_size
    _stage = PPStage(rank // tp_size, pipeline_parallel_size, rank, world_size, tp_size)
    _current = TPGroup(rank % tp_size, tp_size, _tp_group_name(_stage, backend, timeout_s))
    return _current


def _tp_group_name(stage: PPStage, backend: str, timeout_s: float) -> Optional[str]:
    """The name of this stage's TP group: the world's with one stage; else every rank creates
    every stage's subgroup, in stage order (``new_group`` is collective), and keeps its own."""
    import torch.distributed as dist

    if stage.size == 1:
        return dist.group.WORLD.group_name
    if stage.tp_size == 1:
        return None
    mine = None
    for s in range(stage.size):
        ranks = list(range(s * stage.tp_size, (s + 1) * stage.tp_size))
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
        if s == stage.index:
            mine = group.group_name
    return mine


def destroy_tensor_parallel() -> None:
    """Leaves the group (the worker's last act); the process is rank 0 of 1 again."""
    import torch.distributed as dist

    global _current, _stage
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = _SINGLE
    _stage = _ONLY_STAGE
