"""``LLMEngine.step()``'s contract with its callers: per-request timings that are consistent
and reported once, aborts that are counted, and ``EngineStats`` equal to the scheduler's counts."""
from __future__ import annotations

import time
from collections import defaultdict

import pytest

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.engine.llm_engine import LLMEngine
from vgraph.engine.outputs import OutputKind
from vgraph.engine.stats import EngineStats, EngineStep, RequestTiming, StepOutput

BUDGET = 32  # max_num_batched_tokens: a longer prompt is prefilled over several steps


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=64,
               max_model_len=256, max_num_batched_tokens=BUDGET, enforce_eager=True)


@pytest.fixture(scope="module")
def engine(llm) -> LLMEngine:
    return llm.engine


def _params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.8 if n > 1 else 0.0, seed=1, max_tokens=max_tokens, ignore_eos=True)


def _run(engine: LLMEngine | LLM) -> list[EngineStep | StepOutput]:
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def _by_request(steps: list[EngineStep | StepOutput]) -> dict[str, list[RequestTiming]]:
    timings: dict[str, list[RequestTiming]] = defaultdict(list)
    for step in steps:
        ids = [t.request_id for t in step.timings]
        assert len(ids) == len(set(ids)), "one timing per request per step"
        for t in step.timings:
            timings[t.request_id].append(t)
    return timings


def _one(timings: list[RequestTiming], field: str) -> float:
    values = [getattr(t, field) for t in timings if getattr(t, field) is not None]
    assert len(values) == 1, f"{field} reported {len(values)} times"
    return values[0]


def test_timings_are_consistent_and_reported_once(engine):
    submitted = time.monotonic() - 0.5  # the server passes when it took the request
    engine.add_request("long", list(range(10, 10 + 3 * BUDGET)), _params(6), arrival_time=submitted)
    engine.add_request("short", [5, 6, 7], _params(4))
    steps = _run(engine)
    timings = _by_request(steps)
    assert set(timings) == {"long", "short"}
    for rid, new_tokens in (("long", 6), ("short", 4)):
        queue, ttft, e2e = (_one(timings[rid], f) for f in ("queue_time", "time_to_first_token", "e2e_latency"))
        # arrival <= first scheduled <= first token <= finish
        assert 0 <= queue <= ttft <= e2e
        assert sum(t.num_new_tokens for t in timings[rid]) == new_tokens
        gaps = [t.inter_token_latency for t in timings[rid] if t.inter_token_latency is not None]
        assert len(gaps) == new_tokens - 1 and all(g >= 0 for g in gaps)
        assert [t.finish_reasons for t in timings[rid] if t.finish_reasons] == [["length"]]
        assert timings[rid][-1].e2e_latency is not None, "finish is the last thing reported"
    assert _one(timings["long"], "queue_time") >= 0.5, "queue time counts from the given arrival"


def test_queue_time_is_reported_when_first_scheduled_even_without_a_token(engine):
    engine.add_request("chunked", list(range(300, 300 + 2 * BUDGET + 5)), _params(2))  # no cached prefix
    first = engine.step()
    assert first.deltas == []
    [timing] = first.timings
    assert timing.request_id == "chunked" and timing.queue_time is not None
    assert timing.num_new_tokens == 0 and timing.time_to_first_token is None
    second = engine.step()
    assert second.timings == [], "a prefill chunk that is neither first nor producing reports nothing"
    rest = _by_request(_run(engine))["chunked"]
    assert all(t.queue_time is None for t in rest)
    assert rest[0].time_to_first_token is not None


def test_n_greater_than_one_reports_per_request_not_per_sequence(engine):
    engine.add_request("multi", [5, 6, 7, 8], _params(5, n=3))
    timings = _by_request(_run(engine))
    assert set(timings) == {"multi"}
    multi = timings["multi"]
    assert sum(t.num_new_tokens for t in multi) == 3 * 5
    assert all(t.num_new_tokens in (0, 3) for t in multi), "the three sequences advance together"
    _one(multi, "time_to_first_token")
    _one(multi, "queue_time")
    _one(multi, "e2e_latency")
    assert sum(t.inter_token_latency is not None for t in multi) == 5 - 1
    assert [t.finish_reasons for t in multi if t.finish_reasons] == [["length"] * 3]


