"""Prometheus metrics, named after vLLM's with a ``vgraph:`` prefix.

Two kinds of series, fed two ways:

- the engine's state (requests running/waiting, KV cache usage, prefix-cache and preemption
  counters) is read from the latest ``EngineStats`` snapshot at scrape time by a custom
  collector, so the numbers are never stale and cost nothing between scrapes;
- per-request series (token counters, successes by finish reason, latency histograms) are
  updated from the ``RequestTiming``s of each engine step's ``StepOutput``.

The three state gauges are also exported under the names load-aware routers scrape from
vLLM-compatible model servers (the Kubernetes Gateway API Inference Extension's endpoint picker:
``vllm:num_requests_waiting`` for its queue depth, ``vllm:kv_cache_usage_perc`` and the older
``vllm:gpu_cache_usage_perc`` for KV-cache pressure, ``vllm:num_requests_running``), so such a
router balances ``vgraph serve`` replicas with no per-runtime configuration.

With data-parallel replicas (``--data-parallel-size``), vgraph's own engine-state series carry
an ``engine`` label, one series per replica (``engine="0"`` alone with one replica), so a
dashboard sees how the router spreads the load; the router-facing ``vllm:`` gauges stay one
series per server, with the server's totals (KV usage: the fraction of all replicas' blocks in
use), because a load-aware router scores a server, not its replicas, and takes one sample per
name. The per-request series (tokens, latencies) are server-level, as the server sees them.

Each server gets its own ``CollectorRegistry``, so several apps in one process (tests) do not
collide in the global registry.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.stats import EngineStats, StepOutput, aggregate_stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


_OWN_GAUGES = (("num_requests_running", "Requests in the running batch.", "num_running"),
               ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
               ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", "kv_usage"))
# The older name routers read for KV usage, next to the three above under vllm: names.
_ROUTER_ONLY = (("gpu_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1); the older name "
                 "routers read.", "kv_usage"),)
_COUNTERS = (("vgraph:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
             ("vgraph:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
             ("vgraph:num_preemptions", "Requests preempted (their KV recomputed later).", "num_preemptions"),
             ("vllm:spec_decode_num_drafts", "Speculative decoding: chunks that carried guessed tokens.",
              "spec_num_drafts"),
             ("vllm:spec_decode_num_draft_tokens", "Speculative decoding: guessed tokens verified.",
              "spec_num_draft_tokens"),
             ("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: guessed tokens accepted.",
              "spec_num_accepted_tokens"))


class _EngineStateCollector(Collector):
    """Gauges and engine-side counters from the newest stats snapshots: vgraph's per replica
    (label ``engine``), the router-facing ``vllm:`` gauges per server."""

    def __init__(self, replica_stats: Callable[[], Sequence[EngineStats]], model_name: str) -> None:
        self._stats = replica_stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        per_replica = list(self._stats())
        labels = ["model_name", "engine"]
        for name, doc, attr in _OWN_GAUGES:
            yield self._family(GaugeMetricFamily, f"vgraph:{name}", doc, attr, per_replica)
        for name, doc, attr in _COUNTERS:
            yield self._family(CounterMetricFamily, name, doc, attr, per_replica)
        yield self._per_position(per_replica)
        server = aggregate_stats(per_replica)
        for name, doc, attr in (*_OWN_GAUGES, *_ROUTER_ONLY):
            gauge = GaugeMetricFamily(f"vllm:{name}", f"{doc} The server's total over its replicas (KV usage: "
                                      "of all their blocks), for load-aware routers.", labels=labels[:1])
            gauge.add_metric([self._model], float(getattr(server, attr)))
            yield gauge

    def _per_position(self, per_replica: list[EngineStats]) -> Metric:
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Speculative decoding: guessed tokens accepted at each guess position.",
                                     labels=["model_name", "engine", "position"])
        for index, stats in enumerate(per_replica):
            for position, count in enumerate(stats.spec_accepted_per_position):
                family.add_metric([self._model, str(index), str(position)], float(count))
        return family

    def _family(self, kind: type, name: str, doc: str, attr: str, per_replica: list[EngineStats]) -> Metric:
        family = kind(name, doc, labels=["model_name", "engine"])
        for index, stats in enumerate(per_replica):
            family.add_metric([self._model, str(index)], float(getattr(stats, attr)))
        return family


class ServerMetrics:
    """The registry behind ``/metrics`` and the hook that feeds it from engine steps."""

    def __init__(self, model_name: str, replica_stats: Callable[[], Sequence[EngineStats]]) -> None:
        """``replica_stats``: each engine replica's newest stats (one item without data parallelism)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStateCollector(replica_stats, model_name))
        self._model = model_name
        common = {"labelnames": ["model_name"], "registry": self.registry}
        self.prompt_tokens = Counter("vgraph:prompt_tokens", "Prompt tokens of requests that started.", **common)
        self.generation_tokens = Counter("vgraph:generation_tokens", "Generated tokens.", **common)
        self.request_success = Counter("vgraph:request_success", "Finished sequences by finish reason.",
                                       labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("vgraph:time_to_first_token_seconds", "Submission to first token.",
                              buckets=_TTFT_BUCKETS, **common)
        self.itl = Histogram("vgraph:inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=_ITL_BUCKETS, **common)
        self.e2e = Histogram("vgraph:e2e_request_latency_seconds", "Submission to finish.",
                             buckets=_REQUEST_BUCKETS, **common)
        self.queue_time = Histogram("vgraph:request_queue_time_seconds", "Submission to first scheduling.",
                                    buckets=_REQUEST_BUCKETS, **common)
        for reason in ("stop", "length", "abort"):  # present from the start, at 0
            self.request_success.labels(model_name, reason)
        self._children = tuple(m.labels(model_name) for m in (
            self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue_time))

    def observe(self, step: StepOutput) -> None:
        """Folds one engine step's timings into the series (runs on the event loop)."""
        prompt_tokens, generation_tokens, ttft, itl, e2e, queue_time = self._children
        for p in step.timings:
            if p.num_new_tokens > 0:
                generation_tokens.inc(p.num_new_tokens)
            if p.time_to_first_token is not None:
                prompt_tokens.inc(p.num_prompt_tokens)
                ttft.observe(p.time_to_first_token)
            if p.inter_token_latency is not None:
                itl.observe(p.inter_token_latency)
            if p.queue_time is not None:
                queue_time.observe(p.queue_time)
            if p.e2e_latency is not None:
                e2e.observe(p.e2e_latency)
            for reason in p.finish_reasons:
                self.request_success.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
