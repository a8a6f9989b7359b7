"""Which requests speculate, and how well the guesses do (``/metrics`` and the offline stats)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.request import Request


def speculates(request: "Request") -> bool:
    """Whether ``request``'s guesses can be verified exactly here: greedy (the guess kept when it
    is the argmax) or sampled (rejection sampling: worker/sampler.py), with a next token that
    depends on nothing but the logits (no logprobs to report per guess, no penalties counting
    the guesses, no grammar, no min_tokens still banning EOS). Other requests decode one token
    per step in the same batches."""
    params = request.sampling_params
    return (params.logprobs is None and request.grammar is None and request.pooling is None
            and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and len(request.output_token_ids) >= params.min_tokens)


@dataclass
class SpecDecodeStats:
    """Totals since the engine started (vLLM's ``spec_decode`` counters)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # chunks that carried guesses
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: accepted at guess position i

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: the accepted guesses plus the step's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
