"""Prefill-only requests in the scheduler (``max_tokens=0``, pooling) and the prefix-cache
bypass of requests that need every prompt position (prompt logprobs, pooling)."""
from __future__ import annotations

from vgraph.config import CacheConfig, SchedulerConfig
from vgraph.core.request import Request, RequestStatus
from vgraph.core.scheduler import Scheduler
from vgraph.sampling_params import SamplingParams
from vgraph.core.outputs import PoolingState
from vgraph.core.outputs import ModelRunnerOutput

BS = 4


def _scheduler(budget: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), CacheConfig(block_size=BS),
                     num_blocks=64, max_model_len=128)


def _run(scheduler: Scheduler) -> list[tuple[str, int, bool]]:
    """Steps until idle with a fake sampler; returns (id, tokens, sampled) per scheduled chunk."""
    seen = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        seen += [(s.request.request_id, s.num_new_tokens, s.produces_token) for s in out.scheduled]
        scheduler.update(out, ModelRunnerOutput({s.request.request_id: 7 for s in out.samples}))
    return seen


def test_max_tokens_zero_finishes_after_its_chunked_prompt_without_sampling():
    scheduler = _scheduler()
    request = Request("p", list(range(20, 40)), SamplingParams(max_tokens=0))
    scheduler.add_request(request)
    seen = _run(scheduler)
    assert seen == [("p", 8, False), ("p", 8, False), ("p", 4, False)]
    assert request.status is RequestStatus.FINISHED_LENGTH and request.output_token_ids == []
    assert scheduler.block_pool.num_free_blocks == 64


def test_requests_needing_every_position_skip_the_prefix_cache_but_publish():
    scheduler = _scheduler(budget=64)
    prompt = list(range(20, 37))  # 4 full blocks + 1 token
    scheduler.add_request(Request("warm", prompt, SamplingParams(max_tokens=1)))
    _run(scheduler)
    scored = Request("scored", prompt, SamplingParams(max_tokens=1), num_prompt_logprobs=0)
    pooled = Request("pooled", prompt, SamplingParams(max_tokens=0), pooling=PoolingState("mean", True))
    plain = Request("plain", prompt, SamplingParams(max_tokens=1))
    for r in (scored, pooled, plain):
        scheduler.add_request(r)
    first = scheduler.schedule()
    assert {s.request.request_id: s.num_new_tokens for s in first.scheduled} == {"scored": 17, "pooled": 17,
                                                                                "plain": 1}
    assert plain.num_cached_prefix_tokens == 16 and scored.num_cached_prefix_tokens == 0
