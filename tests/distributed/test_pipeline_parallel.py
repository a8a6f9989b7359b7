"""Pipeline parallelism on CPU: stages of gloo ranks in spawned worker processes.

Greedy tokens of PP=2 (llama), PP=2 x TP=2 (qwen2: tied embeddings, so the last stage loads the
embedding into its own lm_head) and PP=3 over a 4-layer model (a middle stage that both receives
and sends; an uneven split) equal one rank and transformers (fp32), eager and compiled, with
prefix caching; a compiled stage compiles only its own layers and never recompiles; sampling,
logprobs, prompt logprobs, structured outputs, preemption and embeddings equal one rank; the
engine keeps one step per stage in flight. Bad sizes fail before any process starts; a killed
stage is named and stops the engine; no worker outlives its engine.
The served engine (engine-core process) is in test_pp_server.py.

One engine lives at a time (module-scoped, parametrized): each start costs P x T processes.
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.checkpoints import process_tmp_dir, tiny_checkpoint
from tests.distributed.processes import pid_alive
from tests.engine.hf_oracle import hf_greedy, random_prompts
from vgraph import LLM, SamplingParams
from vgraph.config import CacheConfig, ParallelConfig, SchedulerConfig
from vgraph.core.outputs import ModelRunnerOutput
from vgraph.core.request import Request
from vgraph.core.scheduler import Scheduler
from vgraph.distributed.executor import WorkerFailed
from vgraph.distributed.pipeline import LAYER_PARTITION_ENV, stage_layers
from vgraph.models.demo import build_tiny_checkpoint
from vgraph.structured.params import StructuredOutputsParams

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LENGTHS = [1, 5, 16, 17, 40, 100]
ENGINE = dict(dtype="float32", device="cpu", block_size=16, num_gpu_blocks=128, max_model_len=256)
# (checkpoint, tensor_parallel_size, pipeline_parallel_size, mode). "padded": compiled, with the
# CUDA graph dispatcher's buckets on CPU (no graphs: FULL decode batches run the forward over the
# persistent decode buffers, a later stage's holding activations; other batches are padded).
CASES = [("llama", 1, 2, "eager"), ("llama", 1, 2, "padded"), ("qwen2", 2, 2, "eager"),
         ("qwen2", 2, 2, "compiled"), ("llama-4-layers", 1, 3, "eager")]


@functools.lru_cache(maxsize=None)
def _checkpoint(name: str) -> str:
    if name == "llama-4-layers":
        return build_tiny_checkpoint(Path(process_tmp_dir()) / "tiny-llama-4-layers", "llama", seed=1,
                                     num_hidden_layers=4)
    return tiny_checkpoint(arch=name)


def _start(name: str, tp: int, pp: int, mode: str, **overrides) -> LLM:
    if mode == "padded":
        overrides = {"cudagraph_mode": "full_and_piecewise", **overrides}
    return LLM(_checkpoint(name), tensor_parallel_size=tp, pipeline_parallel_size=pp,
               enforce_eager=mode == "eager", **{**ENGINE, **overrides})


@functools.lru_cache(maxsize=None)
def _one_rank(name: str) -> LLM:
    """The one-rank reference engine of a checkpoint (eager, in this process)."""
    return _start(name, 1, 1, "eager")


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-tp{c[1]}-pp{c[2]}-{c[3]}")
def staged(request):
    name, tp, pp, mode = request.param
    llm = _start(name, tp, pp, mode)
    pids = list(llm.engine.runner.pids)
    assert len(pids) == tp * pp and all(pid_alive(p) for p in pids)
    yield request.param, llm
    llm.close()
    assert not any(pid_alive(p) for p in pids), "a worker outlived LLM.close()"


def test_greedy_tokens_equal_one_rank_and_transformers_with_prefix_caching(staged):
    (name, _, _, _), llm = staged
    prompts = random_prompts(LENGTHS, llm.engine.vocab_size, seed=7)
    got = _tokens(_generate(llm, prompts))
    assert got == _tokens(_generate(_one_rank(name), prompts))
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(_checkpoint(name), tuple(prompt), NEW_TOKENS)[0], f"{len(prompt)}-token prompt"
    # Again: the full blocks of every prompt now come from the prefix cache, on every stage.
    hits = llm.engine.stats().prefix_cache_hits
    assert _tokens(_generate(llm, prompts)) == got
    assert llm.engine.stats().prefix_cache_hits > hits
    assert llm.engine.scheduler.kv_manager.pool.num_free_blocks == llm.engine.runner.num_blocks


def test_stages_run_steps_in_flight(staged, monkeypatch):
    """The engine keeps one step per stage in flight (stage 0 runs step N + 1 while stage 1 runs
    step N); a command sent meanwhile (the compile counters) reads the steps' replies first and
    keeps them for ``collect``, so every step's tokens still arrive, in order."""
    (name, tp, pp, mode), llm = staged
    if (tp, pp, mode) != (1, 2, "eager"):
        pytest.skip("one configuration covers the executor's bookkeeping")
    runner = llm.engine.runner
    submit, seen = runner.submit, []

    def submit_and_count(plan, masks=None):
        submit(plan, masks)
        seen.append(runner.steps_in_flight)
        if runner.steps_in_flight == 2 and seen.count(2) == 1:
            assert len(runner.collect_compile_counters()) == 2  # between two steps in flight

    monkeypatch.setattr(runner, "submit", submit_and_count)
    prompts = random_prompts([40, 3, 70, 9, 120, 17, 33, 5], llm.engine.vocab_size, seed=17)
    got = _tokens(_generate(llm, prompts))
    assert max(seen) == 2, f"steps in flight per submit: {seen}"
    assert got == _tokens(_generate(_one_rank(name), prompts))


