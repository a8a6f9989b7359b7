"""``LoRARequest``: which adapter a request runs with, spelled as vLLM spells it.

vLLM users write ``LoRARequest("sql", 1, "/adapters/sql")`` (``vllm.lora.request``); the same
line works with ``from vgraph import LoRARequest``. The integer id, not the name, identifies
the adapter to the slot manager and (later) the prefix cache, as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter: a display name, a unique id >= 1, and its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 stands for the base model), "
                             f"got {self.lora_int_id!r} for adapter {self.lora_name!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"adapter {self.lora_name!r} has no lora_path (its PEFT folder)")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
