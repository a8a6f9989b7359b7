"""Overlapped scheduling (``async_scheduling``): the engine schedules and submits step N+1
before it reads step N's tokens. It must change nothing a client sees: the same tokens, logprobs,
texts and finish reasons as the serial loop, for every feature, with preemption and aborts.

The model runs on the runner's step thread; an emulated device (a forward that also sleeps a
fixed time, releasing the GIL, as a GPU's asynchronous kernels let the host go on) shows that
the engine's thread does schedule while the "device" runs."""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.pooling_params import PoolingParams
from vgraph.structured.params import StructuredOutputsParams
from vgraph.testing.emulated_device import emulated_device

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def _llm(overlap: bool, **kwargs) -> LLM:
    # A small KV cache: the workload below preempts (and recomputes) requests.
    kwargs = {"num_gpu_blocks": 10, "block_size": 16, "max_num_batched_tokens": 48, **kwargs}
    return LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", async_scheduling=overlap,
               seed=0, **kwargs)


def _workload() -> list[tuple[str, SamplingParams]]:
    """One request per feature whose exactness the overlap could break."""
    return [
        ("The quick brown fox", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
        ("Once upon a time", SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=20, ignore_eos=True)),
        ("In the beginning", SamplingParams(temperature=0.8, seed=5, top_k=20, top_p=0.9, max_tokens=18,
                                            repetition_penalty=1.3, frequency_penalty=0.5,
                                            presence_penalty=0.4, ignore_eos=True)),
        ("Hello there", SamplingParams(temperature=0, max_tokens=16, logprobs=3, prompt_logprobs=2,
                                       ignore_eos=True)),
        ("A list of numbers", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["e"])),
        ("Stop tokens", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[40, 41, 42, 43, 44],
                                       min_tokens=2)),
        ("Give me JSON:", SamplingParams(temperature=0, max_tokens=40,
                                         structured_outputs=StructuredOutputsParams(json=SCHEMA))),
        ("Short", SamplingParams(temperature=0, max_tokens=1)),
        ("Until the end of the context window " * 3, SamplingParams(temperature=0, max_tokens=60)),
    ]


def _outputs(llm: LLM) -> list[tuple]:
    prompts, params = zip(*_workload())
    results = llm.generate(list(prompts), list(params), use_tqdm=False)
    return [(r.prompt_logprobs, [(c.token_ids, c.logprobs, c.text, c.finish_reason, c.stop_reason)
                                 for c in r.outputs]) for r in results]


@pytest.fixture(scope="module")
def serial() -> LLM:
    return _llm(False)


@pytest.fixture(scope="module")
def overlapped() -> LLM:
    return _llm(True)


def test_overlap_changes_no_output_under_preemption(serial, overlapped):
    expected = _outputs(serial)
    assert serial.engine.scheduler.num_preemptions > 0, "the small KV cache preempts"
    assert _outputs(overlapped) == expected
    assert overlapped.engine.scheduler.num_preemptions > 0
    for llm in (serial, overlapped):
        pool = llm.engine.scheduler.block_pool
        assert pool.num_free_blocks == pool.num_blocks, "every block came back"


def test_overlap_with_aborts_mid_flight(serial, overlapped):
    def run(llm: LLM) -> dict[str, list[int]]:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        for i in range(4):
            llm.add_request(f"a{i}", list(range(10 + i, 30 + 3 * i)), params)
        for _ in range(4):
            llm.step()
        llm.abort_request(["a1", "a2"])
        finished = {}
        while llm.has_unfinished_requests():
            for out in llm.step().outputs:
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
        return finished

    expected = run(serial)
    assert set(expected) == {"a0", "a3"}
    assert run(overlapped) == expected
    assert not overlapped.engine.has_unfinished_requests()


def test_overlap_embeddings_equal():
    serial, overlapped = (_llm(o, num_gpu_blocks=64) for o in (False, True))
    prompts = ["an embedding", "another one, a little longer than the first"]
    for pooling in ("mean", "last"):
        a = serial.embed(prompts, PoolingParams(pooling_type=pooling), use_tqdm=False)
        b = overlapped.embed(prompts, PoolingParams(pooling_type=pooling), use_tqdm=False)
        assert [x.outputs.embedding for x in a] == [x.outputs.embedding for x in b]


