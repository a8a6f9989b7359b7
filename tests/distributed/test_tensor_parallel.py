"""Tensor parallelism on CPU: two gloo ranks in spawned worker processes.

Greedy tokens of TP=2 equal TP=1 and transformers (fp32) on the llama, qwen2 and mistral tiny
checkpoints, eager and compiled; a compiled TP=2 engine never recompiles across batch sizes,
compiles its all-reduces inside the pieces and splits the graph exactly as TP=1 does. Bad sizes
fail before any process starts; a dying worker stops the engine with an error naming its rank;
no worker process outlives its engine.

One TP=2 engine lives at a time (module-scoped, parametrized), its compiles in the session's
compile cache: each engine start costs two Python processes and, compiled, two Inductor compiles.
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import signal

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.engine.hf_oracle import hf_greedy, random_prompts
from vgraph import LLM, SamplingParams
from vgraph.config import EngineConfig, ParallelConfig
from vgraph.distributed.executor import WorkerFailed
from vgraph.structured.params import StructuredOutputsParams
from tests.distributed.processes import pid_alive

ARCHS = ("llama", "qwen2", "mistral")
MODES = ("eager", "compiled")
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LENGTHS = [1, 5, 16, 17, 40, 100]  # block boundaries, one token, a few blocks
ENGINE = dict(dtype="float32", device="cpu", block_size=16, num_gpu_blocks=128, max_model_len=256)


def _start(arch: str, mode: str, tp: int) -> LLM:
    return LLM(tiny_checkpoint(arch=arch), tensor_parallel_size=tp, enforce_eager=mode == "eager", **ENGINE)


@functools.lru_cache(maxsize=None)
def _tp1(arch: str) -> LLM:
    """The TP=1 reference engine of an arch (eager, in this process), shared by the tests."""
    return _start(arch, "eager", 1)


def _tp1_tokens(arch: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """TP=1 on the same prompts, batched the same way."""
    return [o.outputs[0].token_ids for o in _tp1(arch).generate([{"prompt_token_ids": list(p)} for p in prompts],
                                                                GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=[(a, m) for m in MODES for a in ARCHS], ids=lambda p: f"{p[0]}-{p[1]}")
def tp2(request):
    arch, mode = request.param
    llm = _start(arch, mode, 2)
    pids = list(llm.engine.runner.pids)
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    yield arch, mode, llm
    llm.close()
    assert not any(pid_alive(p) for p in pids), "a worker outlived LLM.close()"


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_greedy_tokens_equal_tp1_and_transformers(tp2):
    arch, mode, llm = tp2
    path = tiny_checkpoint(arch=arch)
    prompts = random_prompts(LENGTHS, llm.engine.vocab_size, seed=7)
    got = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
    assert got == _tp1_tokens(arch, tuple(map(tuple, prompts)))
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(path, tuple(prompt), NEW_TOKENS)[0], f"{len(prompt)}-token prompt diverged"
    pool = llm.engine.scheduler.kv_manager.pool
    assert pool.num_free_blocks == llm.engine.runner.num_blocks


def test_compiled_pieces_hold_the_collectives_and_never_recompile(tp2):
    arch, mode, llm = tp2
    if mode != "compiled":
        pytest.skip("eager: nothing compiled")
    # Batch sizes 1..8 and prefill/decode mixes: every rank's forward serves them all.
    for n, seed in ((1, 1), (3, 2), (8, 3)):
        prompts = random_prompts([3 + 11 * i for i in range(n)], llm.engine.vocab_size, seed=seed)
        got = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
        assert got == _tp1_tokens(arch, tuple(map(tuple, prompts)))
    layers = 2
    for rank, c in enumerate(llm.engine.runner.collect_compile_counters()):
        assert c.recompiles == 0, f"rank {rank} recompiled"
        # The same split as at one rank (2L + 1 pieces, L + 1 compiled): no break per collective.
        assert (c.pieces, c.compiled_pieces) == (2 * layers + 1, layers + 1), f"rank {rank}"
        if c.captured_graph != "loaded":  # counted when traced
            # embedding + (o_proj, down_proj) per layer, all inside the compiled pieces
            assert c.compiled_collectives == 1 + 2 * layers, f"rank {rank}"


def test_sampling_logprobs_and_structured_outputs_equal_tp1(tp2):
    arch, mode, llm = tp2
    if (arch, mode) != ("llama", "eager"):
        pytest.skip("one configuration covers the step's non-greedy paths")
    reference = _tp1(arch)
    assert llm.engine.config.scheduler.async_scheduling, "worker processes run the overlapped loop by default"
    assert not reference.engine.config.scheduler.async_scheduling, "one CPU process runs the serial loop"
    prompts = random_prompts([9, 30], llm.engine.vocab_size, seed=11)
    cases = [SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, logprobs=3, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2, presence_penalty=0.5),
             SamplingParams(temperature=0.0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no way"]))]
    for params in cases:
        ours, theirs = _generate(llm, prompts, params), _generate(reference, prompts, params)
        for a, b in zip(ours, theirs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            if params.logprobs:
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                    assert x.keys() == y.keys()
                    assert all(abs(x[k] - y[k]) < 1e-4 for k in x)
            if params.prompt_logprobs:
                for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                    assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)
            if params.structured_outputs is not None:
                assert a.outputs[0].text in ("yes", "no way")


def test_preemption_and_embeddings_equal_tp1(tp2):
    """Preemption re-sends a request's new blocks to the ranks; pooled hidden states come from
    rank 0 after the last all-reduce."""
    arch, mode, llm = tp2
    if (arch, mode) != ("llama", "eager"):
        pytest.skip("one configuration covers them")
    reference = _tp1(arch)
    # 12 x (150 + 60) tokens overflow the 128-block (2048-token) caches: the newest are preempted.
    prompts = random_prompts([150] * 12, llm.engine.vocab_size, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    before = llm.engine.scheduler.num_preemptions
    ours, theirs = _generate(llm, prompts, params), _generate(reference, prompts, params)
    assert llm.engine.scheduler.num_preemptions > before, "the workload should preempt"
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    texts = [{"prompt_token_ids": p} for p in prompts[:3]]
    for a, b in zip(llm.embed(texts, use_tqdm=False), reference.embed(texts, use_tqdm=False)):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding),
                                   rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- errors, no process started

@pytest.mark.parametrize("size,named", [(3, "num_attention_heads=4, num_key_value_heads=2, intermediate_size=128"),
                                        (4, "num_key_value_heads=2")])
def test_sizes_that_do_not_divide_are_refused_before_any_process(size, named):
    before = set(multiprocessing.active_children())  # a module fixture's engine may be running
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size} must divide the model's {named}"):
        _start("llama", "eager", size)
    assert set(multiprocessing.active_children()) == before


def test_parallel_config_is_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_backend 'nccl' does not run on cpu"):
        ParallelConfig(distributed_backend="nccl").resolved("cpu")
    assert ParallelConfig().resolved("cpu").distributed_backend == "gloo"
    assert ParallelConfig().resolved("cuda").distributed_backend == "nccl"


def _resolve(device: str, tp: int) -> EngineConfig:
    # mp: ranks on this machine (left unset, more ranks than GPUs choose Ray where it is installed).
    config = EngineConfig.from_kwargs("m", device=device, tensor_parallel_size=tp, distributed_executor_backend="mp")
    return config.resolved(model_path="m", max_position_embeddings=64, quantized=False)


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="needs fewer than 8 visible GPUs")
def test_more_ranks_than_cuda_devices_is_refused():
    visible = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"tensor_parallel_size=8 needs 8 CUDA devices, but {visible}"):
        _resolve("cuda", 8)
    with pytest.raises(ValueError, match="names one GPU"):
        _resolve("cuda:1", 2)
    assert _resolve("cpu", 8).parallel.distributed_backend == "gloo"


# ---------------------------------------------------------------------- a worker dying

def test_a_dying_worker_stops_the_engine_naming_its_rank(tp2):
    """Runs last on the last eager engine, which it ends (the fixture's close is then a no-op)."""
    arch, mode, llm = tp2
    if (arch, mode) != (ARCHS[-1], "eager"):
        pytest.skip("uses the last eager engine")
    engine = llm.engine
    pids = list(engine.runner.pids)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([20] * 4, engine.vocab_size, seed=3)):
        engine.add_request(f"doomed-{i}", {"prompt_token_ids": prompt}, params)
    engine.step()
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerFailed, match=r"rank 1 \(pid \d+\) died \(signal SIGKILL\)") as info:
        for _ in range(50):  # the next step sees it (a bounded loop: never hang the suite)
            engine.step()
    assert info.value.rank == 1
    assert not any(pid_alive(p) for p in pids), "the other rank was left running"
    with pytest.raises(WorkerFailed, match="has stopped"):
        engine.step()
    engine.abort_all()


