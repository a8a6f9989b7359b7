"""What one engine step hands its callers: the step (deltas, timings, state) and, once the output
processor has built outputs from it, the step as clients pass it on; per-request timings and the
engine's state, as typed objects.

This is the engine -> server contract. The engine stamps each request's times where the work
happens (arrival, first scheduling, tokens, finish) and derives these from them, so its users
(the engine client, the metrics) read them and never reach into the scheduler or keep a second
set of clocks. Times are ``time.monotonic()`` seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from .outputs import EmbeddingRequestOutput, OutputDelta, RequestOutput


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state; counters are totals since the engine started."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0 to 1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens found there
    num_preemptions: int = 0
    # Speculative decoding (vLLM's spec_decode counters): chunks that carried guesses, the
    # guesses, those accepted, and accepted per guess position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()


@dataclass(slots=True)
class RequestTiming:
    """What one request (all of its ``n`` sequences) did in one step, for metrics.

    Not frozen: one is built for every request in every step, and a frozen dataclass's
    ``__init__`` costs five times a plain one's.

    A request appears in a step only when something happened to it: first scheduled (queue
    time), new tokens, finished or aborted. Each latency is reported once, in the step it
    became known.
    """

    request_id: str
    num_prompt_tokens: int
    num_new_tokens: int = 0  # over all of the request's sequences
    time_to_first_token: Optional[float] = None  # arrival to first token, in the step that made it
    inter_token_latency: Optional[float] = None  # since the request's previous token
    queue_time: Optional[float] = None  # arrival to first scheduling, in the step that scheduled it
    e2e_latency: Optional[float] = None  # arrival to finish (not for aborts)
    finish_reasons: list[str] = field(default_factory=list)  # one per sequence, once finished


@dataclass(frozen=True)
class EngineStep:
    """The result of ``LLMEngine.step()``: what each request that advanced gained, the timings of
    the requests something happened to, and the engine's state after the step."""

    deltas: list[OutputDelta]
    timings: list[RequestTiming]
    stats: EngineStats


@dataclass(frozen=True)
class StepOutput:
    """One step as a client hands it on (to the metrics, the data-parallel router): the outputs
    the ``OutputProcessor`` built from the step's deltas, with its timings and state."""

    outputs: list[RequestOutput | EmbeddingRequestOutput]
    timings: list[RequestTiming]
    stats: EngineStats


def aggregate_stats(per_replica: Sequence[EngineStats]) -> EngineStats:
    """One server's state from its replicas': counts and counters add up; KV usage is the
    fraction of all blocks in use, the mean of the replicas' (their pools are equal)."""
    return EngineStats(num_running=sum(s.num_running for s in per_replica),
                       num_waiting=sum(s.num_waiting for s in per_replica),
                       kv_usage=sum(s.kv_usage for s in per_replica) / max(1, len(per_replica)),
                       prefix_cache_queries=sum(s.prefix_cache_queries for s in per_replica),
                       prefix_cache_hits=sum(s.prefix_cache_hits for s in per_replica),
                       num_preemptions=sum(s.num_preemptions for s in per_replica),
                       spec_num_drafts=sum(s.spec_num_drafts for s in per_replica),
                       spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in per_replica),
                       spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in per_replica),
                       spec_accepted_per_position=tuple(
                           map(sum, zip(*(s.spec_accepted_per_position for s in per_replica)))))