def test_each_stage_compiles_its_layers_and_never_recompiles(staged):
    (name, tp, pp, mode), llm = staged
    if mode == "eager":
        pytest.skip("eager: nothing compiled")
    for n, seed in ((1, 1), (3, 2), (8, 3)):  # batch sizes and prefill/decode mixes
        prompts = random_prompts([3 + 11 * i for i in range(n)], llm.engine.vocab_size, seed=seed)
        assert _tokens(_generate(llm, prompts)) == _tokens(_generate(_one_rank(name), prompts))
    layers = stage_layers(2, pp)
    for rank, c in enumerate(llm.engine.runner.collect_compile_counters()):
        own = len(layers[rank // tp])
        assert c.recompiles == 0, f"rank {rank} recompiled"
        assert (c.pieces, c.compiled_pieces) == (2 * own + 1, own + 1), f"rank {rank}"


def test_sampling_logprobs_prompt_logprobs_and_structured_outputs_equal_one_rank(staged):
    (name, tp, pp, mode), llm = staged
    if (tp, pp, mode) != (1, 2, "eager"):
        pytest.skip("one configuration covers the last stage's sampler paths")
    prompts = random_prompts([9, 30], llm.engine.vocab_size, seed=11)
    cases = [SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, logprobs=3, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2, presence_penalty=0.5),
             SamplingParams(temperature=0.0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no way"]))]
    for params in cases:
        for a, b in zip(_generate(llm, prompts, params), _generate(_one_rank(name), prompts, params)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
                assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)
            for x, y in zip((a.prompt_logprobs or [None])[1:], (b.prompt_logprobs or [None])[1:]):
                assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)
            if params.structured_outputs is not None:
                assert a.outputs[0].text in ("yes", "no way")


def test_preemption_and_embeddings_equal_one_rank(staged):
    """Preemption re-sends a request's blocks to every stage; pooled states come from the last."""
    (name, tp, pp, mode), llm = staged
    if (tp, pp, mode) != (2, 2, "eager"):
        pytest.skip("one configuration covers them")
    reference = _one_rank(name)
    # 12 x (150 + 60) tokens overflow the 128-block (2048-token) caches: the newest are preempted.
    prompts = random_prompts([150] * 12, llm.engine.vocab_size, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    before = llm.engine.scheduler.num_preemptions
    ours, theirs = _generate(llm, prompts, params), _generate(reference, prompts, params)
    assert llm.engine.scheduler.num_preemptions > before, "the workload should preempt"
    assert _tokens(ours) == _tokens(theirs)
    texts = [{"prompt_token_ids": p} for p in prompts[:3]]
    for a, b in zip(llm.embed(texts, use_tqdm=False), reference.embed(texts, use_tqdm=False)):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding),
                                   rtol=1e-5, atol=1e-5)


def test_a_killed_stage_stops_the_engine_naming_it(staged):
    """Runs last on the PP=3 engine, which it ends (the fixture's close is then a no-op)."""
    (name, tp, pp, mode), llm = staged
    if pp != 3:
        pytest.skip("uses the three-stage engine")
    engine = llm.engine
    pids = list(engine.runner.pids)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([20] * 4, engine.vocab_size, seed=3)):
        engine.add_request(f"doomed-{i}", {"prompt_token_ids": prompt}, params)
    engine.step()
    os.kill(pids[1], signal.SIGKILL)  # the middle stage: the others wait on it in send/recv
    with pytest.raises(WorkerFailed, match=r"rank 1 \(pid \d+\) died \(signal SIGKILL\), pipeline stage 1 of 3"):
        for _ in range(50):  # the next step sees it (a bounded loop: never hang the suite)
            engine.step()
    assert not any(pid_alive(p) for p in pids), "another stage was left running"
    with pytest.raises(WorkerFailed, match="has stopped"):
        engine.step()
    engine.abort_all()


