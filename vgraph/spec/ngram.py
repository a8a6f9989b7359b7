"""Prompt-lookup (n-gram) proposals: find the sequence's last n tokens earlier in the sequence
(prompt and output), and guess that what followed them there follows again.

It costs no model: code edits, summaries and chats that quote their input repeat long runs,
and there a match predicts several tokens at once. Longer suffixes are tried first (a longer
context predicts better); the most recent earlier occurrence wins.
"""
from __future__ import annotations

from .config import SpeculativeConfig
from .proposer import ProposalRequest, Proposer


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch: list[ProposalRequest]) -> list[list[int]]:
        return [self.lookup(r.token_ids, r.room) for r in batch]

    def forget(self, request_id: str) -> None:
        """Nothing to drop: every lookup reads the request's tokens afresh."""

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` tokens guessed to follow ``tokens`` (none without a match)."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = tokens[size - n:]
            start = _last_occurrence(tokens, suffix, size - n)
            if start >= 0:
                follow = start + n
                return tokens[follow:follow + limit]
        return []


def _last_occurrence(tokens: list[int], pattern: list[int], end: int) -> int:
    """Start of the last occurrence of ``pattern`` beginning before ``end``, or -1."""
    n, first = len(pattern), pattern[0]
    for start in range(end - 1, -1, -1):
        if tokens[start] == first and tokens[start:start + n] == pattern:
            return start
    return -1
