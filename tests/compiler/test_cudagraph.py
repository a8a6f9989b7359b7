"""Bucketed execution on CPU: the dispatcher and padding of the CUDA-graph paths run here too,
each bucket being the compiled forward at the padded size. Greedy tokens equal transformers
for every batch size and for a batch that grows and shrinks, with no recompile.

The CUDA graphs themselves are tested in test_cudagraph_gpu.py (marked gpu)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.compiler.graph_scenarios import decode_state
from tests.engine.hf_oracle import hf_greedy, random_prompts
from vgraph import LLM, SamplingParams
from vgraph.compiler.build import config_key
from vgraph.config import CompileConfig, EngineConfig, ModelConfig
from vgraph.models.loader import load_hf_config
from vgraph.config import CudaGraphMode
from vgraph.worker.dispatch import Decision, Path
from vgraph.core.outputs import ModelRunnerOutput

BATCH_SIZES = [1, 3, 7, 8, 9, 16, 25, 33]
NEW_TOKENS = 6
MAX_SEQS = 40  # decode buckets 1, 2, 4, 8, 16, 24, 32, 40


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Set explicitly: on CPU the default mode is none (no graphs, so no padding).
    return LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=256,
               max_num_seqs=MAX_SEQS, max_num_batched_tokens=512,
               compile_config=CompileConfig(cudagraph_mode="full_and_piecewise"))


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return random_prompts([3, 17, 5, 30, 9, 1, 12, 40, 8, 21, 2] * 3, llm.engine.vocab_size, seed=7)


def _expected(prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    return hf_greedy(tiny_checkpoint(arch="llama"), tuple(prompt), new_tokens)[0]


def test_buckets_are_enabled_on_cpu_without_graphs(llm):
    engine = llm.engine
    assert engine.runner.graphs.mode is CudaGraphMode.FULL_AND_PIECEWISE
    assert engine.runner.graphs.buckets.full == (1, 2, 4, 8, 16, 24, 32, 40), "the forward serves one row"
    assert engine.runner.graphs.buckets.piecewise[-1] == 256
    runner = engine.runner
    assert runner.graphs.decode_buffers is not None and runner.graphs.full_graphs is None and runner.graphs.piecewise_graphs is None
    assert engine.runner.startup.capture.full_graphs == 0 and engine.runner.startup.capture.piecewise_graphs == 0


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_greedy_tokens_equal_transformers_at_every_batch_size(llm, prompts, batch_size):
    runner = llm.engine.runner
    before = Counter(runner.graphs.dispatch_counts)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:batch_size]], params, use_tqdm=False)
    counts = runner.graphs.dispatch_counts - before
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _expected(prompt), f"prompt of {len(prompt)} tokens diverged"
    bucket = next(b for b in llm.engine.runner.graphs.buckets.full if b >= batch_size)
    decodes = {k: v for k, v in counts.items() if k[0] is Path.FULL}
    assert decodes == {(Path.FULL, bucket): NEW_TOKENS - 1}, "every decode step in one padded FULL bucket"
    # one prefill step (the budget holds every prompt), less what the prefix cache served
    total = sum(len(p) - out.num_cached_tokens for p, out in zip(prompts, outs))
    prefill = {k for k in counts if k[0] is not Path.FULL}
    largest = llm.engine.runner.graphs.buckets.piecewise[-1]
    if total <= largest:
        assert prefill == {(Path.PIECEWISE, next(b for b in llm.engine.runner.graphs.buckets.piecewise if b >= total))}
    else:
        assert prefill == {(Path.NONE, total)}, "above the largest bucket: unpadded, no graph"
    assert llm.engine.runner.compile_counters.recompiles == 0


def test_growing_and_shrinking_batch_equals_transformers(llm, prompts):
    """Requests arrive every few steps with different lengths, so decode batches rise and fall
    through several buckets and prefills mix with decodes."""
    engine, runner = llm.engine, llm.engine.runner
    before = Counter(runner.graphs.dispatch_counts)
    arrivals = {0: [0, 1], 2: [2, 3, 4, 5, 6], 3: [7], 6: list(range(8, 20)), 9: list(range(20, 30))}
    max_tokens = {i: 3 + (7 * i) % 11 for i in range(30)}
    done: dict[str, list[int]] = {}
    step = 0
    while step < 200 and (engine.has_unfinished_requests() or step <= max(arrivals)):
        for i in arrivals.get(step, []):
            llm.add_request(f"g{i}", {"prompt_token_ids": prompts[i]},
                            SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True))
        for out in llm.step().outputs:
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert len(done) == 30
    for i in range(30):
        assert done[f"g{i}"] == _expected(prompts[i], max_tokens[i]), f"request {i} diverged"
    counts = runner.graphs.dispatch_counts - before
    full_buckets = {b for path, b in counts if path is Path.FULL}
    assert len(full_buckets) >= 4, f"decode batches should cross several buckets, got {full_buckets}"
    assert any(path is Path.PIECEWISE for path, _ in counts)
    assert engine.runner.compile_counters.recompiles == 0
    assert engine.runner.compile_counters.graphs_seen <= 1, "traced once (or not at all: a warm start)"


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_padded_hidden_states_equal_unpadded(llm, prompts, kind):
    """The same batch with buckets on and off: the real rows agree (fp32, tight)."""
    engine = decode_state(llm, prompts, 5)
    try:
        if kind == "mixed":
            engine.add_request("s-new", {"prompt_token_ids": prompts[9]},
                               SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        sched = engine.scheduler.schedule()
        step = engine.runner.requests.apply(sched.plan)  # the runner's copies follow every plan
        graphs = engine.runner.graphs
        with torch.inference_mode():
            batch, decision = graphs.build(step)
            assert decision.path is (Path.FULL if kind == "decode" else Path.PIECEWISE) and decision.padding > 0
            padded = graphs.run(replace(batch, output_rows=None), decision).clone()
            unpadded = Decision(Path.NONE, decision.num_tokens, decision.num_tokens)
            plain = graphs.run(replace(graphs.builder.build(step, unpadded), output_rows=None), unpadded).clone()
        assert padded.shape == plain.shape == (decision.num_tokens, plain.shape[1])
        torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
        engine.scheduler.update(sched, ModelRunnerOutput({s.request.request_id: 5 for s in sched.scheduled
                                                          if s.produces_token}))
    finally:
        engine.abort_request([f"s{i}" for i in range(5)] + ["s-new"])


def test_no_recompile_across_everything_above(llm):
    assert llm.engine.runner.compile_counters.graphs_seen <= 1 and llm.engine.runner.compile_counters.recompiles == 0


def test_enforce_eager_turns_graphs_and_buckets_off():
    eager = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=32,
                enforce_eager=True, compile_config=CompileConfig(cudagraph_mode="full"))
    assert eager.engine.runner.graphs.mode is CudaGraphMode.NONE
    assert eager.engine.config.compile.cudagraph_mode is CudaGraphMode.NONE
    assert eager.engine.runner.graphs.decode_buffers is None
    assert eager.engine.runner.compile_counters is None


def test_graph_settings_do_not_change_the_compile_cache_key():
    """Capture sizes are not compile sizes: they change no generated code, so engines that
    differ only in graph settings share compiled artifacts."""
    path = tiny_checkpoint(arch="llama")
    hf = load_hf_config(path)

    def key(compile_config: CompileConfig) -> str:
        return config_key(EngineConfig(model=ModelConfig(path), compile=compile_config), hf, torch.float32,
                          None, torch.device("cpu"))

    base = key(CompileConfig())
    assert key(CompileConfig(cudagraph_mode="none", cudagraph_capture_sizes=[1, 2], max_capture_size=64)) == base
    assert key(CompileConfig(compile_sizes=[8])) != base


def test_cli_flags_reach_the_compile_config(monkeypatch):
    import vgraph
    from vgraph import cli
    seen = {}

    class FakeLLM:
        def __init__(self, model, **kw):
            seen["config"] = EngineConfig.from_kwargs(model, **kw).compile

    monkeypatch.setattr(vgraph, "LLM", FakeLLM)
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--model", "m", "--cudagraph-mode",
                                          "piecewise", "--cudagraph-capture-sizes", "1", "2", "8"])
    cli._llm_from_args(args)
    assert seen["config"].cudagraph_mode is CudaGraphMode.PIECEWISE
    assert seen["config"].cudagraph_capture_sizes == [1, 2, 8]
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--model", "m", "--enforce-eager"])
    cli._llm_from_args(args)
    assert seen["config"].level == "none" and seen["config"].cudagraph_mode is None
