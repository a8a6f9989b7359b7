"""Scheduler behaviour, driven by a fake model that reads its inputs back from paged "KV".

The fake model writes every scheduled token id into the slot its block table names and, when a
token is due, reads the whole sequence back through the block table and returns a
deterministic function of it. Outputs therefore equal the reference only if block tables,
positions, prefix-cache sharing, eviction and preemption bookkeeping are all right.
"""
from __future__ import annotations

import random
from typing import Callable, Optional

import pytest

from vgraph.config import CacheConfig, SchedulerConfig
from vgraph.core.request import Request, RequestStatus
from vgraph.core.scheduler import Scheduler, SchedulerOutput
from vgraph.sampling_params import SamplingParams
from vgraph.worker.dispatch import BatchShape
from vgraph.worker.runner_requests import RunnerRequest, RunnerRequests
from vgraph.core.outputs import ModelRunnerOutput

BS = 4
VOCAB = 50


def next_token(sequence: list[int]) -> int:
    """The fake model: a deterministic function of the entire sequence so far."""
    return (sum((i + 1) * t for i, t in enumerate(sequence)) * 2654435761 >> 7) % VOCAB + 10


def reference(prompt: list[int], max_tokens: int, max_len: int = 1 << 30) -> list[int]:
    """What a request generates; ``max_len`` caps prompt + output (max_model_len, pool size)."""
    sequence = list(prompt)
    for _ in range(min(max_tokens, max_len - len(prompt))):
        sequence.append(next_token(sequence))
    return sequence[len(prompt):]


