"""``vgraph serve --data-parallel-size 2``: two engine replicas behind one server (engine-core
processes by default, threads with ``--engine-in-process``).

Requests spread over both (per-replica metrics show it), a repeated prompt prefix stays on one
replica (its prefix-cache hits rise, the other sees nothing), greedy outputs equal one
engine's, and one replica dying (its process killed, or its step failing in process) gives
clients a clean error and exits the server non-zero, leaving no process behind."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import EAGER_ARGS, ServerProcess
from vgraph.config import CPU_BLOCK_SIZE

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
    # One whole KV block of the CPU default size: the prefix cache and the router share blocks.
    prefix = "You are a careful Python programmer. Write short, well named functions with docstrings. " * 6
    assert len(dp_server.tokenize(prefix)) >= CPU_BLOCK_SIZE
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
    assert hits[owner] >= 3 * CPU_BLOCK_SIZE, f"the three repeats found the shared blocks cached: {hits}"


def test_greedy_outputs_equal_one_engine(dp_server, server):
    assert _together(dp_server, PROMPTS) == _together(server, PROMPTS)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return found


def _engine_cores(pid: int) -> list[int]:
    """The server's engine-core processes (its spawned children that are not multiprocessing's
    resource tracker)."""
    cores = []
    for child in _children(pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            cores.append(child)
    return cores


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def test_a_killed_replica_process_fails_cleanly_and_exits_nonzero():
    proc = ServerProcess(*DP_ARGS)
    try:
        proc.wait_ready()
        cores = _engine_cores(proc.proc.pid)
        descendants = _children(proc.proc.pid)
        assert len(cores) == 2, f"one engine-core process per replica: {descendants}"
        body = {"model": "demo-model-v1", "max_tokens": 300, "ignore_eos": True}
        answers: list[httpx.Response] = []
        failures: list[BaseException] = []

        def request(prompt: str) -> None:
            try:
                answers.append(httpx.post(proc.url + "/v1/completions", timeout=90, json={**body, "prompt": prompt}))
            except BaseException as exc:  # reported by the assertion below
                failures.append(exc)

        streams = [threading.Thread(target=request, args=(p,)) for p in ("a", "b")]
        for stream in streams:
            stream.start()
        deadline = time.monotonic() + 30
        while proc.metrics()["vllm:num_requests_running"] < 2:
            assert time.monotonic() < deadline, "both requests started"
            time.sleep(0.02)
        os.kill(cores[1], signal.SIGKILL)
        for stream in streams:
            stream.join(90)
        health = httpx.get(proc.url + "/health", timeout=5)
        assert not failures and len(answers) == 2, (failures, proc.log()[-3000:])
        codes = sorted(a.status_code for a in answers)
        assert 503 in codes and set(codes) <= {200, 503}, [a.text for a in answers]
        assert any(a.status_code == 503 and a.json()["error"]["code"] == "engine_dead" for a in answers)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert proc.proc.wait(60) == 1
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in descendants) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in descendants if _alive(pid)], "no process left behind"
    finally:
        proc.close()


def test_an_in_process_replica_failing_fails_cleanly_and_exits_nonzero():
    script = Path(__file__).with_name("fail_engine.py")
    proc = ServerProcess(*DP_ARGS, "--engine-in-process", program=[sys.executable, str(script)],
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
