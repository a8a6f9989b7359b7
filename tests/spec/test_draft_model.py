"""Draft-model speculation end to end: greedy outputs equal the plain engine's token for token
(several prompts, n > 1, stops and max_tokens inside an accepted run, preemption, aborts, the
overlapped loop), with the target itself as draft (every guess kept) and with a noisy copy of
it (guesses kept and rejected, so the draft's cache is rolled back); the draft's blocks all
come back; a draft with another vocabulary is refused at startup."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import process_tmp_dir, tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.models.demo import build_tiny_checkpoint
from vgraph.spec.config import SpeculativeConfig

PROMPTS = ["a b c d a b c d a b c d a b", "one two three one two three one two", "x y x y x y x y x y",
           "the quick brown fox"]
BASE = {"num_gpu_blocks": 12, "block_size": 16, "max_num_batched_tokens": 64, "max_model_len": 160}


def _noisy_copy(scale: float) -> str:
    """The tiny target with noise on its weights: a draft that agrees with it often, not always."""
    out = Path(process_tmp_dir()) / f"tiny-llama-noisy-{scale}"
    if not out.exists():
        shutil.copytree(tiny_checkpoint(arch="llama"), out)
        weights = out / "model.safetensors"
        gen = torch.Generator().manual_seed(0)
        noisy = {k: v + scale * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v
                 for k, v in load_file(weights).items()}
        save_file(noisy, weights, metadata={"format": "pt"})
    return str(out)


def _llm(draft: str | None, k: int = 3, **kwargs) -> LLM:
    spec = None if draft is None else {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", seed=0, speculative_config=spec,
               **{**BASE, **kwargs})


def _tokens(llm: LLM, prompts, params) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_draft_empty(llm: LLM) -> None:
    proposer = llm.engine.scheduler.proposer
    assert proposer.sequences == {}
    assert len(proposer.blocks.free) == proposer.blocks.num_blocks, "every draft block came back"


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _llm(None)


@pytest.fixture(scope="module")
def itself() -> LLM:
    return _llm(tiny_checkpoint(arch="llama"))


@pytest.fixture(scope="module")
def noisy() -> LLM:
    return _llm(_noisy_copy(0.5))


def test_config_fields_and_vllm_shorthand():
    assert SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse('{"method": "draft_model", "model": "d", "draft_tensor_parallel_size": 1}')
    with pytest.raises(ValueError, match="needs \"model\""):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 2 is not supported"):
        SpeculativeConfig.parse({"model": "d", "draft_tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="belong to method \"draft_model\""):
        SpeculativeConfig.parse({"method": "ngram", "model": "d"})
    assert SpeculativeConfig(model="d", num_speculative_tokens=5).describe() == "draft_model d, k=5"


def _greedy_equal_counting(spec, plain, max_tokens: int) -> tuple[int, int]:
    """Greedy outputs of ``spec`` equal ``plain``'s; (guessed, accepted) tokens in the run."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = spec.engine.stats()
    assert _tokens(spec, PROMPTS, params) == _tokens(plain, PROMPTS, params)
    after = spec.engine.stats()
    _assert_draft_empty(spec)
    return (after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            after.spec_num_accepted_tokens - before.spec_num_accepted_tokens)


def test_the_target_as_its_own_draft_keeps_every_guess(plain, itself):
    guessed, accepted = _greedy_equal_counting(itself, plain, 40)
    assert guessed > 0 and accepted == guessed, "the target agrees with itself"


def test_a_draft_that_is_sometimes_wrong(plain, noisy):
    """Guesses kept and rejected: the draft's cache keeps the common prefix and recomputes the rest."""
    guessed, accepted = _greedy_equal_counting(noisy, plain, 48)
    assert 0 < accepted < guessed, (accepted, guessed)


def test_n_and_stops_inside_an_accepted_run(plain, itself, noisy):
    free = _tokens(plain, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0][0]
    ids, text = free[0], free[1]
    cases = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[9]]),
             SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[text[12:15]]),
             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),  # to the context's end (160)
             SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)]
    for params in cases:
        expected = _tokens(plain, PROMPTS[:2], params)
        assert _tokens(itself, PROMPTS[:2], params) == expected, params
        assert _tokens(noisy, PROMPTS[:2], params) == expected, params
    _assert_draft_empty(itself)
    _assert_draft_empty(noisy)


def test_preemption_aborts_and_the_overlapped_loop():
    """A target KV cache too small for the batch preempts (the draft forgets and later catches
    up again); aborts free the draft's blocks; the overlapped loop gives the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    prompts = [p + " " + str(i) for i in range(2) for p in PROMPTS]
    reference = _tokens(_llm(None, num_gpu_blocks=8), prompts, params)
    for overlap in (False, True):
        llm = _llm(_noisy_copy(0.5), num_gpu_blocks=8, async_scheduling=overlap)
        assert _tokens(llm, prompts, params) == reference, f"overlap={overlap}"
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.stats().spec_num_accepted_tokens > 0
        _assert_draft_empty(llm)
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"abort-{i}", prompt, params)
        for _ in range(4):
            engine.step()
        assert engine.scheduler.proposer.sequences, "the draft holds the running requests' tokens"
        engine.abort_all()
        while engine.has_unfinished_requests():
            engine.step()
        _assert_draft_empty(llm)


def test_startup_log_names_the_proposer_and_k(caplog):
    with caplog.at_level(logging.INFO, logger="vgraph"):
        _llm(tiny_checkpoint(arch="llama"), k=2)
    assert any(f"speculative decoding: draft_model {tiny_checkpoint(arch='llama')}, k=2" in r.getMessage()
               for r in caplog.records)


def test_a_draft_with_another_vocabulary_is_refused():
    root = Path(process_tmp_dir())
    wider = build_tiny_checkpoint(root / "tiny-llama-wider-vocab", "llama", seed=0, vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        _llm(wider)
    swapped = root / "tiny-llama-swapped-tokenizer"
    if not swapped.exists():
        shutil.copytree(tiny_checkpoint(arch="llama"), swapped)
        data = json.loads((swapped / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        first, second = list(vocab)[40:42]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        (swapped / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="different tokenizer"):
        _llm(str(swapped))


def test_the_scheduler_imports_no_worker_code():
    """core/ sees the proposer interface only: the engine builds the draft model and hands it over."""
    code = ("import sys, vgraph.core.scheduler; "
            "print([m for m in sys.modules if m.startswith(('vgraph.worker', 'vgraph.spec.draft_model'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_tensor_parallel_target_with_a_draft_in_the_engine_process(plain):
    """The ranks verify; the draft runs once, unsharded, in the engine's process."""
    tp2 = _llm(_noisy_copy(0.5), tensor_parallel_size=2, enforce_eager=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        assert _tokens(tp2, PROMPTS, params) == _tokens(plain, PROMPTS, params)
        assert tp2.engine.stats().spec_num_accepted_tokens > 0
        _assert_draft_empty(tp2)
    finally:
        tp2.close()


def test_catch_up_longer_than_the_step_budget(plain, noisy):
    """Prompts longer than max_num_batched_tokens (64): the draft's first catch-up is split over
    several forwards, packed with the other requests' chunks."""
    long = [" ".join(PROMPTS) * 2, " ".join(reversed(PROMPTS)) * 2]
    assert all(len(plain.get_tokenizer()(p).input_ids) > 64 for p in long)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _tokens(noisy, long + PROMPTS[:1], params) == _tokens(plain, long + PROMPTS[:1], params)
    _assert_draft_empty(noisy)
