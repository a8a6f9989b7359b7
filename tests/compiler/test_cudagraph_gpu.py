"""CUDA graphs on a GPU: graph counts per mode, replay vs the eager forward, greedy tokens
with graphs vs without (fp32 and bf16), persistent buffers, and capture at the default
memory setting. Skipped without CUDA; the same logic runs on CPU with emulated graphs in
test_cudagraph_emulated.py."""
from __future__ import annotations

import functools

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.engine.hf_oracle import hf_greedy, random_prompts
from vgraph import LLM, SamplingParams
from vgraph.config import CompileConfig, CudaGraphMode
from vgraph.worker.dispatch import Path

from .test_cudagraph_emulated import _buffer_pointers, _decode_state, _eager, _piece_token_counts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1, 2, 4, 8, 16, 24, 32, 40]
BATCH_SIZES = [1, 3, 7, 8, 9, 16, 25, 33]
NEW_TOKENS = 8


@functools.lru_cache(maxsize=None)
def _llm(dtype: str, mode: str) -> LLM:
    return LLM(tiny_checkpoint(arch="llama"), dtype=dtype, device="cuda", num_gpu_blocks=512, max_num_seqs=40,
               max_num_batched_tokens=1024, compile_config=CompileConfig(cudagraph_mode=mode,
                                                                          cudagraph_capture_sizes=SIZES))


def _prompts() -> list[list[int]]:
    return random_prompts([3, 17, 5, 30, 9, 1, 12, 40, 8, 21, 2] * 3, 512, seed=5)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


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
    llm = _llm("float32", "full_and_piecewise")
    engine = _decode_state(llm, _prompts(), 5)
    runner = engine.runner
    try:
        if kind == "piecewise":
            engine.add_request("s-new", {"prompt_token_ids": _prompts()[7]},
                               SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        sched = engine.scheduler.schedule()
        graphs = runner.graphs
        with torch.inference_mode():
            batch, decision = graphs.build(sched)
            assert decision.path is Path(kind)
            replayed = graphs.run(batch, decision).clone()
            if kind == "full":
                inputs = graphs.decode_buffers.fill(batch)
                eager = _eager(runner, inputs.input_ids, inputs.positions, inputs.attn_metadata)
            else:
                eager = _eager(runner, batch.input_ids, batch.positions, batch.attn_metadata)
        n = batch.num_scheduled
        torch.testing.assert_close(replayed[:n], eager[:n], rtol=1e-4, atol=1e-4)
        assert runner.graphs.piecewise_graphs.misses == 0
        engine.scheduler.update(sched, {s.request.request_id: 5 for s in sched.scheduled if s.produces_token})
    finally:
        engine.abort_request([f"s{i}" for i in range(5)] + ["s-new"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_greedy_tokens_with_graphs_equal_tokens_without(dtype, batch_size):
    prompts = _prompts()[:batch_size]
    graphs, plain = _llm(dtype, "full_and_piecewise"), _llm(dtype, "none")
    runner = graphs.engine.runner
    before = _buffer_pointers(runner)
    runner.graphs.dispatch_counts.clear()
    with_graphs = _greedy(graphs, prompts)
    assert with_graphs == _greedy(plain, prompts)
    if dtype == "float32":
        path = tiny_checkpoint(arch="llama")
        assert with_graphs == [hf_greedy(path, tuple(p), NEW_TOKENS)[0] for p in prompts]
    assert any(p is Path.FULL for p, _ in runner.graphs.dispatch_counts), "decode steps replayed FULL graphs"
    assert _buffer_pointers(runner) == before, "buffers are not reallocated between replays"
    assert graphs.engine.runner.compile_counters.recompiles == 0


def test_capture_fits_at_the_default_memory_setting():
    """Default capture sizes and gpu_memory_utilization: graph memory is reserved before the
    KV cache takes the rest, so capture does not run out of memory."""
    llm = LLM(tiny_checkpoint(arch="llama"), dtype="bfloat16", device="cuda")
    report = llm.engine.runner.startup.capture
    assert report.full_graphs == len(llm.engine.runner.graphs.buckets.full) == 34, "1 is raised to 2"
    assert 0 < report.memory_bytes <= report.estimated_bytes
    assert len(_greedy(llm, _prompts()[:3])[0]) == NEW_TOKENS
