"""The batch's allowed-token masks: filled on the host by llguidance, applied in the sampler.

A mask is one bit per vocabulary id, packed in int32 words (``[rows, ceil(V / 32)]``), one row
per constrained sequence of the step. The runner fills it before the forward, so on a GPU the
host computes it while the model runs; the sampler unpacks it and sets the disallowed logits of
the constrained rows to -inf in one batched op, before penalties, temperature and truncation,
so greedy and sampled rows both obey it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .matcher import GrammarState

_executor: Any = None
_executor_lock = threading.Lock()


def _llg_executor() -> Any:
    global _executor
    with _executor_lock:
        if _executor is None:
            from .compiler import import_llguidance

            _executor = import_llguidance().LLExecutor()
        return _executor


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass
class GrammarMasks:
    """Which rows of the sampled batch are constrained, and their packed masks (host int32)."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), words(V)] int32


def fill_masks(grammars: Sequence[Optional[GrammarState]], vocab_size: int) -> Optional[GrammarMasks]:
    """The masks of the rows whose sequence has a grammar; None when no row has one.

    Several rows are filled in parallel by llguidance's executor (it releases the GIL). A failed
    matcher (the scheduler ends its sequence, so this is only a guard) allows only EOS.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    bitmask = torch.zeros(len(rows), words(vocab_size), dtype=torch.int32)
    live = []
    for slot, row in enumerate(rows):
        state = grammars[row]
        assert state is not None
        if state.usable:
            live.append((state.matcher, slot))
        else:
            _allow_only(bitmask[slot], state.eos_token_ids)
    row_bytes = bitmask.shape[1] * 4
    if len(live) == 1:
        matcher, slot = live[0]
        matcher.unsafe_compute_mask_ptr(bitmask[slot].data_ptr(), row_bytes)
    elif live:
        _llg_executor().unsafe_compute_mask_ptr(live, bitmask.data_ptr(), row_bytes, len(rows))
    return GrammarMasks(rows, bitmask)


def _allow_only(row: torch.Tensor, token_ids: frozenset[int]) -> None:
    row.zero_()
    for t in token_ids:
        if t < row.numel() * 32:
            word, bit = divmod(t, 32)
            value = int(row[word]) | (1 << bit)
            row[word] = value - (1 << 32) if value >= 1 << 31 else value


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 words -> [G, V] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with the disallowed tokens of ``rows`` (distinct, ascending) at -inf: a new
    tensor, ``logits`` is left alone, since the caller may still read it for raw logprobs."""
    allowed = unpack(bitmask, logits.shape[-1])
    if rows.shape[0] == logits.shape[0]:  # every row constrained (rows are distinct): no gather
        return logits.masked_fill(~allowed, float("-inf"))
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)
