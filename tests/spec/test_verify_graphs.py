"""Verify batches on the FULL path: a step whose every sequence is a decode and its guesses
runs as one FULL bucket of S sequences x (k + 1) rows (guesses a sequence lacks padded), as
on a GPU one captured graph per bucket. On CPU the same decisions and padding run compiled
(vgraph/worker/dispatch.py); greedy tokens must equal the plain engine's, with and without the
overlapped loop, and the verify buckets must really be taken."""
from __future__ import annotations

import pytest

from tests.checkpoints import tiny_checkpoint
from tests.compiler.graph_scenarios import logprobs_close
from vgraph import LLM, SamplingParams
from vgraph.config import CompileConfig
from vgraph.worker.dispatch import Path

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPEATING = ["a b c d a b c d a b c d a b", "one two three one two three one two", "x y x y x y x y x y",
             "the cat sat on the mat and the cat sat on the"]
GRAPHS = CompileConfig(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32])


def _llm(spec: bool, **kwargs) -> LLM:
    return LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", seed=0, num_gpu_blocks=64,
               block_size=16, max_num_batched_tokens=64, max_model_len=160, compile_config=GRAPHS,
               speculative_config=SPEC if spec else None, **kwargs)


def _outputs(llm: LLM, prompts, params) -> list:
    return [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def _assert_same(got: list, want: list) -> None:
    """Tokens and finish reasons equal; logprobs to 1e-5: a padded bucket runs the matrix
    products at another row count, which moves fp32 results by an ulp or so."""
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in want]
    for g, w in zip(got, want):
        assert logprobs_close(g.logprobs, w.logprobs, 1e-5)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _llm(False)


@pytest.mark.parametrize("overlap", [False, True])
def test_verify_buckets_run_and_tokens_equal_the_plain_engine(plain, overlap):
    spec = _llm(True, async_scheduling=overlap)
    buckets = spec.engine.runner.graphs.buckets
    assert buckets.verify == (1, 2, 4, 8) and buckets.verify_query_len == 5, "8 x 5 rows fill the 64-token budget"
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
              SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)]
    for prompts in (REPEATING[:1], REPEATING):
        counts = spec.engine.runner.graphs.dispatch_counts
        counts.clear()
        _assert_same(_outputs(spec, prompts, params[:len(prompts)]), _outputs(plain, prompts, params[:len(prompts)]))
        verify = {bucket for (path, bucket) in counts if path is Path.FULL and bucket % 5 == 0 and bucket >= 5}
        assert verify, f"no verify bucket was taken: {dict(counts)}"
    assert spec.engine.stats().spec_num_accepted_tokens > 0
    pool = spec.engine.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
