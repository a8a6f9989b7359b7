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
    assert _proposer().lookup(tokens, 10) == [7, 1, 2, 3]
    assert _proposer(k=2).lookup(tokens, 10) == [7, 1]
    assert _proposer().lookup(tokens, 1) == [7], "the limit caps the guesses"
    assert _proposer().lookup(tokens, 0) == []


def test_no_match_or_too_short_proposes_nothing():
    assert _proposer().lookup([1, 2, 3, 4], 4) == []
    assert _proposer().lookup([5], 4) == []
    assert _proposer(lo=2, hi=2).lookup([1, 2, 9, 2], 4) == [], "one matching token is below the minimum"
    assert _proposer(lo=1, hi=2).lookup([1, 2, 9, 2], 4) == [9, 2]


def test_config_takes_vllm_json_and_refuses_what_is_not_built():
    config = EngineConfig.from_kwargs("m", speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                               '"prompt_lookup_max": 5}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
    with pytest.raises(ValueError, match="not built yet"):
        SpeculativeConfig.parse({"method": "eagle", "model": "x"})
    with pytest.raises(ValueError, match="unknown field"):
        SpeculativeConfig.parse({"method": "ngram", "bogus": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)


def test_rejection_sampling_keeps_the_target_distribution():
    """A row verifying a guessed token ends with a token distributed as the target's own
    (temperature, top-k applied): the guess kept with probability p(guess), else a draw from p
    without it. 40,000 rows, each verifying the same guess; the empirical distribution is
    within 0.01 of p everywhere, for a likely guess and an unlikely one."""
    import torch

    from vgraph.sampling_params import SamplingParams
    from vgraph.worker.runner_requests import RunnerRequest
    from vgraph.worker.sampler import SamplingMetadata, sample_random

    torch.manual_seed(0)
    vocab, rows = 12, 40_000
    logits = torch.randn(vocab) * 1.5
    request = RunnerRequest("r", [1, 2], SamplingParams(temperature=0.7, top_k=8))
    md = SamplingMetadata.from_requests([request] * rows, vocab)
    target = torch.zeros(vocab)
    kept = (logits / 0.7).topk(8).indices
    target[kept] = (logits / 0.7)[kept].softmax(-1)
    for guess in (int(target.argmax()), int(kept[-1])):
        tokens = sample_random(logits.repeat(rows, 1), md, torch.full((rows,), guess))
        empirical = torch.bincount(tokens, minlength=vocab).float() / rows
        assert (empirical - target).abs().max() < 0.01, (guess, empirical, target)