# ---------------------------------------------------------------------- CUDA (NCCL)

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("mode", MODES)
def test_tp2_on_two_gpus_equals_transformers(mode):
    path = tiny_checkpoint(arch="llama")
    with LLM(path, tensor_parallel_size=2, enforce_eager=mode == "eager", dtype="float32", device="cuda",
             num_gpu_blocks=128, max_model_len=256) as llm:
        assert llm.engine.config.parallel.distributed_backend == "nccl"
        prompts = random_prompts(LENGTHS, llm.engine.vocab_size, seed=7)
        for prompt, out in zip(prompts, _generate(llm, prompts)):
            assert out.outputs[0].token_ids == hf_greedy(path, tuple(prompt), NEW_TOKENS)[0]


def test_a_rank_reads_the_next_step_while_its_large_reply_is_still_being_sent():
    """Steps in flight: the engine writes step N+1 while the rank writes step N's reply. Both
    larger than the connection's buffer would block both sides in ``send`` forever; the rank's
    replies go out from their own thread, so it reads on and both complete."""
    import threading

    from vgraph.distributed.worker import _Replies

    engine_end, rank_end = multiprocessing.Pipe()
    big = b"x" * (8 << 20)  # far beyond any socket buffer
    got = {}

    def rank() -> None:
        replies = _Replies(rank_end)
        replies.send(("ok", big))  # step N's reply, while ...
        got["plan"] = rank_end.recv()  # ... the engine is writing step N+1
        replies.close()

    thread = threading.Thread(target=rank, daemon=True)
    thread.start()
    engine_end.send(big)  # would block forever against a rank blocked in its own send
    assert engine_end.recv() == ("ok", big)
    thread.join(30)
    assert not thread.is_alive() and got["plan"] == big
