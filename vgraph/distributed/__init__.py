"""Tensor parallelism over torch.distributed: the process's group (``state``), the collectives the
model calls (``collectives``), how a checkpoint is cut into shards (``sharding``), and the
executors that run the ranks (``executors`` chooses: ``executor``, one process per rank on this
machine; ``ray_executor``, one Ray actor per rank across nodes; both drive ``worker``'s rank
loop); each step every rank receives the scheduler's plain plan (core/step_plan.py).

vgraph writes no communication layer: ranks meet through ``torch.distributed`` (gloo on CPU, NCCL
on CUDA), and the model's all-reduces are functional collectives, which Dynamo traces into the
graph and Inductor compiles inside the pieces like any other op.
"""
from .state import TPGroup, tp_group

__all__ = ["TPGroup", "tp_group"]
