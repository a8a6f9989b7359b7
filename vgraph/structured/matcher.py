"""``GrammarState``: one sequence's position in its grammar.

Each sequence (every one of an ``n > 1`` request too) has its own llguidance matcher. The
scheduler calls ``advance`` with the sequence's output tokens whenever one is appended; the
matcher consumes only those it has not seen, so a preempted request whose prompt and output are
recomputed as a prefill never advances it twice.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger("vgraph")


class GrammarState:
    def __init__(self, matcher: Any, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.num_accepted = 0
        self.ended = False  # an EOS token was accepted: the grammar is complete and closed
        self.error: Optional[str] = None

    def advance(self, output_token_ids: list[int]) -> None:
        """Consumes the output tokens not consumed yet."""
        for token in output_token_ids[self.num_accepted:]:
            self.num_accepted += 1
            if self.error is not None or self.ended:
                continue
            if not self.matcher.consume_token(token):
                self.error = self.matcher.get_error() or f"token {token} rejected"
                logger.error("a structured-output sequence produced a token its grammar rejects: %s",
                             self.error.splitlines()[0])
            elif token in self.eos_token_ids:
                self.ended = True

    @property
    def usable(self) -> bool:
        """Whether the matcher can compute a mask (not failed)."""
        return self.error is None
