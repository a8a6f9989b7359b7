"""The dispatcher: which path runs a batch, and at which padded size (bucket).

Three paths, as in vLLM:

- FULL: a pure-decode batch (every sequence one new token) of n rows runs in the smallest
  FULL bucket B >= n, padded with B - n empty sequences. On CUDA that replays one captured
  graph of the whole forward, attention included.
  With speculative decoding (k guesses), a batch whose every sequence is a decode followed by
  its guesses (at most k; some may have none) is a verify batch: it runs in the smallest
  verify bucket of S >= n sequences, every sequence padded to k + 1 rows (guesses it lacks
  become rows that write no KV and are never sampled), S * (k + 1) rows in all, one graph
  per bucket as for decode (``Decision.query_len`` = k + 1).
- PIECEWISE: any other batch of T tokens runs in the smallest token bucket >= T, padded
  with T' - T rows that belong to no sequence. On CUDA every compiled piece replays its graph
  for T' and attention runs eagerly between the pieces.
- NONE: batches above the largest bucket (or graphs off) run the compiled forward unpadded
  (it serves any row count from one: compiled_forward.py traces size-oblivious; only while
  Dynamo's frame serves, the direct call declined, is a one-row batch padded to two).

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
    in tokens of any batch, ``verify`` in sequences of a verify batch of ``verify_query_len``
    rows each (none without speculation). ``verify_max_start``: the last position a verify
    batch's sequence may start at, so that its padded rows stay inside the context."""

    full: tuple[int, ...]
    piecewise: tuple[int, ...]
    verify: tuple[int, ...] = ()
    verify_query_len: int = 0
    verify_max_start: int = 0

    @staticmethod
    def smallest_at_least(sizes: Sequence[int], n: int) -> Optional[int]:
        i = bisect.bisect_left(sizes, n)
        return sizes[i] if i < len(sizes) else None


def capture_sizes(config: CompileConfig, max_num_seqs: int, max_num_batched_tokens: int,
                  verify: Optional["VerifyShape"] = None) -> Buckets:
    """The buckets for an engine: the configured (or default) sizes, capped by what the
    scheduler can produce. ``verify``: the speculative verify batches' shape (None: no
    speculation)."""
    wanted = config.cudagraph_capture_sizes
    if wanted is None:
        wanted = default_capture_sizes(config.max_capture_size)
    sizes = sorted({s for s in wanted if s <= max_num_batched_tokens})
    # Decode batches hold at most max_num_seqs rows: keep the first bucket that fits them all.
    full = _up_to_first_holding(sizes, max_num_seqs)
    if verify is None:
        return Buckets(full=tuple(full), piecewise=tuple(sizes))
    q = verify.query_len
    # Guesses stop above max_seqs sequences; a padded batch stays within the token budget.
    seqs = _up_to_first_holding(sorted({s for s in wanted if s * q <= max_num_batched_tokens}), verify.max_seqs)
    return Buckets(full=tuple(full), piecewise=tuple(sizes), verify=tuple(seqs), verify_query_len=q,
                   verify_max_start=verify.max_model_len - q)


def _up_to_first_holding(sizes: Sequence[int], n: int) -> list[int]:
    """``sizes`` up to the first that holds ``n`` (all of them if none does)."""
    first = Buckets.smallest_at_least(sizes, n)
    return [s for s in sizes if first is None or s <= first]


@dataclass(frozen=True)
class VerifyShape:
    """What the verify buckets depend on: k + 1 rows per sequence, the most sequences that
    speculate in one step, and the context length the padded rows must stay inside."""

    query_len: int
    max_seqs: int
    max_model_len: int


@dataclass(frozen=True)
class BatchShape:
    """What the dispatcher needs to know about a batch."""

    num_tokens: int
    num_seqs: int
    uniform_decode: bool  # every sequence has exactly one new token
    # Every sequence is one decode token and its speculative guesses (none, for some), and
    # its first row's position is at most ``max_start``; False and 0 when there are no guesses.
    verify: bool = False
    max_start: int = 0

    @classmethod
    def of_step(cls, step: "RunnerStep") -> "BatchShape":
        """From a step's chunks, before any tensor is built: the one place a batch is judged
        pure decode, or a verify batch."""
        lens = [c.num_new_tokens for c in step.chunks]
        uniform = bool(lens) and all(n == 1 for n in lens)
        verify = not uniform and bool(lens) and all(c.num_new_tokens == 1 + len(c.draft_token_ids)
                                                    for c in step.chunks)
        max_start = max(c.start_position for c in step.chunks) if verify else 0
        return cls(sum(lens), len(lens), uniform, verify, max_start)


@dataclass(frozen=True)
class Decision:
    path: Path
    bucket: int  # padded size in rows (a FULL decode batch: one row per sequence)
    num_tokens: int  # before padding
    query_len: int = 1  # rows per sequence of a FULL batch: k + 1 when it verifies guesses

    @property
    def padding(self) -> int:
        return self.bucket - self.num_tokens

    @property
    def rows_per_chunk(self) -> int:
        """Rows each sequence takes in the batch when they are fixed (a FULL verify batch),
        else 0: each chunk takes its own length."""
        return self.query_len if self.path is Path.FULL and self.query_len > 1 else 0


def choose(shape: BatchShape, buckets: Buckets, mode: CudaGraphMode, min_rows: int = 1) -> Decision:
    """FULL for a pure-decode batch that fits a decode bucket, or a verify batch that fits a
    verify bucket, else PIECEWISE when the token count fits a token bucket, else NONE at the
    batch's own size. ``min_rows``: the fewest rows the forward serves (two while Dynamo's
    frame serves it: ``LadderForward.min_rows``); a smaller batch is padded up to it."""
    n = shape.num_tokens
    rows = max(n, min_rows) if n else 0
    if n > 0 and shape.uniform_decode and mode.has_full:
        bucket = Buckets.smallest_at_least(buckets.full, rows)
        if bucket is not None:
            return Decision(Path.FULL, bucket, n)
    if n > 0 and shape.verify and mode.has_full and shape.max_start <= buckets.verify_max_start:
        seqs = Buckets.smallest_at_least(buckets.verify, shape.num_seqs)
        if seqs is not None:
            q = buckets.verify_query_len
            return Decision(Path.FULL, seqs * q, n, q)
    if n > 0 and mode.has_piecewise:
        bucket = Buckets.smallest_at_least(buckets.piecewise, rows)
        if bucket is not None:
            return Decision(Path.PIECEWISE, bucket, n)
    return Decision(Path.NONE, rows, n)
