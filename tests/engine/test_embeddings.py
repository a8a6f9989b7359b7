"""``LLM.embed``: the final norm's hidden states (what feeds lm_head), pooled "last" or
"mean", equal transformers' on the same checkpoint (fp32), L2-normalized by default, in
batches, through chunked prefill and preemption, mixed with generation in the same steps."""
from __future__ import annotations

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, PoolingParams, SamplingParams
from vgraph.config import CompileConfig

from .hf_oracle import hf_embedding as expected
from .hf_oracle import hf_greedy, random_prompts

TOL = 1e-5


def _llm(path: str, mode: str = "eager", **kw) -> LLM:
    # Pool sizes and prefix-cache hits below count 16-token blocks (the CPU default is larger).
    kw.setdefault("block_size", 16)
    kw.setdefault("num_gpu_blocks", 256)
    config = CompileConfig(level="none") if mode == "eager" else CompileConfig()
    return LLM(path, dtype="float32", device="cpu", compile_config=config, **kw)


def _close(got: list[float], want: torch.Tensor, tol: float = TOL) -> bool:
    return (torch.tensor(got) - want).abs().max().item() < tol


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_hidden_states(pooling):
    path = tiny_checkpoint(arch="qwen2")
    llm = _llm(path, pooling_type=pooling)
    prompts = random_prompts([1, 7, 16, 33, 90], llm.engine.vocab_size, seed=21)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.finished and out.prompt_token_ids == prompt
        assert len(out.outputs.embedding) == llm.engine.runner.model.hidden_size
        assert _close(out.outputs.embedding, expected(path, prompt, pooling))
        assert abs(torch.tensor(out.outputs.embedding).norm().item() - 1) < 1e-5, "L2-normalized by default"


def test_chunked_prefill_accumulates_both_poolings():
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, max_num_batched_tokens=16)
    prompts = random_prompts([15, 16, 17, 50], llm.engine.vocab_size, seed=22)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    for pooling in ("last", "mean"):
        outs = llm.embed(inputs, PoolingParams(pooling_type=pooling, normalize=False), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert _close(out.outputs.embedding, expected(path, prompt, pooling, normalize=False), 1e-4)
    pool = llm.engine.scheduler.kv_manager.pool
    assert pool.num_free_blocks == llm.engine.runner.num_blocks


def test_text_prompts_and_the_prefix_cache_is_skipped():
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path)
    text = "The quick brown fox jumps over the lazy dog. " * 4
    ids = llm.get_tokenizer().encode(text)
    llm.generate(text, SamplingParams(max_tokens=1), use_tqdm=False)  # fills the prefix cache
    hits = llm.engine.scheduler.kv_manager.pool.prefix_cache_hits
    out = llm.embed(text, use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == ids
    assert _close(out.outputs.embedding, expected(path, ids, "last"))
    assert llm.engine.scheduler.kv_manager.pool.prefix_cache_hits == hits


def test_embeddings_batch_with_generation_in_the_same_steps():
    """Pooling and generation requests share steps; each gets exactly what it would alone."""
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, pooling_type="mean", max_num_batched_tokens=24)
    engine = llm.engine
    gen_prompts = random_prompts([10, 30], engine.vocab_size, seed=23)
    emb_prompts = random_prompts([12, 40, 5], engine.vocab_size, seed=24)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(gen_prompts):
        llm.add_request(f"g{i}", {"prompt_token_ids": p}, greedy)
    for i, p in enumerate(emb_prompts):
        llm.add_request(f"e{i}", {"prompt_token_ids": p}, PoolingParams())
    finals, mixed_steps = {}, 0
    while llm.has_unfinished_requests():
        step = llm.step()
        kinds = {o.request_id[0] for o in step.outputs}
        mixed_steps += kinds == {"g", "e"}
        finals.update({o.request_id: o for o in step.outputs if o.finished})
    assert mixed_steps >= 1, "an embedding finished in a step that also generated"
    for i, p in enumerate(gen_prompts):
        assert finals[f"g{i}"].outputs[0].token_ids == hf_greedy(path, tuple(p), 6)[0]
    for i, p in enumerate(emb_prompts):
        assert _close(finals[f"e{i}"].outputs.embedding, expected(path, p, "mean"), 1e-4)


def test_preempted_pooling_request_is_not_counted_twice():
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, num_gpu_blocks=24, enable_prefix_caching=False, max_num_batched_tokens=32,
               pooling_type="mean")
    engine = llm.engine
    long_gen = random_prompts([100, 110], engine.vocab_size, seed=25)
    emb = random_prompts([150], engine.vocab_size, seed=26)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    for i, p in enumerate(long_gen):
        llm.add_request(f"g{i}", {"prompt_token_ids": p}, greedy)
    llm.add_request("e", {"prompt_token_ids": emb}, PoolingParams(normalize=False))
    pooled = engine._groups["e"].sequences[0]
    finals = {}
    while llm.has_unfinished_requests():
        finals.update({o.request_id: o for o in llm.step().outputs if o.finished})
    assert pooled.num_preemptions > 0, "the pooling request was preempted mid-prompt and recomputed"
    assert _close(finals["e"].outputs.embedding, expected(path, emb, "mean", normalize=False), 1e-4)
    for i, p in enumerate(long_gen):
        assert finals[f"g{i}"].outputs[0].token_ids == hf_greedy(path, tuple(p), 80)[0]


def test_compiled_embeddings():
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, "compiled")
    prompts = random_prompts([5, 40], llm.engine.vocab_size, seed=27)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert _close(out.outputs.embedding, expected(path, prompt, "last"))
    assert llm.engine.runner.compile_counters.recompiles == 0


def test_bad_pooling_input_is_a_value_error():
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(tiny_checkpoint(arch="llama"), device="cpu", enforce_eager=True, pooling_type="cls")
    llm = _llm(tiny_checkpoint(arch="llama"))
    with pytest.raises(ValueError, match="empty"):
        llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[1, 2], [10**6]], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_prompt_may_fill_the_whole_context_when_nothing_is_generated():
    """Embedding and max_tokens=0 scoring generate nothing, so a prompt of exactly
    max_model_len tokens fits; one token more is refused."""
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, max_model_len=64)
    prompt = random_prompts([64], llm.engine.vocab_size, seed=24)[0]
    out = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)[0]
    assert _close(out.outputs.embedding, expected(path, prompt, "last"))
    scored = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=0, prompt_logprobs=0),
                          use_tqdm=False)[0]
    assert len(scored.prompt_logprobs) == 64 and scored.outputs[0].token_ids == []
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens\. However, you requested 65 tokens "
                                         r"\(65 in the prompt, 0 in the completion\)"):
        llm.embed({"prompt_token_ids": prompt + [1]}, use_tqdm=False)
