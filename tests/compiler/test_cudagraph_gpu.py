"""CUDA graphs on a GPU: graph counts per mode, replay vs the eager forward, greedy runs
with graphs vs without (tokens in fp32; logprobs within a tolerance in bf16, where padding
changes the GEMM's row count and cuBLAS may pick another kernel), persistent buffers, and
capture at the default memory setting. Skipped without CUDA; the same logic runs on CPU with
emulated graphs in test_cudagraph_emulated.py, this file's replay scenario included
(graph_scenarios.py holds it and this file's engine configuration)."""
from __future__ import annotations

import functools

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.engine.hf_oracle import hf_greedy
from vgraph import LLM, SamplingParams
from vgraph.config import CudaGraphMode
from vgraph.engine.outputs import CompletionOutput
from vgraph.worker.dispatch import Path

from .graph_scenarios import (GPU_NEW_PROMPT, GPU_SIZES, assert_logprobs_close, gpu_llm_kwargs, gpu_prompts,
                              replay_equals_eager)
from .test_cudagraph_emulated import _buffer_pointers, _piece_token_counts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = GPU_SIZES
BATCH_SIZES = [1, 3, 7, 8, 9, 16, 25, 33]
NEW_TOKENS = 8
TOP_LOGPROBS = 5
# bf16 runs with and without graphs differ by rounding (another GEMM kernel for the padded
# row count): each step's chosen-token logprob within this, tokens only parting at near ties.
BF16_LOGPROB_ATOL = 0.1


@functools.lru_cache(maxsize=None)
def _llm(dtype: str, mode: str) -> LLM:
    return LLM(tiny_checkpoint(arch="llama"), device="cuda", **gpu_llm_kwargs(dtype, mode))


def _prompts() -> list[list[int]]:
    return gpu_prompts()


def _greedy(llm: LLM, prompts: list[list[int]], logprobs: bool = False) -> list[CompletionOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=TOP_LOGPROBS if logprobs else None)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("mode", ["full", "piecewise", "full_and_piecewise"])
def test_number_of_graphs_per_mode(mode):
    llm = _llm("float32", mode)
    report, m = llm.engine.runner.startup.capture, CudaGraphMode(mode)
    pieces = llm.engine.runner.compile_counters.compiled_pieces * len(_piece_token_counts(SIZES))
    assert report.full_graphs == (len(_piece_token_counts(SIZES)) if m.has_full else 0)
    assert report.piecewise_graphs == (pieces if m.has_piecewise else 0)
    assert report.memory_bytes > 0 and report.seconds > 0


@pytest.mark.parametrize("kind", ["full", "piecewise"])
def test_replay_equals_the_eager_forward(kind):
    """5 decodes (bucket 8), or those plus a 21-token prefill (26 tokens, bucket 32): CI runs
    this very scenario with emulated graphs, so the batch is known to fit its bucket."""
    replay_equals_eager(_llm("float32", "full_and_piecewise"), _prompts(), kind, GPU_NEW_PROMPT, tol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_greedy_runs_with_graphs_equal_runs_without(dtype, batch_size):
    prompts = _prompts()[:batch_size]
    graphs, plain = _llm(dtype, "full_and_piecewise"), _llm(dtype, "none")
    runner = graphs.engine.runner
    before = _buffer_pointers(runner)
    runner.graphs.dispatch_counts.clear()
    with_graphs, without = _greedy(graphs, prompts, logprobs=True), _greedy(plain, prompts, logprobs=True)
    if dtype == "float32":
        tokens = [o.token_ids for o in with_graphs]
        assert tokens == [o.token_ids for o in without]
        path = tiny_checkpoint(arch="llama")
        assert tokens == [hf_greedy(path, tuple(p), NEW_TOKENS)[0] for p in prompts]
    else:
        assert_logprobs_close(with_graphs, without, atol=BF16_LOGPROB_ATOL)
    assert any(p is Path.FULL for p, _ in runner.graphs.dispatch_counts), "decode steps replayed FULL graphs"
    assert _buffer_pointers(runner) == before, "buffers are not reallocated between replays"
    assert graphs.engine.runner.compile_counters.recompiles == 0


def test_capture_fits_at_the_default_memory_setting():
    """Default capture sizes and gpu_memory_utilization: graph memory is reserved before the
    KV cache takes the rest, so capture does not run out of memory."""
    llm = LLM(tiny_checkpoint(arch="llama"), dtype="bfloat16", device="cuda")
    report = llm.engine.runner.startup.capture
    assert report.full_graphs == len(llm.engine.runner.graphs.buckets.full) == 35, "1, 2, 4, 8, ..., 256"
    assert 0 < report.memory_bytes <= report.estimated_bytes
    assert len(_greedy(llm, _prompts()[:3])[0].token_ids) == NEW_TOKENS


def test_one_sequence_through_dynamos_frame_on_cuda(monkeypatch):
    """When the direct call is declined (Dynamo's frame serves, its trace guarding on two rows or
    more), startup captures no bucket of one and a lone sequence replays the bucket of two, with
    the tokens transformers gives and no recompile (which would raise)."""
    from vgraph.compiler.backend import VgraphBackend
    from vgraph.config import CompileConfig
    monkeypatch.setattr(VgraphBackend, "adopt_capture", lambda self, *args: None)
    torch._dynamo.reset()
    kwargs = gpu_llm_kwargs("float32", "full_and_piecewise")
    llm = LLM(tiny_checkpoint(arch="llama"), device="cuda",
              **{**kwargs, "compile_config": CompileConfig(cudagraph_mode=CudaGraphMode.FULL_AND_PIECEWISE,
                                                           cudagraph_capture_sizes=SIZES, use_cache=False)})
    graphs = llm.engine.runner.graphs
    assert graphs.min_rows == 2 and (1, 1) not in graphs.full_graphs.graphs
    graphs.dispatch_counts.clear()
    prompt = _prompts()[0]
    assert _greedy(llm, [prompt])[0].token_ids == hf_greedy(tiny_checkpoint(arch="llama"), tuple(prompt), NEW_TOKENS)[0]
    assert (Path.FULL, 2) in graphs.dispatch_counts and (Path.FULL, 1) not in graphs.dispatch_counts
    assert llm.engine.runner.compile_counters.recompiles == 0
