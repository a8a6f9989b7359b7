"""Pipeline parallelism: which decoder layers each stage holds, and the point-to-point link
that carries a step's activations from one stage to the next.

Layers: P contiguous stages; an even split, the remainder one extra layer each to the first
stages (the last stage also runs the final norm, the lm_head and the sampler, so it gets the
fewest). ``VGRAPH_PP_LAYER_PARTITION="3,5"`` overrides it (vLLM's ``VLLM_PP_LAYER_PARTITION``):
layers per stage, summing to the model's.

Activations: what crosses a boundary is the hidden state and the residual stream (the model
carries the residual beside the hidden state, the add riding in the next fused add+RMSNorm),
one ``[tokens, 2 * hidden]`` tensor per step, sent with ``torch.distributed`` send/recv between
the same tp rank of neighbouring stages, outside the compiled forward (its graphs and CUDA
graphs cover only the stage's own layers). Sends are asynchronous, so a stage starts its next
step while the next stage still receives this one; receives block, in step order.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from .state import PPStage

LAYER_PARTITION_ENV = "VGRAPH_PP_LAYER_PARTITION"


def stage_layers(num_layers: int, num_stages: int, override: Optional[str] = None) -> list[range]:
    """Each stage's decoder layers (global indices). ``override`` (default: the environment's
    ``VGRAPH_PP_LAYER_PARTITION``) lists the layers per stage. Raises ValueError when a stage
    would hold no layer or the counts do not add up."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {num_stages}")
    text = os.environ.get(LAYER_PARTITION_ENV) if override is None else override
    counts = _parse_partition(text, num_layers, num_stages) if text else _even_split(num_layers, num_stages)
    bounds = [sum(counts[:i]) for i in range(num_stages + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]


def _even_split(num_layers: int, num_stages: int) -> list[int]:
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} decoder layers: "
                         "every stage needs at least one layer")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def _parse_partition(text: str, num_layers: int, num_stages: int) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{LAYER_PARTITION_ENV}={text!r}: expected comma-separated layer counts") from None
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"{LAYER_PARTITION_ENV}={text!r} must give {num_stages} positive layer counts "
                         f"summing to the model's {num_layers} layers")
    return counts


class StageLink:
    """Sends this stage's output to the next stage and receives its input from the previous one.
    Sends go out asynchronously; the previous send is waited for before the next (bounded memory,
    and the sent tensor is a private copy, so the forward may reuse its buffers meanwhile)."""

    def __init__(self, stage: PPStage) -> None:
        self.stage = stage
        self._pending: Optional[tuple[Any, torch.Tensor]] = None  # (work, the tensor it sends)

    def receive_into(self, rows: torch.Tensor) -> None:
        """Fills ``rows`` (contiguous) with the previous stage's output of this step."""
        import torch.distributed as dist

        dist.recv(rows, src=self.stage.prev_rank)

    def send(self, rows: torch.Tensor) -> None:
        """Starts sending ``rows`` (this step's output, padding dropped) to the next stage."""
        import torch.distributed as dist

        self.flush()
        copy = rows.contiguous().clone()
        self._pending = (dist.isend(copy, dst=self.stage.next_rank), copy)

    def flush(self) -> None:
        """Waits for the last send to complete."""
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            work.wait()
