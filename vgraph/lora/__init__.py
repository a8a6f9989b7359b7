"""Multi-LoRA: PEFT adapters served from fixed stacked slots inside the compiled graphs.

- ``request``: ``LoRARequest`` (vLLM's name, fields and order), exported from ``vgraph``.
- ``config``: ``LoRAConfig``, the fixed sizes (slots, max rank, per-token buffer length).
- ``adapter``: reads and checks a PEFT folder against the base model's projection shapes.
- ``layers``: ``LoRAProjection``, a projection's stacked buffers, applied by ``vgraph::lora_add``.
- ``slots``: ``LoRASlotManager``, host cache and slot LRU; loading copies, never reallocates.

Only the two torch-free modules are imported here, so ``vgraph.LoRARequest`` does not pull
in torch (``import vgraph`` stays light); the others are imported from their modules.
"""
from __future__ import annotations

from .config import LoRAConfig
from .request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
