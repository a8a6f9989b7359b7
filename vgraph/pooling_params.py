"""``PoolingParams``: what an embedding request asks of the engine (vLLM's name and shape)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """How one prompt's final hidden states (the final norm's output, what feeds lm_head)
    become one vector. ``None`` fields take the engine's defaults (``pooling_type`` and
    ``pooling_normalize`` in ``ModelConfig``, i.e. ``--pooling-type`` / ``--no-pooling-normalize``).

    - ``pooling_type``: "last" (the last prompt token's hidden state: what a decoder model has
      read the whole prompt into) or "mean" (the average over every prompt token).
    - ``normalize``: divide by the L2 norm, so cosine similarity is a dot product.
    """

    pooling_type: Optional[str] = None
    normalize: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    @property
    def n(self) -> int:
        """One sequence per prompt (the queue counts sequences, as for ``SamplingParams.n``)."""
        return 1
