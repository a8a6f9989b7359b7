"""The scheduler's plan is all the runner (every tensor-parallel rank alike) receives: plain,
picklable data that sends a request's fixed parts once and then only what changed, and the
runner's copies rebuilt from it equal the scheduler's requests through prefill, decode,
preemption, finish and an id reused."""
from __future__ import annotations

import pickle

from vgraph.config import CacheConfig, SchedulerConfig
from vgraph.core.outputs import ModelRunnerOutput
from vgraph.core.request import Request
from vgraph.core.scheduler import Scheduler
from vgraph.sampling_params import SamplingParams
from vgraph.worker.runner_requests import RunnerRequests

BS = 4


def _scheduler(num_blocks: int = 16, budget: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget),
                     CacheConfig(block_size=BS, enable_prefix_caching=False), num_blocks, max_model_len=64)


def _step(s: Scheduler, copies: RunnerRequests, token: int = 9, samples: bool = False):
    """One step whose plan crosses a pickle (as it does to a rank), every sampled token ``token``.
    ``samples``: the copies take their own samples at once, as a sampling rank's do; without,
    they stand for a rank that samples nothing (an earlier pipeline stage) and learn the tokens
    from the plans alone."""
    sched = s.schedule()
    plan = pickle.loads(pickle.dumps(sched.plan))
    step = copies.apply(plan)
    for item, chunk in zip(sched.scheduled, step.chunks, strict=True):
        assert chunk.request.block_ids == item.request.block_ids
        assert chunk.request.output_token_ids == item.request.output_token_ids
        assert chunk.token_ids == item.request.all_token_ids[item.start_position:item.end_position]
        assert chunk.produces_token == item.produces_token
    sampled = {x.request.request_id: token for x in sched.samples}
    if samples:
        for chunk in step.chunks:
            if chunk.produces_token:
                chunk.request.output_token_ids.append(sampled[chunk.request.request_id])
    s.update(sched, ModelRunnerOutput(sampled))
    return sched.plan


def test_fixed_parts_go_once_then_only_deltas():
    s, copies = _scheduler(), RunnerRequests()
    s.add_request(Request("a", list(range(3, 9)), SamplingParams(max_tokens=8, ignore_eos=True, seed=1)))
    first = _step(s, copies)
    assert [p.request_id for p in first.new] == ["a"] and first.chunks[0].new_blocks == [0, 1]
    assert copies.requests["a"].generator is not None, "a seeded request's generator lives with the runner"
    second = _step(s, copies)  # decode of position 6: same blocks, one new output token
    assert second.new == [] and second.chunks[0].new_output_tokens == [9]
    assert (second.chunks[0].blocks_from, second.chunks[0].new_blocks) == (2, [])
    third = _step(s, copies)  # position 7 still in block 1; position 8 takes a new block next
    fourth = _step(s, copies)
    assert third.chunks[0].new_blocks == [] and fourth.chunks[0].new_blocks == [2]
    assert fourth.chunks[0].blocks_from == 2, "only the block past what the runner has"


def test_preemption_resends_the_table_and_keeps_the_generator():
    s, copies = _scheduler(num_blocks=5), RunnerRequests()
    s.add_request(Request("old", [1] * 8, SamplingParams(max_tokens=10, ignore_eos=True)))
    s.add_request(Request("new", [2] * 8, SamplingParams(max_tokens=10, ignore_eos=True, seed=3)))
    generator = None
    while s.num_preemptions == 0:
        _step(s, copies)
        generator = generator or copies.requests["new"].generator
    assert copies.requests["new"].generator is generator, "a preempted request keeps its runner copy"
    plan = _step(s, copies)
    while "new" not in [c.request_id for c in plan.chunks]:
        plan = _step(s, copies)
    chunk = next(c for c in plan.chunks if c.request_id == "new")
    assert chunk.start_position == 0 and chunk.blocks_from == 0, "readmitted on new blocks: the whole table"
    assert plan.new == [] and copies.requests["new"].generator is generator
    while s.has_unfinished_requests():
        _step(s, copies)


def test_finished_requests_are_forgotten_and_an_id_may_come_back():
    s, copies = _scheduler(), RunnerRequests()
    s.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=1)))
    _step(s, copies)
    assert not s.has_unfinished_requests() and "a" in copies.requests
    assert s.schedule().plan.chunks == [], "an empty step: the runner is not called"
    s.add_request(Request("a", [8, 9], SamplingParams(max_tokens=2)))
    plan = _step(s, copies)
    assert plan.forget == ["a"] and [p.prompt_token_ids for p in plan.new] == [[8, 9]]
    assert copies.requests["a"].prompt_token_ids == [8, 9]


def test_aborted_before_it_ran_is_never_sent():
    s, copies = _scheduler(), RunnerRequests()
    s.add_request(Request("gone", [5, 6, 7], SamplingParams(max_tokens=3)))
    s.abort_requests(["gone"])
    s.add_request(Request("kept", [5, 6, 7], SamplingParams(max_tokens=3)))
    plan = _step(s, copies)
    assert plan.forget == [] and [p.request_id for p in plan.new] == ["kept"]


def test_a_sampling_rank_keeps_its_own_tokens_once():
    """The plan repeats the tokens the scheduler learnt from the step: they land on the copy's
    own samples (same place, same ids), never after them."""
    s, copies = _scheduler(), RunnerRequests()
    s.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True)))
    tokens = iter([11, 12, 13, 14, 15])
    while s.has_unfinished_requests():
        _step(s, copies, next(tokens), samples=True)
    assert copies.requests["a"].output_token_ids == [11, 12, 13, 14, 15]
