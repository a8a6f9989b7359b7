"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal transformers' log-softmax over
the same prompt (fp32, 1e-4), in every way a prompt can be computed: eager and compiled,
chunked prefill, a prompt whose prefix is in the prefix cache, preemption by recompute, n > 1,
and prefill-only requests (``max_tokens=0``)."""
from __future__ import annotations

import pytest

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.config import CompileConfig

from .hf_oracle import hf_greedy, hf_prompt_logprobs, random_prompts

TOL = 1e-4


def _llm(path: str, mode: str = "eager", **kw) -> LLM:
    # Pool sizes and prefix-cache hits below count 16-token blocks (the CPU default is larger).
    kw.setdefault("block_size", 16)
    kw.setdefault("num_gpu_blocks", 256)
    config = CompileConfig(level="none") if mode == "eager" else CompileConfig()
    return LLM(path, dtype="float32", device="cpu", compile_config=config, **kw)


def _check(path: str, prompt: list[int], scored: list, top_n: int) -> None:
    """vgraph's prompt logprobs against the oracle: shape, values, and the top-n reported."""
    ref = hf_prompt_logprobs(path, tuple(prompt))
    assert len(scored) == len(prompt) and scored[0] is None
    for j in range(1, len(prompt)):
        entry, row = scored[j], ref[j - 1]
        assert next(iter(entry)) == prompt[j], "the prompt token comes first"
        assert abs(entry[prompt[j]] - row[prompt[j]].item()) < TOL, f"token {j}"
        top = row.topk(top_n).indices.tolist() if top_n else []
        assert set(top) <= set(entry) and len(entry) <= top_n + 1
        for t in top:
            assert abs(entry[t] - row[t].item()) < TOL


def _all_blocks_free(llm: LLM) -> bool:
    return llm.engine.scheduler.kv_manager.pool.num_free_blocks == llm.engine.runner.num_blocks


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_prompt_logprobs_equal_transformers(mode):
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, mode)
    prompts = random_prompts([1, 2, 17, 33, 100], llm.engine.vocab_size, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        _check(path, prompt, out.prompt_logprobs, 3)
        assert out.outputs[0].token_ids == hf_greedy(path, tuple(prompt), 4)[0], "generation is unchanged"
    assert _all_blocks_free(llm)
    if mode == "compiled":
        assert llm.engine.runner.compile_counters.recompiles == 0


def test_only_requests_that_ask_get_prompt_logprobs():
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path)
    prompts = random_prompts([20, 30], llm.engine.vocab_size, seed=12)
    asked = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [asked, plain], use_tqdm=False)
    _check(path, prompts[0], outs[0].prompt_logprobs, 0)
    assert all(len(e) == 1 for e in outs[0].prompt_logprobs[1:]), "0 = only the prompt token itself"
    assert outs[1].prompt_logprobs is None


def test_chunked_prefill_keeps_each_chunks_last_row():
    """16-token chunks: the last row of a chunk scores the next chunk's first token."""
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, max_num_batched_tokens=16)
    prompts = random_prompts([15, 16, 17, 40, 64], llm.engine.vocab_size, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        _check(path, prompt, out.prompt_logprobs, 2)
    assert _all_blocks_free(llm)


def test_prefix_cached_prompt_recomputes_what_it_needs():
    path = tiny_checkpoint(arch="qwen2")
    llm = _llm(path)
    shared = random_prompts([64], llm.engine.vocab_size, seed=14)[0]
    tail = random_prompts([9], llm.engine.vocab_size, seed=15)[0]
    llm.generate({"prompt_token_ids": shared + [5]}, SamplingParams(max_tokens=1), use_tqdm=False)
    pool = llm.engine.scheduler.kv_manager.pool
    hits = pool.prefix_cache_hits
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": shared + tail}, params, use_tqdm=False)[0]
    _check(path, shared + tail, out.prompt_logprobs, 1)
    assert out.num_cached_tokens == 0 and pool.prefix_cache_hits == hits, "the cached prefix is recomputed"
    # A plain request still hits the prefix cache: the scored prompt published its blocks too.
    again = llm.generate({"prompt_token_ids": shared + tail}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 64


def test_preemption_neither_duplicates_nor_loses_entries():
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, num_gpu_blocks=40, enable_prefix_caching=False, max_num_batched_tokens=48)
    prompts = random_prompts([60, 70, 80, 90, 100, 110], llm.engine.vocab_size, seed=16)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(path, prompt, out.prompt_logprobs, 1)
        assert out.outputs[0].token_ids == hf_greedy(path, tuple(prompt), 40)[0]
    assert _all_blocks_free(llm)


def test_n_greater_than_one_scores_the_prompt_once():
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path)
    prompt = random_prompts([25], llm.engine.vocab_size, seed=17)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=2, prompt_logprobs=2)
    llm.add_request("r", {"prompt_token_ids": prompt}, params)
    sequences = llm.engine._groups["r"].sequences
    assert [s.num_prompt_logprobs for s in sequences] == [2, None, None]
    final = None
    while llm.has_unfinished_requests():
        for out in llm.step().outputs:
            final = out
    assert final.finished and len(final.outputs) == 3
    _check(path, prompt, final.prompt_logprobs, 2)


def test_max_tokens_zero_is_prefill_only():
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, max_num_batched_tokens=16)
    prompts = random_prompts([3, 40], llm.engine.vocab_size, seed=18)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=0, prompt_logprobs=0), SamplingParams(max_tokens=0)],
                        use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert out.finished and c.finish_reason == "length" and c.token_ids == [] and c.text == ""
    _check(path, prompts[0], outs[0].prompt_logprobs, 0)
    assert outs[1].prompt_logprobs is None
    assert _all_blocks_free(llm)


def test_prompt_logprobs_are_validated_like_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="max_tokens must be non-negative"):
        SamplingParams(max_tokens=-1)
    llm = _llm(tiny_checkpoint(arch="llama"), max_logprobs=4)
    with pytest.raises(ValueError, match="prompt_logprobs=5 exceeds the maximum of 4"):
        llm.generate("hello", SamplingParams(prompt_logprobs=5), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