def test_abort_returns_timings_with_finish_reason_abort(engine):
    engine.add_request("running", [5, 6, 7], _params(50))
    engine.add_request("pair", [8, 9, 10], _params(50, n=2))
    engine.step()
    engine.add_request("waiting", [11, 12], _params(50))  # not scheduled yet
    aborted = engine.abort_request(["running", "pair", "waiting", "unknown"])
    assert [(t.request_id, t.finish_reasons) for t in aborted] == [
        ("running", ["abort"]), ("pair", ["abort", "abort"]), ("waiting", ["abort"])]
    assert all(t.e2e_latency is None and t.num_new_tokens == 0 for t in aborted)
    assert engine.abort_request("running") == [], "an aborted request is gone"
    assert not engine.has_unfinished_requests()
    assert engine.step() == EngineStep([], [], engine.stats())


def _scheduler_counts(engine: LLMEngine) -> EngineStats:
    scheduler, pool = engine.scheduler, engine.scheduler.kv_manager.pool
    return EngineStats(scheduler.num_running, scheduler.num_waiting, pool.usage, pool.prefix_cache_queries,
                       pool.prefix_cache_hits, scheduler.num_preemptions)


def test_engine_stats_match_the_scheduler():
    llm = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=12, block_size=16,
              max_model_len=128, max_num_batched_tokens=BUDGET, enforce_eager=True)
    engine = llm.engine
    shared = list(range(20, 52))  # two full blocks another request can find in the prefix cache
    for i in range(4):
        engine.add_request(f"s{i}", shared + [60 + i] * 8, _params(40))
    assert engine.stats() == _scheduler_counts(engine) and engine.stats().num_waiting == 4
    while engine.has_unfinished_requests():
        step = engine.step()
        assert step.stats == _scheduler_counts(engine) == engine.stats()
    final = engine.stats()
    assert final.num_preemptions > 0, "12 blocks cannot hold four 80-token requests"
    assert final.prefix_cache_hits > 0 and final.prefix_cache_queries >= final.prefix_cache_hits
    assert final.num_running == final.num_waiting == 0 and final.kv_usage == 0


def test_a_final_only_request_has_one_output_equal_to_the_streamed_ones_last(llm):
    """LLM.generate's requests: no output while they run, then the one a streaming caller
    would have got last; their timings are reported as for any request. Delta outputs add
    up to the same."""
    prompt = list(range(10, 10 + 2 * BUDGET))
    llm.add_request("streamed", prompt, _params(5, n=2))
    llm.add_request("final", prompt, _params(5, n=2), OutputKind.FINAL_ONLY)
    llm.add_request("final-short", [5, 6, 7], _params(2), OutputKind.FINAL_ONLY)
    llm.add_request("delta", prompt, _params(5, n=2), OutputKind.DELTA)
    steps = _run(llm)
    outputs = defaultdict(list)
    for step in steps:
        for out in step.outputs:
            outputs[out.request_id].append(out)
    # One output per step in which a sequence of the streamed request advanced (its two
    # sequences' prompts are prefilled in different steps), the last one finished.
    assert len(outputs["streamed"]) >= 5 and [o.finished for o in outputs["streamed"]][-2:] == [False, True]
    for rid in ("final", "final-short"):
        assert len(outputs[rid]) == 1 and outputs[rid][0].finished
    streamed, final = outputs["streamed"][-1], outputs["final"][0]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in streamed.outputs]
    assert [c.text for c in final.outputs] == [c.text for c in streamed.outputs]
    assert [c.finish_reason for c in final.outputs] == ["length", "length"]
    for i in range(2):
        assert sum((o.outputs[i].token_ids for o in outputs["delta"]), []) == streamed.outputs[i].token_ids
        assert "".join(o.outputs[i].text for o in outputs["delta"]) == streamed.outputs[i].text
    timings = _by_request(steps)
    assert _one(timings["final"], "e2e_latency") > 0 and _one(timings["final-short"], "time_to_first_token") > 0
    assert not llm.engine._groups and not len(llm.outputs), "finished requests are forgotten"
