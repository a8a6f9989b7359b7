"""The dispatcher: which path runs a batch, and at which padded size (bucket).

Three paths, as in vLLM:

- FULL: a pure-decode batch (every sequence one new token) of n rows runs in the smallest
  FULL bucket B >= n, padded with B - n empty sequences. On CUDA that replays one captured
  graph of the whole forward, attention included.
- PIECEWISE: any other batch of T tokens runs in the smallest token bucket >= T, padded
  with T' - T rows that belong to no sequence. On CUDA every compiled piece replays its graph
  for T' and attention runs eagerly between the pieces.
- NONE: batches above the largest bucket (or graphs off) run the compiled forward unpadded
  (except up to its smallest shape: Dynamo specializes sizes 0 and 1, so the compiled
  forward runs at least two rows, and capture sizes below two are raised to two).

Without CUDA the default mode is NONE (padding would only add work); with a mode set
explicitly the same decisions and the same padding run and each bucket is the compiled
forward at the padded size, so this logic is tested on every machine.

Capture sizes default to ``[1, 2, 4] + range(8, max_capture_size + 1, 8)``. The scheduler
never schedules more than ``max_num_batched_tokens`` tokens or ``max_num_seqs`` sequences,
so buckets above those could never be used: token buckets are capped by the budget, decode
buckets at the first one that holds ``max_num_seqs`` sequences. Every shape the scheduler
can produce therefore has a path (the NONE path takes any shape).
"""
from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from ..config import CompileConfig, CudaGraphMode

if TYPE_CHECKING:
    from .runner_requests import RunnerStep


class Path(str, enum.Enum):
    """What one batch runs through."""

    FULL = "full"
    PIECEWISE = "piecewise"
    NONE = "none"


def default_capture_sizes(max_capture_size: int) -> list[int]:
    """vLLM's default ladder: fine steps for small batches, then every multiple of 8."""
    return [s for s in [1, 2, 4] + list(range(8, max_capture_size + 1, 8)) if s <= max_capture_size]


@dataclass(frozen=True)
class Buckets:
    """Sorted bucket sizes: ``full`` in sequences (= tokens) of a decode batch, ``piecewise``
    in tokens of any batch."""

    full: tuple[int, ...]
    piecewise: tuple[int, ...]

    @staticmethod
    def smallest_at_least(sizes: Sequence[int], n: int) -> Optional[int]:
        i = bisect.bisect_left(sizes, n)
        return sizes[i] if i < len(sizes) else None


def capture_sizes(config: CompileConfig, max_num_seqs: int, max_num_batched_tokens: int,
                  min_forward_rows: int = 1) -> Buckets:
    """The buckets for an engine: the configured (or default) sizes, raised to the forward's
    ``min_forward_rows`` and capped by what the scheduler can produce."""
    wanted = config.cudagraph_capture_sizes
    if wanted is None:
        wanted = default_capture_sizes(config.max_capture_size)
    sizes = sorted({max(s, min_forward_rows) for s in wanted if s <= max_num_batched_tokens})
    # Decode batches hold at most max_num_seqs rows: keep the first bucket that fits them all.
    first_full = Buckets.smallest_at_least(sizes, max_num_seqs)
    full = [s for s in sizes if first_full is None or s <= first_full]
    return Buckets(full=tuple(full), piecewise=tuple(sizes))


@dataclass(frozen=True)
class BatchShape:
    """What the dispatcher needs to know about a batch."""

    num_tokens: int
    num_seqs: int
    uniform_decode: bool  # every sequence has exactly one new token

    @classmethod
    def of_step(cls, step: "RunnerStep") -> "BatchShape":
        """From a step's chunks, before any tensor is built: the one place a batch is judged
        pure decode."""
        lens = [c.num_new_tokens for c in step.chunks]
        return cls(sum(lens), len(lens), bool(lens) and all(n == 1 for n in lens))


@dataclass(frozen=True)
class Decision:
    path: Path
    bucket: int  # padded size: sequences (= tokens) for FULL, tokens otherwise
    num_tokens: int  # before padding

    @property
    def padding(self) -> int:
        return self.bucket - self.num_tokens


def choose(shape: BatchShape, buckets: Buckets, mode: CudaGraphMode, min_forward_rows: int = 1) -> Decision:
    """FULL for a pure-decode batch that fits a decode bucket, else PIECEWISE when the token
    count fits a token bucket, else NONE at the batch's own size (at least ``min_forward_rows``
    rows: the compiled forward's smallest shape)."""
    n = shape.num_tokens
    if n > 0 and shape.uniform_decode and mode.has_full:
        bucket = Buckets.smallest_at_least(buckets.full, n)
        if bucket is not None:
            return Decision(Path.FULL, bucket, n)
    if n > 0 and mode.has_piecewise:
        bucket = Buckets.smallest_at_least(buckets.piecewise, n)
        if bucket is not None:
            return Decision(Path.PIECEWISE, bucket, n)
    return Decision(Path.NONE, max(n, min_forward_rows) if n else 0, n)
