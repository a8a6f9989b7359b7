"""Speculative decoding end to end: with n-gram guesses, greedy outputs equal the plain engine's
token for token (EOS, stop tokens and stop strings inside an accepted run, max_tokens and the
context's end, n > 1, preemption, requests that cannot speculate in the same batches, the
overlapped loop), and the acceptance counters add up."""
from __future__ import annotations

import pytest

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.structured.params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPEATING = ["a b c d a b c d a b c d a b", "one two three one two three one two", "x y x y x y x y x y"]


def _llm(spec: bool, **kwargs) -> LLM:
    kwargs = {"num_gpu_blocks": 12, "block_size": 16, "max_num_batched_tokens": 64, "max_model_len": 160,
              **kwargs}
    return LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", seed=0,
               speculative_config=SPEC if spec else None, **kwargs)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _llm(False)


@pytest.fixture(scope="module")
def spec() -> LLM:
    return _llm(True)


def _tokens(llm: LLM, prompts, params) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_outputs_equal_without_speculation(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = spec.engine.stats()
    assert _tokens(spec, REPEATING, params) == _tokens(plain, REPEATING, params)
    after = spec.engine.stats()
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens, "the guesses do get accepted"
    assert after.spec_num_draft_tokens >= after.spec_num_accepted_tokens
    assert sum(after.spec_accepted_per_position) == after.spec_num_accepted_tokens
    assert list(after.spec_accepted_per_position) == sorted(after.spec_accepted_per_position, reverse=True)


def test_stops_inside_an_accepted_run(plain, spec):
    """Reference tokens first; then each stop token / stop string / max_tokens placed inside the
    run: the speculating engine stops exactly where the plain one does."""
    free = _tokens(plain, REPEATING[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0][0]
    ids, text = free[0], free[1]
    cases = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[9]]),
             SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[text[12:15]]),
             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=5),
             SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)]  # to the context's end (160)
    for params in cases:
        assert _tokens(spec, REPEATING[:1], params) == _tokens(plain, REPEATING[:1], params), params


def test_mixed_batches_with_requests_that_do_not_speculate(plain, spec):
    """Logprobs, penalties and a grammar decode one token per step beside the speculating
    requests, with their own outputs unchanged; n > 1 greedy too. A seeded sampled request
    speculates (rejection sampling): its draws then follow another order, so it is
    reproducible run to run, not equal to the plain engine's (as in vLLM)."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(
                  choice=["a b c", "one two"])),
              SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)]
    prompts = (REPEATING * 2)[:len(params)]
    assert _tokens(spec, prompts, params) == _tokens(plain, prompts, params)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    assert _tokens(spec, REPEATING, seeded) == _tokens(spec, REPEATING, seeded)


def test_preemption_and_the_overlapped_loop():
    """A KV cache too small for the batch preempts verifying requests; the overlapped loop
    never schedules a verifying request ahead. Both equal the plain serial engine."""
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    prompts = [p + " " + str(i) for i in range(3) for p in REPEATING]
    reference = _tokens(_llm(False, num_gpu_blocks=8), prompts, params)
    for overlap in (False, True):
        llm = _llm(True, num_gpu_blocks=8, async_scheduling=overlap)
        assert _tokens(llm, prompts, params) == reference, f"overlap={overlap}"
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.stats().spec_num_accepted_tokens > 0
        pool = llm.engine.scheduler.block_pool
        assert pool.num_free_blocks == pool.num_blocks


def test_disable_by_batch_size_turns_guesses_off(plain):
    off = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=32, block_size=16,
              speculative_config={**SPEC, "disable_by_batch_size": 2})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert _tokens(off, REPEATING, params) == _tokens(plain, REPEATING, params)
    assert off.engine.stats().spec_num_drafts == 0, "three running sequences are above the limit"
    assert _tokens(off, REPEATING[:2], params) == _tokens(plain, REPEATING[:2], params)
    assert off.engine.stats().spec_num_drafts > 0, "two are not"


def test_tensor_parallel_ranks_verify_alike(plain):
    """Every rank runs the verify step on the same plan and accepts the same guesses."""
    tp2 = _llm(True, tensor_parallel_size=2, enforce_eager=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        assert _tokens(tp2, REPEATING, params) == _tokens(plain, REPEATING, params)
        assert tp2.engine.stats().spec_num_accepted_tokens > 0
    finally:
        tp2.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_families_greedy_equal(arch):
    """The other families' greedy tokens with guesses equal theirs without (eager: the compiled
    path is covered on llama above)."""
    def run(spec: bool) -> list:
        llm = LLM(tiny_checkpoint(arch=arch), dtype="float32", device="cpu", enforce_eager=True, num_gpu_blocks=32,
                  block_size=16, speculative_config=SPEC if spec else None)
        out = _tokens(llm, REPEATING, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        return out, llm.engine.stats().spec_num_accepted_tokens
    (plain, _), (spec, accepted) = run(False), run(True)
    assert spec == plain and accepted > 0