# ---------------------------------------------------------------------- sizes, no process started

def test_layers_split_evenly_with_the_remainder_on_the_first_stages(monkeypatch):
    monkeypatch.delenv(LAYER_PARTITION_ENV, raising=False)
    assert stage_layers(8, 1) == [range(0, 8)]
    assert stage_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert stage_layers(8, 3, "2,3,3") == [range(0, 2), range(2, 5), range(5, 8)]
    monkeypatch.setenv(LAYER_PARTITION_ENV, "1,7")
    assert stage_layers(8, 2) == [range(0, 1), range(1, 8)]
    for bad in ("4,3", "8,0", "a,b", "2,2,4"):
        with pytest.raises(ValueError, match=LAYER_PARTITION_ENV):
            stage_layers(8, 2, bad)


def test_each_step_in_flight_takes_its_share_of_the_requests():
    """With two stages the scheduler gives a step at most half the requests; a request waits for
    its token, so the next step takes the other half, and the two alternate."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                          CacheConfig(block_size=16), num_blocks=64, max_model_len=256, microbatches=2)
    for i in range(6):
        scheduler.add_request(Request(f"r{i}", [5 + i] * 4, SamplingParams(max_tokens=4, ignore_eos=True)))
    first, second = scheduler.schedule(), scheduler.schedule()
    ids = [{s.request.request_id for s in out.scheduled} for out in (first, second)]
    assert ids == [{"r0", "r1", "r2"}, {"r3", "r4", "r5"}]
    assert not scheduler.schedule().scheduled  # every request's token is pending: nothing to run
    scheduler.update(first, ModelRunnerOutput({rid: 7 for rid in ids[0]}))
    assert {s.request.request_id for s in scheduler.schedule().scheduled} == ids[0]


def test_parallel_config_counts_ranks_stage_major():
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert (config.world_size, config.output_rank) == (6, 4)  # tp rank 0 of the last stage
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        ParallelConfig(pipeline_parallel_size=0)


@pytest.mark.parametrize("pp,partition,named", [(3, None, "pipeline_parallel_size=3 exceeds the model's 2 decoder"),
                                                (2, "2,1", f"{LAYER_PARTITION_ENV}='2,1'")])
def test_bad_stage_sizes_are_refused_before_any_process(monkeypatch, pp, partition, named):
    if partition is None:
        monkeypatch.delenv(LAYER_PARTITION_ENV, raising=False)
    else:
        monkeypatch.setenv(LAYER_PARTITION_ENV, partition)
    before = set(multiprocessing.active_children())  # a module fixture's engine may be running
    with pytest.raises(ValueError, match=named):
        _start("llama", 1, pp, "eager")
    assert set(multiprocessing.active_children()) == before
