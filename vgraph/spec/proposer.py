"""The proposer interface: what the scheduler asks of every way of guessing tokens.

Each step the scheduler hands the proposer the requests that may speculate, all at once (a
model-based proposer runs them as one batch per forward), and tells it when a request leaves
(finished, aborted or preempted) so that per-request state (a draft model's KV blocks) is
freed. n-gram lookup, the draft model and a later EAGLE head all fit this shape; which one
runs is decided in one place, ``vgraph/spec/proposers.py``.

This module imports nothing from ``worker/``: the scheduler (``core/``) depends on it, and the
engine builds the proposer, model and all, and hands it over.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from .config import SpeculativeConfig


@dataclass(frozen=True)
class ProposalRequest:
    """One request that may speculate this step: its tokens so far (prompt and output, all
    known on the host) and how many guesses it has room for (1 or more)."""

    request_id: str
    token_ids: list[int]
    room: int


class Proposer(ABC):
    """Guesses up to ``config.num_speculative_tokens`` tokens per request per step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    @abstractmethod
    def propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        """The guesses for each request of ``batch``, in order: at most ``min(k, room)`` each,
        possibly none."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """``request_id`` left the running set (finished, aborted, preempted): drop its state.
        Unknown ids are ignored."""
