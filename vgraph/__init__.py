"""vgraph: an LLM inference runtime built around torch.compile and CUDA graphs."""
from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: F401,E402  (registers torch.ops.vgraph.*)
