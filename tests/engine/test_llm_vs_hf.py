"""The runtime is token-exact against Hugging Face transformers (fp32 greedy): eager and
compiled, with vgraph's custom ops or plain-torch layers, with continuous batching, chunked
prefill, prefix-cache hits and preemption."""
from __future__ import annotations

import pytest

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.config import CompileConfig

from .hf_oracle import hf_greedy, random_prompts

# block boundaries (16/32), one token, and up to 200 tokens
LENGTHS = [1, 5, 16, 17, 31, 32, 33, 64, 100, 200]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


MODES = {
    "eager": CompileConfig(level="none"),
    "compiled": CompileConfig(),  # on CPU: plain-torch norms and activations (custom_ops unset)
    "compiled-custom-ops": CompileConfig(custom_ops=True),
}


def _llm(path: str, mode: str = "compiled", **kw) -> LLM:
    # Pool sizes and prefix-cache hits below count 16-token blocks (the CPU default is larger).
    kw.setdefault("block_size", 16)
    kw.setdefault("num_gpu_blocks", 256)
    return LLM(path, dtype="float32", device="cpu", compile_config=MODES[mode], **kw)


def _check_equal_to_hf(path: str, llm: LLM, prompts: list[list[int]]) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected, _ = hf_greedy(path, tuple(prompt), NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert out.outputs[0].finish_reason == "length"


def _all_blocks_free(llm: LLM) -> bool:
    pool = llm.engine.scheduler.kv_manager.pool
    return pool.num_free_blocks == llm.engine.runner.num_blocks


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_equal_transformers(arch, mode):
    path = tiny_checkpoint(arch=arch)
    llm = _llm(path, mode)
    _check_equal_to_hf(path, llm, random_prompts(LENGTHS, llm.engine.vocab_size))
    assert _all_blocks_free(llm)
    if mode != "eager":
        assert llm.engine.runner.compile_counters.recompiles == 0


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_chunked_prefill_equals_transformers(mode):
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path, mode, max_num_batched_tokens=16)
    _check_equal_to_hf(path, llm, random_prompts(LENGTHS, llm.engine.vocab_size, seed=1))
    assert _all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_prefix_cache_hits_equal_transformers(mode):
    path = tiny_checkpoint(arch="qwen2")
    llm = _llm(path, mode)
    shared = random_prompts([100], llm.engine.vocab_size, seed=2)[0]
    tails = random_prompts([1, 7, 16, 40], llm.engine.vocab_size, seed=3)
    # the first request fills the cache; the rest hit it
    _check_equal_to_hf(path, llm, [shared + tails[0]])
    _check_equal_to_hf(path, llm, [shared + t for t in tails[1:]])
    pool = llm.engine.scheduler.kv_manager.pool
    assert pool.prefix_cache_hits >= 3 * 96, "the shared 100-token prefix should hit (6 full blocks)"
    assert _all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_preemption_equals_transformers(mode):
    path = tiny_checkpoint(arch="llama")
    # 8 requests need up to 8 * 15 blocks at the end; 40 blocks forces preemption by recompute
    llm = _llm(path, mode, num_gpu_blocks=40, enable_prefix_caching=False)
    _check_equal_to_hf(path, llm, random_prompts([60, 70, 80, 90, 100, 110, 120, 130],
                                                  llm.engine.vocab_size, seed=4))
    assert llm.engine.scheduler.num_preemptions > 0
    assert _all_blocks_free(llm)


def test_greedy_logprobs_match_transformers_log_softmax():
    path = tiny_checkpoint(arch="llama")
    llm = _llm(path)
    prompt = random_prompts([20], llm.engine.vocab_size, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    expected_tokens, expected_lp = hf_greedy(path, tuple(prompt), 8)
    assert out.token_ids == expected_tokens
    chosen = sum(lp[t] for lp, t in zip(out.logprobs, out.token_ids))
    assert out.cumulative_logprob == pytest.approx(chosen, abs=1e-6)
    for tok, lp, ref in zip(out.token_ids, out.logprobs, expected_lp):
        assert abs(lp[tok] - ref[tok].item()) < 1e-4
        top3 = set(ref.topk(3).indices.tolist())
        assert top3 <= set(lp), "the top-3 logprobs are reported"


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_blas_prefill_gemms_equal_transformers(mode, monkeypatch):
    """With every shape's prefill GEMM forced to BLAS (a kept unpacked weight), prompts past
    DENSE_MIN_ROWS take F.linear, decode the packed kernel: tokens still equal transformers."""
    monkeypatch.setenv("VGRAPH_CPU_PREFILL_GEMM", "blas")
    path = tiny_checkpoint(arch="qwen2")
    llm = _llm(path, mode)
    dense = [m for m in llm.engine.runner.model.modules() if getattr(m, "weight_dense", None) is not None]
    assert dense, "no projection kept its unpacked weight"
    _check_equal_to_hf(path, llm, random_prompts([5, 150, 200], llm.engine.vocab_size, seed=3))
