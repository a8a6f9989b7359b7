"""``vgraph serve --data-parallel-size 2``: two in-process engine replicas behind one server.

Requests spread over both (per-replica metrics show it), a repeated prompt prefix stays on one
replica (its prefix-cache hits rise, the other sees nothing), greedy outputs equal one
engine's, and one replica dying gives clients a clean error and exits the server non-zero."""
from __future__ import annotations

import concurrent.futures
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import EAGER_ARGS, ServerProcess

DP_ARGS = [*EAGER_ARGS, "--max-logprobs", "5", "--data-parallel-size", "2"]
PROMPTS = ["def add(a, b):", "class Stack:", "import os\n", "for i in range(10):", "def parse(text):",
           "# Sort a list", "while True:", "def fib(n):"]


@pytest.fixture(scope="module")
def dp_server():
    proc = ServerProcess(*DP_ARGS)
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def _complete(server: ServerProcess, prompt: str, max_tokens: int = 12) -> str:
    response = server.post("/v1/completions", {"model": "demo-model-v1", "prompt": prompt,
                                               "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _together(server: ServerProcess, prompts: list[str]) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(server, p), prompts))


def _per_replica(metrics: dict[str, float], name: str) -> list[float]:
    return [metrics[f"vgraph:{name}{{engine={i}}}"] for i in range(2)]


def test_concurrent_requests_spread_over_both_replicas(dp_server):
    before = dp_server.wait_idle()
    _together(dp_server, PROMPTS)
    after = dp_server.wait_idle()
    looked_up = [a - b for a, b in zip(_per_replica(after, "prefix_cache_queries_total"),
                                       _per_replica(before, "prefix_cache_queries_total"))]
    assert all(n > 0 for n in looked_up), f"prompt tokens per replica: {looked_up}"
    assert sum(looked_up) == sum(len(dp_server.tokenize(p)) for p in PROMPTS)
    # The router-facing gauges are the server's: one series each, no replica label.
    assert after["vllm:num_requests_running"] == 0 and "vllm:num_requests_waiting{engine=0}" not in after


def test_a_repeated_prefix_stays_on_one_replica_and_hits_its_cache(dp_server):
    prefix = "You are a careful Python programmer. Write short, well named functions with docstrings. " * 3
    assert len(dp_server.tokenize(prefix)) >= 48
    before = dp_server.wait_idle()
    _complete(dp_server, prefix + "def add(a, b):", max_tokens=4)
    # Sent together, by load alone these would split over the replicas; the prefix keeps them
    # on the one that served it (its load stays within the imbalance bound).
    _together(dp_server, [prefix + task for task in ("def mean(xs):", "def is_prime(n):", "def reverse(s):")])
    after = dp_server.wait_idle()
    looked_up = [a - b for a, b in zip(_per_replica(after, "prefix_cache_queries_total"),
                                       _per_replica(before, "prefix_cache_queries_total"))]
    hits = [a - b for a, b in zip(_per_replica(after, "prefix_cache_hits_total"),
                                  _per_replica(before, "prefix_cache_hits_total"))]
    owner = 0 if looked_up[0] else 1
    assert looked_up[1 - owner] == 0, f"every request went to one replica: {looked_up}"
    assert hits[owner] >= 3 * 48, f"the three repeats found the shared blocks cached: {hits}"


def test_greedy_outputs_equal_one_engine(dp_server, server):
    assert _together(dp_server, PROMPTS) == _together(server, PROMPTS)


def test_a_replica_dying_fails_cleanly_and_exits_nonzero():
    script = Path(__file__).with_name("fail_engine.py")
    proc = ServerProcess(*DP_ARGS, program=[sys.executable, str(script)],
                         env={"VGRAPH_TEST_FAIL_AFTER_STEPS": "10"})
    try:
        proc.wait_ready()
        body = {"model": "demo-model-v1", "max_tokens": 60, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: httpx.post(proc.url + "/v1/completions", timeout=60,
                                                         json={**body, "prompt": p}), ["one", "two"]))
        health = httpx.get(proc.url + "/health", timeout=5)
        after = httpx.post(proc.url + "/v1/completions", json={**body, "prompt": "after"}, timeout=5)
        codes = sorted(a.status_code for a in answers)
        assert 500 in codes and set(codes) <= {200, 500, 503}, [a.text for a in answers]
        failed = next(a for a in answers if a.status_code == 500).json()["error"]
        assert failed["code"] == "engine_error" and "injected engine failure" in failed["message"]
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert after.status_code == 503
        assert proc.proc.wait(60) == 1
        assert "data-parallel replica" in proc.log()
    finally:
        proc.close()