class FakeModel:
    """Paged token store standing in for the KV cache; checks what the scheduler asks of it."""

    def __init__(self, num_blocks: int) -> None:
        self.slots: list[list[Optional[int]]] = [[None] * BS for _ in range(num_blocks)]
        self.copies = RunnerRequests()  # the runner's side: only the plans reach it, in order

    def execute(self, output: SchedulerOutput, ahead: bool = False) -> dict[str, int]:
        """Runs the step from the scheduler's plain plan alone, as the runner does (its samples
        join its copies at once), and checks that the runner's copies follow the scheduler's
        requests (preemption included). ``ahead``: the step was scheduled before the previous
        step's tokens reached the scheduler, so a copy may hold one token more."""
        step = self.copies.apply(output.plan)
        assert len(step.chunks) == len(output.scheduled)
        for item, chunk in zip(output.scheduled, step.chunks):
            request, copy = item.request, chunk.request
            assert item.start_position == chunk.start_position
            assert item.start_position + item.num_new_tokens == request.num_computed_tokens or ahead
            known = request.output_token_ids
            assert copy.output_token_ids[:len(known)] == known
            assert len(copy.output_token_ids) - len(known) <= (1 if ahead else 0)
            assert chunk.produces_token == item.produces_token
            assert len(copy.block_ids) * BS >= chunk.start_position + chunk.num_new_tokens
            for offset, token in enumerate(chunk.token_ids):
                position = chunk.start_position + offset
                self.slots[copy.block_ids[position // BS]][position % BS] = token
        sampled = {c.request.request_id: self._sample(c.request, c.start_position + c.num_new_tokens)
                   for c in step.chunks if c.produces_token}
        for chunk in step.chunks:  # the runner's copy takes its own samples at once
            if chunk.produces_token:
                chunk.request.output_token_ids.append(sampled[chunk.request.request_id])
        return sampled

    def _sample(self, request: RunnerRequest, length: int) -> int:
        sequence = [self.slots[request.block_ids[p // BS]][p % BS] for p in range(length)]
        assert sequence == request.prompt_token_ids + request.output_token_ids, \
            "KV read back through the block table is wrong"
        return next_token(sequence)


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 16,
                   chunked: bool = True, caching: bool = True, max_model_len: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks, max_model_len)


def make_request(rid: str, prompt: list[int], max_tokens: Optional[int] = 8, **params) -> Request:
    eos = params.pop("eos", frozenset())
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos)


def step(scheduler: Scheduler, model: FakeModel) -> tuple[SchedulerOutput, list[Request]]:
    output = scheduler.schedule()
    config = scheduler.config
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.scheduled) <= config.max_num_seqs
    assert scheduler.num_running <= config.max_num_seqs
    return output, scheduler.update(output, ModelRunnerOutput(model.execute(output)))


def run(scheduler: Scheduler, model: FakeModel, max_steps: int = 10_000,
        on_step: Callable[[SchedulerOutput], None] = lambda _: None) -> int:
    steps = 0
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler, model)
        on_step(output)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def run_overlapped(scheduler: Scheduler, model: FakeModel, max_steps: int = 10_000) -> int:
    """The engine's overlapped loop: step N+1 is scheduled (and run: the fake model is
    synchronous, which only makes the check stricter) before step N's results are applied."""
    in_flight: list[tuple[SchedulerOutput, dict[str, int]]] = []
    steps = 0
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < 2:
            output = scheduler.schedule()
            if not output.scheduled:
                break
            in_flight.append((output, model.execute(output, ahead=True)))
        if in_flight:
            output, sampled = in_flight.pop(0)
            scheduler.update(output, ModelRunnerOutput(sampled))
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def assert_all_free(scheduler: Scheduler) -> None:
    pool = scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(pool.ref_cnt(b) == 0 for b in range(pool.num_blocks))
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0


def random_workload(seed: int, num_requests: int = 12) -> list[tuple[list[int], int]]:
    """Prompts drawn from a few shared prefixes so the prefix cache gets hits."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))] for _ in range(3)]
    workload = []
    for _ in range(num_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        workload.append((prompt, rng.randrange(1, 20)))
    return workload


# -- end-to-end correctness under every mode --------------------------------------------------

@pytest.mark.parametrize("num_blocks,budget,max_num_seqs,chunked,caching", [
    (128, 512, 64, True, True),    # everything fits
    (128, 16, 64, True, True),     # chunked prefill, mixed batches
    (128, 64, 3, True, False),     # few seats, no prefix cache
    (128, 64, 64, False, True),    # whole prompts only
    (16, 32, 64, True, True),      # pool too small: preemption and eviction
    (13, 8, 64, True, True),       # tiny pool and tiny budget
    (16, 64, 64, False, False),    # preemption without chunking or caching
])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
def test_outputs_match_reference(num_blocks, budget, max_num_seqs, chunked, caching, seed, overlapped):
    scheduler = make_scheduler(num_blocks, budget, max_num_seqs, chunked, caching)
    scheduler.schedule_ahead = overlapped
    model = FakeModel(num_blocks)
    requests = [make_request(f"r{i}", prompt, max_tokens)
                for i, (prompt, max_tokens) in enumerate(random_workload(seed))]
    for request in requests:
        scheduler.add_request(request)
    (run_overlapped if overlapped else run)(scheduler, model)
    if num_blocks < 20:
        assert scheduler.num_preemptions > 0  # the small pools do exercise preemption
    for request in requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == reference(request.prompt_token_ids, request.sampling_params.max_tokens,
                                                     num_blocks * BS)
        assert request.block_ids == []
    assert_all_free(scheduler)


# -- chunked prefill and batching -----------------------------------------------------------

def test_chunked_prefill_splits_prompt_and_mixes_with_decodes():
    scheduler = make_scheduler(budget=17)
    model = FakeModel(64)
    decoder = make_request("decoder", [1, 2, 3], max_tokens=20)
    scheduler.add_request(decoder)
    step(scheduler, model)  # decoder's prefill; it is now decoding
    long = make_request("long", list(range(50)), max_tokens=4)
    scheduler.add_request(long)
    chunks = []
    for _ in range(4):
        output, _ = step(scheduler, model)
        rows = {s.request.request_id: s for s in output.scheduled}
        assert rows["decoder"].num_new_tokens == 1 and rows["decoder"].produces_token
        chunks.append(rows["long"].num_new_tokens)
        assert not BatchShape.of_step(output.plan).uniform_decode
        assert rows["long"].produces_token == (len(chunks) == 4)
    assert chunks == [16, 16, 16, 2]
    assert long.num_computed_tokens == 50 and len(long.output_token_ids) == 1
    output, _ = step(scheduler, model)
    assert BatchShape.of_step(output.plan).uniform_decode and output.num_batched_tokens == 2
    run(scheduler, model)
    assert long.output_token_ids == reference(long.prompt_token_ids, 4)
    assert decoder.output_token_ids == reference(decoder.prompt_token_ids, 20)
    assert_all_free(scheduler)


def test_whole_prompts_only_without_chunked_prefill():
    scheduler = make_scheduler(budget=20, chunked=False)
    model = FakeModel(64)
    first, second = make_request("a", range(12)), make_request("b", range(12))
    scheduler.add_request(first)
    scheduler.add_request(second)
    output, _ = step(scheduler, model)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 12)]
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        scheduler.add_request(make_request("c", range(21)))


def test_max_num_seqs_is_respected():
    scheduler = make_scheduler(max_num_seqs=2)
    model = FakeModel(64)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 3, max_tokens=3))
    output, _ = step(scheduler, model)
    assert len(output.scheduled) == 2 and scheduler.num_waiting == 3
    seen_running = []
    run(scheduler, model, on_step=lambda out: seen_running.append(len(out.scheduled)))
    assert max(seen_running) == 2
    assert_all_free(scheduler)


def test_prefix_cache_hits_across_requests():
    scheduler = make_scheduler()
    model = FakeModel(64)
    prompt = list(range(1, 19))  # 4 full blocks + 2 tokens
    first = make_request("a", prompt, max_tokens=2)
    scheduler.add_request(first)
    run(scheduler, model)
    second = make_request("b", prompt, max_tokens=2)
    scheduler.add_request(second)
    output, _ = step(scheduler, model)
    assert second.num_cached_prefix_tokens == 16
    assert output.scheduled[0].start_position == 16 and output.scheduled[0].num_new_tokens == 2
    run(scheduler, model)
    assert second.output_token_ids == first.output_token_ids
    pool = scheduler.block_pool
    assert pool.prefix_cache_hits == 16 and pool.prefix_cache_queries == 36
    assert_all_free(scheduler)


def test_concurrent_requests_share_prefix_blocks():
    scheduler = make_scheduler()
    model = FakeModel(64)
    prefix = list(range(1, 9))
    scheduler.add_request(make_request("a", prefix + [20, 21], max_tokens=4))
    step(scheduler, model)
    second = make_request("b", prefix + [30], max_tokens=4)
    scheduler.add_request(second)
    step(scheduler, model)
    first = scheduler.requests["a"]
    assert second.block_ids[:2] == first.block_ids[:2]
    assert [scheduler.block_pool.ref_cnt(b) for b in first.block_ids[:2]] == [2, 2]
    run(scheduler, model)
    assert second.output_token_ids == reference(second.prompt_token_ids, 4)
    assert_all_free(scheduler)


# -- preemption -----------------------------------------------------------------------------

def test_preemption_sends_newest_to_front_and_it_completes():
    # 6 blocks of 4 = 24 slots: two requests of 8 prompt tokens fit, but not 2 x (8 + 10).
    # Two seats, so "queued" is still waiting when "new" is preempted and must queue behind it.
    scheduler = make_scheduler(num_blocks=6, caching=False, max_num_seqs=2)
    model = FakeModel(6)
    old = make_request("old", [1] * 8, max_tokens=10)
    new = make_request("new", [2] * 8, max_tokens=10)
    queued = make_request("queued", [3] * 3, max_tokens=2)
    for request in (old, new, queued):
        scheduler.add_request(request)
    preemption_steps = []
    while scheduler.num_preemptions == 0:
        output, _ = step(scheduler, model)
        if output.preempted:
            preemption_steps.append(output)
    output = preemption_steps[0]
    assert output.preempted == [new]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.block_ids == []
    assert list(scheduler.waiting) == [new, queued] and new.num_preemptions == 1
    assert [s.request for s in output.scheduled] == [old]  # no admissions in this step
    generated_before = list(new.output_token_ids)
    assert generated_before  # it had generated tokens, which it keeps
    run(scheduler, model)
    assert new.output_token_ids[:len(generated_before)] == generated_before
    for request in (old, new, queued):
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == reference(request.prompt_token_ids, request.sampling_params.max_tokens)
    assert scheduler.num_preemptions >= 1
    assert_all_free(scheduler)


def test_preempted_request_recomputes_prompt_and_output():
    scheduler = make_scheduler(num_blocks=5, caching=False, budget=64)
    model = FakeModel(5)
    old = make_request("old", [1] * 8, max_tokens=9)
    new = make_request("new", [2] * 7, max_tokens=6)
    scheduler.add_request(old)
    scheduler.add_request(new)
    while not new.status is RequestStatus.PREEMPTED:
        step(scheduler, model)
    num_known = new.num_tokens
    # It comes back as one prefill of prompt + outputs that samples the next token.
    while True:
        output, _ = step(scheduler, model)
        rows = [s for s in output.scheduled if s.request is new]
        if rows:
            break
    assert rows[0].start_position == 0 and rows[0].num_new_tokens == num_known and rows[0].produces_token
    run(scheduler, model)
    assert new.output_token_ids == reference(new.prompt_token_ids, 6)
    assert_all_free(scheduler)


def _run_until_the_newest_is_preempted(scheduler: Scheduler) -> tuple["FakeModel", Request, Request]:
    """Two 8-token prompts in a 6-block pool: steps until the newer one is preempted."""
    model = FakeModel(6)
    old = make_request("old", [1] * 8, max_tokens=10)
    new = make_request("new", [2] * 8, max_tokens=10)
    scheduler.add_request(old)
    scheduler.add_request(new)
    while new.status is not RequestStatus.PREEMPTED:
        step(scheduler, model)
    return model, old, new


def test_cached_prefix_tokens_are_those_of_the_first_admission():
    """A re-admission after preemption finds the request's own freed blocks in the prefix
    cache; the cached prompt tokens reported stay those found when it was first admitted."""
    scheduler = make_scheduler(num_blocks=6, caching=True, max_num_seqs=2)
    model, old, new = _run_until_the_newest_is_preempted(scheduler)
    while True:
        output, _ = step(scheduler, model)
        rows = [s for s in output.scheduled if s.request is new]
        if rows:
            break
    assert rows[0].start_position > 0, "the re-admission hit its own cached blocks"
    assert new.num_cached_prefix_tokens == 0
    run(scheduler, model)
    assert new.output_token_ids == reference(new.prompt_token_ids, 10)
    assert_all_free(scheduler)


def test_single_request_bigger_than_pool_stops_at_capacity():
    scheduler = make_scheduler(num_blocks=3, max_model_len=100)  # 12 slots
    model = FakeModel(3)
    request = make_request("r", range(1, 6), max_tokens=50)
    scheduler.add_request(request)
    run(scheduler, model)
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 12
    assert scheduler.num_preemptions == 0
    assert_all_free(scheduler)


# -- stopping -------------------------------------------------------------------------------

def first_tokens(prompt: list[int], n: int) -> list[int]:
    return reference(prompt, n)


def test_eos_stops_and_min_tokens_defers_it():
    prompt = [4, 5, 6]
    tokens = first_tokens(prompt, 6)
    eos = frozenset({tokens[0], tokens[3]})
    scheduler = make_scheduler()
    model = FakeModel(64)
    plain = make_request("plain", prompt, max_tokens=6, eos=eos)
    delayed = make_request("delayed", prompt, max_tokens=6, eos=eos, min_tokens=2)
    ignoring = make_request("ignoring", prompt, max_tokens=6, eos=eos, ignore_eos=True)
    for request in (plain, delayed, ignoring):
        scheduler.add_request(request)
    run(scheduler, model)
    assert plain.output_token_ids == tokens[:1] and plain.status is RequestStatus.FINISHED_STOPPED
    assert plain.stop_reason is None and plain.finish_reason == "stop"
    first_eos_after_min = next(i for i, t in enumerate(tokens) if t in eos and i + 1 >= 2)
    assert delayed.output_token_ids == tokens[:first_eos_after_min + 1]
    assert delayed.status is RequestStatus.FINISHED_STOPPED
    assert ignoring.output_token_ids == tokens and ignoring.status is RequestStatus.FINISHED_LENGTH
    assert_all_free(scheduler)


def test_stop_token_ids_set_stop_reason():
    prompt = [7, 8, 9, 10, 11]
    tokens = first_tokens(prompt, 5)
    scheduler = make_scheduler()
    model = FakeModel(64)
    request = make_request("r", prompt, max_tokens=5, stop_token_ids=[tokens[2]])
    scheduler.add_request(request)
    run(scheduler, model)
    stop_at = tokens.index(tokens[2])
    assert request.output_token_ids == tokens[:stop_at + 1]
    assert request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == tokens[2]


def test_max_tokens_and_max_model_len_finish_with_length():
    scheduler = make_scheduler(max_model_len=12)
    model = FakeModel(64)
    short = make_request("short", [1, 2, 3], max_tokens=4)
    capped = make_request("capped", [1, 2, 3, 4, 5], max_tokens=None)
    scheduler.add_request(short)
    scheduler.add_request(capped)
    returned: list[set[str]] = []
    while scheduler.has_unfinished_requests():
        _, new_tokens = step(scheduler, model)
        returned.append({r.request_id for r in new_tokens})
    assert len(short.output_token_ids) == 4 and short.status is RequestStatus.FINISHED_LENGTH
    assert capped.num_tokens == 12 and capped.finish_reason == "length"
    assert sum("short" in ids for ids in returned) == 4  # finished requests are returned too
    assert_all_free(scheduler)


def test_logprobs_are_recorded():
    scheduler = make_scheduler()
    model = FakeModel(64)
    request = make_request("r", [1, 2, 3], max_tokens=3, logprobs=1)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        sampled = model.execute(output)
        scheduler.update(output, ModelRunnerOutput(sampled, {rid: {tok: -0.5} for rid, tok in sampled.items()}))
    assert request.logprobs == [{t: -0.5} for t in request.output_token_ids]


def test_finish_requests_for_stop_strings():
    scheduler = make_scheduler()
    model = FakeModel(64)
    request = make_request("r", [1, 2, 3], max_tokens=10)
    scheduler.add_request(request)
    step(scheduler, model)
    request.stop_reason = "###"
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_STOPPED)
    assert request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == "###"
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.schedule().scheduled
    assert_all_free(scheduler)
    with pytest.raises(ValueError):
        scheduler.finish_requests(["x"], RequestStatus.RUNNING)


# -- abort ------------------------------------------------------------------------------------

def test_abort_at_every_state():
    scheduler = make_scheduler(num_blocks=8, budget=8, max_num_seqs=2)
    model = FakeModel(8)
    waiting = make_request("waiting", [9] * 4, max_tokens=4)
    prefilling = make_request("prefilling", list(range(1, 13)), max_tokens=4)
    scheduler.add_request(prefilling)
    step(scheduler, model)  # 8 of 12 prompt tokens
    assert 0 < prefilling.num_computed_tokens < prefilling.num_prompt_tokens
    decoding = make_request("decoding", [5, 6], max_tokens=30)
    scheduler.add_request(decoding)
    scheduler.add_request(waiting)
    step(scheduler, model)
    assert decoding.status is RequestStatus.RUNNING and decoding.output_token_ids
    assert waiting.status is RequestStatus.WAITING  # no free seat

    scheduler.abort_requests(["prefilling", "waiting"])
    assert prefilling.status is RequestStatus.FINISHED_ABORTED and prefilling.block_ids == []
    assert waiting.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.num_waiting == 0 and scheduler.num_running == 1

    # Aborted between schedule() and update(): update skips it and nothing leaks.
    output = scheduler.schedule()
    sampled = model.execute(output)
    scheduler.abort_requests(["decoding"])
    assert scheduler.update(output, ModelRunnerOutput(sampled)) == []
    assert decoding.status is RequestStatus.FINISHED_ABORTED
    scheduler.abort_requests(["decoding", "unknown"])  # finished or unknown: ignored
    assert_all_free(scheduler)


def test_abort_preempted_request():
    scheduler = make_scheduler(num_blocks=6, caching=False)
    model, old, new = _run_until_the_newest_is_preempted(scheduler)
    scheduler.abort_requests(["new"])
    assert new.status is RequestStatus.FINISHED_ABORTED and scheduler.num_waiting == 0
    run(scheduler, model)
    assert old.output_token_ids == reference(old.prompt_token_ids, 10)
    assert_all_free(scheduler)


@pytest.mark.parametrize("abort_at_step", range(0, 40, 3))
def test_abort_everything_mid_flight_leaks_nothing(abort_at_step):
    scheduler = make_scheduler(num_blocks=14, budget=12)
    model = FakeModel(14)
    requests = [make_request(f"r{i}", prompt, max_tokens)
                for i, (prompt, max_tokens) in enumerate(random_workload(abort_at_step, 8))]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(abort_at_step):
        if scheduler.has_unfinished_requests():
            step(scheduler, model)
    scheduler.abort_requests(r.request_id for r in requests)
    assert not scheduler.has_unfinished_requests()
    assert_all_free(scheduler)


# -- validation -----------------------------------------------------------------------------

def test_add_request_validation():
    scheduler = make_scheduler(num_blocks=4, max_model_len=32)  # pool holds 16 tokens
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("a", range(32)))
    with pytest.raises(ValueError, match="KV cache"):
        scheduler.add_request(make_request("b", range(16)))
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.add_request(make_request("c", []))
    scheduler.add_request(make_request("d", range(15)))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("d", range(3)))
    assert scheduler.num_waiting == 1


def test_long_prefill_token_threshold_caps_each_prompt_chunk():
    """vLLM's ``long_prefill_token_threshold``: no prompt chunk above it in one step, however much
    budget is left; decodes are untouched, and without chunked prefill a prompt runs whole."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=10),
                  CacheConfig(block_size=16), 32, max_model_len=128)
    s.add_request(make_request("a", list(range(1, 26)), max_tokens=4))
    s.add_request(make_request("b", list(range(1, 6)), max_tokens=4))
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10), ("b", 5)]
    s.update(out, ModelRunnerOutput({"b": 7}))
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10), ("b", 1)]
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    whole = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=False,
                                      long_prefill_token_threshold=10), CacheConfig(block_size=16), 32,
                      max_model_len=128)
    whole.add_request(make_request("a", list(range(1, 26)), max_tokens=4))
    assert [x.num_new_tokens for x in whole.schedule().scheduled] == [25]