def test_the_engine_schedules_while_the_emulated_device_runs(overlapped, serial):
    """The engine's thread enters ``schedule`` while a forward is on the emulated device (and
    never in the serial loop), and the tokens stay the serial ones."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["emulated device", "a second stream"]
    expected = [r.outputs[0].token_ids for r in serial.generate(prompts, params, use_tqdm=False)]
    for llm, overlaps in ((overlapped, True), (serial, False)):
        engine = llm.engine
        with emulated_device(engine.runner, seconds=0.02) as device, \
                _schedules_during_forward(engine, device) as seen:
            got = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert (seen[0] > 0) is overlaps, f"schedule calls during a forward: {seen[0]}"


@contextlib.contextmanager
def _schedules_during_forward(engine, device) -> Iterator[list[int]]:
    """Counts the scheduler's calls made while the emulated device is busy (a live counter)."""
    count = [0]
    original = engine.scheduler.schedule

    def schedule():
        if device.busy():
            count[0] += 1
        return original()

    engine.scheduler.schedule = schedule
    try:
        yield count
    finally:
        del engine.scheduler.schedule  # the class's method again


def test_penalties_count_pending_tokens_without_waiting_for_them(serial, overlapped):
    """A penalised request's step is launched while the step before it is still unfinished: its
    pending token is counted on the device (``launched.pending_tokens``), and the tokens are
    the serial loop's."""
    penalised = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                               frequency_penalty=0.7, presence_penalty=0.3)
    prompts = ["a a a a a", "penalties count every token"]
    plain = [r.outputs[0].token_ids for r in serial.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
    expected = [r.outputs[0].token_ids for r in serial.generate(prompts, penalised, use_tqdm=False)]
    assert expected != plain, "the penalties change the tokens"
    runner = overlapped.engine.runner
    launch, earlier_finished = runner.launch, []

    def launch_and_look(*args, **kwargs):
        before = list(runner.launched)
        launched = launch(*args, **kwargs)
        earlier_finished.extend(step.finished for step in before)
        return launched

    runner.launch = launch_and_look
    try:
        got = [r.outputs[0].token_ids for r in overlapped.generate(prompts, penalised, use_tqdm=False)]
    finally:
        del runner.launch  # the class's method again
    assert got == expected
    assert earlier_finished and not any(earlier_finished), "no launch waited for the step in flight"


def test_a_launch_reads_nothing_back_from_the_device(overlapped):
    """Launching a step enqueues work and returns: a host read of a tensor there (``.tolist()``,
    ``.item()``, ``bool()``, ...) is, on a GPU, a wait for the device that undoes the overlap.
    Every tensor read made inside ``launch`` is recorded over a workload of every feature that
    has device results (logprobs, prompt logprobs, penalties, seeds, min_tokens, embeddings);
    the only reads allowed are the CPU attention kernel's planning of its own host tensors."""
    import sys
    import torch
    runner = overlapped.engine.runner
    launch, reads = runner.launch, []
    names = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def recording(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            reads.append((name, sys._getframe(1).f_code.co_filename))
            return original(self, *args, **kwargs)
        return read

    def launch_recorded(*args, **kwargs):
        for name in names:
            setattr(torch.Tensor, name, recording(name))
        try:
            return launch(*args, **kwargs)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.2),
              SamplingParams(temperature=0.8, max_tokens=8, top_p=0.9, top_k=5, seed=3),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=4)]
    runner.launch = launch_recorded
    try:
        overlapped.generate(["a b c", "hello", "x y", "min tokens"], params, use_tqdm=False)
        overlapped.embed(["an embedding"], PoolingParams(pooling_type="mean"), use_tqdm=False)
    finally:
        del runner.launch  # the class's method again
    assert reads, "the recorder saw the CPU attention's planning"
    assert all(file.replace("\\", "/").endswith("/ops/cpu_attention.py") for _, file in reads), reads
