"""``speculative_config``: which proposer guesses tokens, and how many per step.

The field names are vLLM's (``method``, ``model``, ``num_speculative_tokens``,
``draft_tensor_parallel_size``, ``prompt_lookup_min``, ``prompt_lookup_max``,
``disable_by_batch_size``), so a vLLM ``--speculative-config`` JSON works as it is. Built here:
``ngram`` (prompt lookup) and ``draft_model`` (a smaller checkpoint with the target's
vocabulary). As in vLLM, a config that names a ``model`` and no ``method`` means a draft model.
EAGLE and the others are named, and refused with an error saying they are not built yet.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

METHODS = ("ngram", "draft_model")
NOT_BUILT = ("eagle", "eagle3", "mtp", "medusa")


@dataclass(frozen=True)
class SpeculativeConfig:
    # None: "draft_model" when ``model`` is given, else "ngram" (vLLM's shorthand); decided when built.
    method: Optional[str] = None
    num_speculative_tokens: int = 4
    model: Optional[str] = None  # draft_model: the draft checkpoint (a path, a hub id, or a demo name)
    # The draft runs unsharded in the engine's process: only 1 (or unset) is accepted.
    draft_tensor_parallel_size: Optional[int] = None
    prompt_lookup_min: int = 1  # the shortest suffix of the sequence that is looked up
    prompt_lookup_max: int = 4  # the longest (tried first: a longer match predicts better)
    # No proposals in a step with more running sequences than this: verification then costs
    # more than it saves (the batch is already compute-bound). None: always propose.
    disable_by_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method is None:  # normalized while the object is built, like EngineConfig's fields
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        if self.method in NOT_BUILT:
            raise ValueError(f"speculative method {self.method!r} is not built yet in vgraph; "
                             f"built: {', '.join(METHODS)}")
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")
        self._check_draft_fields()

    def _check_draft_fields(self) -> None:
        """A draft model needs its checkpoint; the other methods take none (a ``model`` there is
        a mistake worth naming, not something to ignore)."""
        if self.method == "draft_model":
            if not self.model:
                raise ValueError('speculative method "draft_model" needs "model": the draft checkpoint')
            if self.draft_tensor_parallel_size not in (None, 1):
                raise ValueError(f"draft_tensor_parallel_size {self.draft_tensor_parallel_size} is not supported: "
                                 "the draft model runs unsharded in the engine's process (use 1)")
        elif self.model is not None or self.draft_tensor_parallel_size is not None:
            raise ValueError(f'"model" and "draft_tensor_parallel_size" belong to method "draft_model", '
                             f"not {self.method!r}")

    @classmethod
    def parse(cls, value: Union[None, str, dict[str, Any], "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """``LLM(speculative_config={...})`` or ``--speculative-config '{...}'`` (JSON)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        if value.get("method") in NOT_BUILT:  # before its own fields (an EAGLE head's) are judged
            cls(method=value["method"])
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)

    def describe(self) -> str:
        """The startup log's words for the proposer and k."""
        if self.method == "draft_model":
            how = f"draft_model {self.model}, k={self.num_speculative_tokens}"
        else:
            how = (f"ngram, k={self.num_speculative_tokens}, lookup {self.prompt_lookup_min}.."
                   f"{self.prompt_lookup_max} tokens")
        return how + (f", off above {self.disable_by_batch_size} sequences" if self.disable_by_batch_size else "")
