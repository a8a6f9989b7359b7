"""``LoRAConfig``: the fixed sizes multi-LoRA serving is built with.

Fixed at model build time because they are the shapes of the stacked adapter buffers and of
the per-token slot index, which the compiled graphs and CUDA graphs see: changing them means
building (and compiling) again, while loading adapters never does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_NUM_TOKENS = 8192


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras``: adapters resident at once (the slots); ``max_lora_rank``: the largest rank
    an adapter may have (smaller ones are zero-padded); ``max_num_tokens``: the most rows one
    forward may carry (the per-token slot buffer's length); ``max_cpu_loras``: adapters kept
    loaded in host memory (default ``max_loras``), least recently used dropped first."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        for field_name in ("max_loras", "max_lora_rank", "max_num_tokens"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LoRAConfig.{field_name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"LoRAConfig.max_cpu_loras ({self.max_cpu_loras}) must be at least "
                             f"max_loras ({self.max_loras})")

    @property
    def host_cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
