"""The one place a speculative config becomes a proposer.

The engine calls ``build_proposer`` once its target runner is up (a draft model's cache is
bounded by the target's) and hands the result to the scheduler, which sees only the
``Proposer`` interface (spec/proposer.py): ``core/`` never imports ``worker/``.
"""
from __future__ import annotations

from typing import Any, Optional

from ..config import EngineConfig
from .ngram import NgramProposer
from .proposer import Proposer


def build_proposer(config: EngineConfig, tokenizer: Any, vocab_size: int, target_blocks: int) -> Optional[Proposer]:
    """The proposer ``config.speculative_config`` names (None: no speculation). ``config`` is
    the target's resolved config; ``tokenizer``, ``vocab_size`` and ``target_blocks`` (its KV
    pool) are what a draft model is checked and sized against."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "draft_model":
        from .draft_model import build_draft_proposer  # loads a model: worker/ code, imported on use
        return build_draft_proposer(spec, config, tokenizer, vocab_size, target_blocks)
    raise ValueError(f"speculative method {spec.method!r} has no proposer")
