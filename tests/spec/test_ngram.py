"""The prompt-lookup proposer and the speculative config's parsing."""
from __future__ import annotations

import pytest

from vgraph.config import EngineConfig
from vgraph.spec.config import SpeculativeConfig
from vgraph.spec.ngram import NgramProposer


def _proposer(k=4, lo=1, hi=3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_the_longest_suffix_match_proposes_what_followed_it():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 1, 2, 3, 4]
    # The suffix [2, 3, 4] occurs twice before; the latest (followed by 7, 1) wins.
    assert _proposer().propose(tokens, 10) == [7, 1, 2, 3]
    assert _proposer(k=2).propose(tokens, 10) == [7, 1]
    assert _proposer().propose(tokens, 1) == [7], "the limit caps the guesses"
    assert _proposer().propose(tokens, 0) == []


def test_no_match_or_too_short_proposes_nothing():
    assert _proposer().propose([1, 2, 3, 4], 4) == []
    assert _proposer().propose([5], 4) == []
    assert _proposer(lo=2, hi=2).propose([1, 2, 9, 2], 4) == [], "one matching token is below the minimum"
    assert _proposer(lo=1, hi=2).propose([1, 2, 9, 2], 4) == [9, 2]


def test_config_takes_vllm_json_and_refuses_what_is_not_built():
    config = EngineConfig.from_kwargs("m", speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                               '"prompt_lookup_max": 5}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
    with pytest.raises(ValueError, match="not built yet"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "x"})
    with pytest.raises(ValueError, match="unknown field"):
        SpeculativeConfig.parse({"method": "ngram", "bogus": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
