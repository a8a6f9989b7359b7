"""``LoRAProjection``: the stacked adapter buffers of one (possibly fused) projection.

The model keeps one beside each adapted projection (q|k|v, o, gate|up, down) and adds its
output to the projection's through ``vgraph::lora_add``. The buffers are module buffers,
so the compiled graph takes them as inputs at fixed addresses; an adapter is loaded by
copying into a slot's rows (``load_slot``) and removed by zeroing them, never by replacing
a tensor, so CUDA graphs captured over them stay valid and Dynamo sees nothing new.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph.lora_add)


class LoRAProjection(nn.Module):
    """Slots of LoRA weights for a projection whose output is the concatenation of ``slices``
    (HF module name, output size), e.g. [("q_proj", 512), ("k_proj", 128), ("v_proj", 128)]."""

    def __init__(self, in_features: int, slices: list[tuple[str, int]], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.in_features = in_features
        self.slice_names = [name for name, _ in slices]
        self.max_loras, self.max_rank = max_loras, max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, len(slices) * max_rank, in_features,
                                                   dtype=dtype, device=device), persistent=False)
        for i, (_, size) in enumerate(slices):
            self.register_buffer(f"lora_b_{i}", torch.zeros(max_loras, size, max_rank, dtype=dtype,
                                                            device=device), persistent=False)

    @property
    def layout_name(self) -> str:
        """Its kind in the compile cache key: the buffer shapes are the graph's."""
        return f"LoRAProjection[{'|'.join(self.slice_names)},slots={self.max_loras},rank={self.max_rank}]"

    def lora_b(self) -> list[Tensor]:
        return [getattr(self, f"lora_b_{i}") for i in range(len(self.slice_names))]

    def forward(self, x: Tensor, base: Tensor, token_slots: Tensor) -> Tensor:
        """``base`` (the projection's output for ``x``) plus each row's adapter."""
        return torch.ops.vgraph.lora_add(base, x, self.lora_a, self.lora_b(), token_slots)

    @torch.no_grad()
    def load_slot(self, slot: int, weights: Mapping[str, Optional[tuple[Tensor, Tensor]]]) -> None:
        """Copies an adapter's (A [r, in], B [out_s, r]) per slice into ``slot``, zero-padding the
        rank to ``max_rank``; a slice absent from ``weights`` (or None) is zeroed: no delta."""
        self.clear_slot(slot)
        for i, name in enumerate(self.slice_names):
            pair = weights.get(name)
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            self.lora_a[slot, i * self.max_rank:i * self.max_rank + rank].copy_(a)
            getattr(self, f"lora_b_{i}")[slot, :, :rank].copy_(b)

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        for b in self.lora_b():
            b[slot].zero_()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, slices={self.slice_names}, slots={self.max_loras}, rank={self.max_rank}"
