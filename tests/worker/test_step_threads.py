"""The CPU forward's thread count per step size (vgraph/worker/step_threads.py): measured, kept,
measured again, and never a change to what the model computes."""
from __future__ import annotations

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.worker import step_threads
from vgraph.worker.step_threads import MAX_MEASURED_TOKENS, RETRY_EVERY, TRIALS, StepThreads

ROUND = 2 * (TRIALS + 1)  # steps of one measurement: each side's first forward is not counted


def _run(chooser: StepThreads, num_tokens: int, seconds_by_threads: dict[int, float]) -> int:
    """One step: the chooser's pick, timed as ``seconds_by_threads`` says."""
    threads = chooser.threads_for(num_tokens)
    chooser.record(num_tokens, threads, seconds_by_threads[threads])
    return threads


def test_it_measures_both_sides_in_turn_then_keeps_the_faster():
    chooser = StepThreads(4)
    picks = [_run(chooser, 1, {4: 2e-3, 1: 1e-3}) for _ in range(ROUND)]
    assert picks == [4, 1] * (TRIALS + 1)
    assert {_run(chooser, 1, {4: 2e-3, 1: 1e-3}) for _ in range(50)} == {1}


def test_one_thread_must_win_clearly():
    chooser = StepThreads(2)
    for _ in range(ROUND):  # one thread 5% faster: not enough
        _run(chooser, 4, {2: 1.00e-3, 1: 0.95e-3})
    assert chooser.threads_for(4) == 2


def test_size_classes_choose_apart_and_large_steps_keep_every_thread():
    chooser = StepThreads(2)
    for _ in range(ROUND):
        _run(chooser, 1, {2: 2e-3, 1: 1e-3})  # one token: one thread is faster
        _run(chooser, 200, {2: 5e-3, 1: 9e-3})  # 128-255 tokens: all of them are
        assert _run(chooser, MAX_MEASURED_TOKENS + 1, {2: 9e-3, 1: 1e-3}) == 2  # never measured
    assert chooser.threads_for(1) == 1
    assert chooser.threads_for(250) == 2 and chooser.threads_for(128) == 2


def test_a_class_larger_than_one_that_took_every_thread_is_not_measured():
    """Larger steps have longer parallel regions: once 16-31 tokens chose every thread, a rare
    128-token prefill is not run on one thread to find out (each trial would cost twice)."""
    chooser = StepThreads(2)
    assert [_run(chooser, 128, {2: 9e-3, 1: 1e-3}) for _ in range(2)] == [2, 1]  # undecided: measured
    fresh = StepThreads(2)
    for _ in range(ROUND):
        _run(fresh, 16, {2: 5e-3, 1: 7e-3})
    assert fresh.threads_for(16) == 2
    assert {_run(fresh, n, {2: 9e-3, 1: 1e-3}) for n in (32, 100, 128, 255) for _ in range(ROUND)} == {2}
    assert _run(fresh, 4, {2: 2e-3, 1: 1e-3}) == 2 and _run(fresh, 4, {2: 2e-3, 1: 1e-3}) == 1  # smaller: measured


def test_it_measures_again_after_a_while():
    """A neighbour that came or went changes the answer: it is found at the next measurement."""
    chooser = StepThreads(2)
    for _ in range(ROUND):
        _run(chooser, 8, {2: 1e-3, 1: 3e-3})
    assert [_run(chooser, 8, {2: 5e-3, 1: 3e-3}) for _ in range(RETRY_EVERY)] == [2] * RETRY_EVERY
    remeasured = [_run(chooser, 8, {2: 5e-3, 1: 3e-3}) for _ in range(ROUND)]
    assert sorted(remeasured) == [1] * (TRIALS + 1) + [2] * (TRIALS + 1)
    assert chooser.threads_for(8) == 1


def test_the_forward_block_sets_and_restores_the_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        chooser = StepThreads(2)
        seen = []
        for _ in range(ROUND):
            with chooser.forward(1):
                seen.append(torch.get_num_threads())
            assert torch.get_num_threads() == 2
        assert seen == [2, 1] * (TRIALS + 1)
    finally:
        torch.set_num_threads(before)


def test_no_chooser_where_there_is_nothing_to_choose(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert StepThreads.for_engine(torch.device("cpu"), 1) is not None
        assert StepThreads.for_engine(torch.device("cuda"), 1) is None
        assert StepThreads.for_engine(torch.device("cpu"), 2) is None  # ranks wait on each other
        # Dynamo's frame serves: it guards on the thread count, a change would recompile
        assert StepThreads.for_engine(torch.device("cpu"), 1, fixed_threads=True) is None
        monkeypatch.setenv(step_threads.ENV, "all")
        assert StepThreads.for_engine(torch.device("cpu"), 1) is None
        torch.set_num_threads(1)
        monkeypatch.delenv(step_threads.ENV)
        assert StepThreads.for_engine(torch.device("cpu"), 1) is None
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError):
        StepThreads(1)


def test_tokens_do_not_depend_on_the_step_threads(monkeypatch):
    """The same greedy and sampled tokens and logprobs whether steps choose their threads or
    all run on every thread: one kernel sum order whatever the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prompts = ["The quick brown fox", "Once upon a time there", "A"]
        params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
        results = {}
        for mode in ("measured", "all"):
            if mode == "all":
                monkeypatch.setenv(step_threads.ENV, "all")
            llm = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", seed=0)
            assert (llm.engine.runner.step_threads is None) == (mode == "all")
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            if mode == "measured":  # both sides ran: one token at a time, and the prompts' sizes
                classes = llm.engine.runner.step_threads._classes
                assert classes and all(not c.measuring or c.samples for c in classes.values())
        assert results["measured"] == results["all"]
    finally:
        torch.set_num_threads(before)
