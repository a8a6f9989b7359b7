"""Process lifecycle: the compiled default starting up, SIGTERM draining, fatal engine errors."""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import EAGER_ARGS, ServerProcess


def _read_sse(response: httpx.Response) -> list:
    """Events of a stream: parsed JSON objects, and the string "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_compiled_default_serves_and_drains_on_sigterm():
    """`vgraph serve` with no model and no --enforce-eager: the README's command, compiled."""
    proc = ServerProcess("--kv-cache-gib", "0.05", "--max-num-seqs", "8", "--device", "cpu")
    try:
        proc.wait_ready(timeout=420)
        assert 503 in proc.health_statuses, "/health answers 503 while the model loads and compiles"
        assert "compiled" in proc.log() and "demo model" in proc.log()
        client = proc.client()
        kwargs = dict(model="demo-model-v1", prompt="Once upon a time", max_tokens=16, temperature=0,
                      extra_body={"ignore_eos": True})
        full = client.completions.create(**kwargs).choices[0].text
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)
                       if c.choices) == full

        events: list = []
        first_chunk = threading.Event()

        def consume() -> None:
            body = {"prompt": "A long story", "max_tokens": 150, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        first_chunk.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert first_chunk.wait(60)
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # the listening socket is closed
            httpx.post(proc.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
        reader.join(120)
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 150, "the in-flight stream finished"
        assert any(c["finish_reason"] == "length" for e in events[:-2] for c in e["choices"])
        assert proc.proc.wait(60) == 0, proc.log()
        assert "engine-core process stopped (code 0)" in proc.log(), "the engine process drained and exited too"
    finally:
        proc.close()


def test_sigterm_while_the_engine_core_process_is_starting_exits_at_once():
    """A core that has not connected yet cannot take the shutdown command; it is stopped
    instead of building its engine and then waiting for a command that never comes (the
    server used to sit out the whole --shutdown-timeout)."""
    proc = ServerProcess(*EAGER_ARGS)
    try:
        for _ in range(600):  # the HTTP side is up (it answers 503) while the core still imports
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(proc.url + "/health", timeout=1).status_code == 503:
                    break
            time.sleep(0.05)
        start = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        proc.proc.wait(25)
        assert time.monotonic() - start < 20, proc.log()
        assert "engine-core process stopped" in proc.log()
    finally:
        proc.close()


@pytest.mark.parametrize("mode", [[], ["--engine-in-process"]], ids=["engine-process", "in-process"])
def test_a_fatal_engine_error_fails_requests_and_exits_nonzero(mode):
    """A step that raises (in the engine-core process, patched there too: spawn re-imports the
    main script) is reported to the server as the engine's failure, not as a dead process."""
    script = Path(__file__).with_name("fail_engine.py")
    proc = ServerProcess(*EAGER_ARGS, *mode, program=[sys.executable, str(script)],
                         env={"VGRAPH_TEST_FAIL_AFTER_STEPS": "20"})
    try:
        proc.wait_ready()
        results: dict = {}

        def non_streaming() -> None:
            results["plain"] = httpx.post(proc.url + "/v1/completions", timeout=60,
                                          json={"prompt": "plain", "max_tokens": 100, "ignore_eos": True})

        plain = threading.Thread(target=non_streaming)
        plain.start()
        with httpx.stream("POST", proc.url + "/v1/completions", timeout=60,
                          json={"prompt": "streamed", "max_tokens": 100, "ignore_eos": True,
                                "stream": True}) as response:
            assert response.status_code == 200
            events = _read_sse(response)
        plain.join(60)
        health = httpx.get(proc.url + "/health", timeout=5)
        after = httpx.post(proc.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=5)

        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "engine_error" and "injected engine failure" in error["message"]
        assert all("choices" in e for e in events[:-2]), "text chunks, then the error, then [DONE]"
        assert results["plain"].status_code == 500
        assert results["plain"].json()["error"]["code"] == "engine_error"
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert after.status_code == 503
        assert proc.proc.wait(60) == 1
        assert "injected engine failure" in proc.log()
    finally:
        proc.close()


def test_a_model_that_cannot_load_is_a_one_line_error():
    proc = ServerProcess("--model", "/nonexistent/model", "--enforce-eager", "--device", "cpu")
    try:
        assert proc.proc.wait(120) == 2
        log = proc.log()
        assert "vgraph serve: error:" in log and "is not a directory" in log and "Traceback" not in log
    finally:
        proc.close()


def test_serve_flags_are_checked_before_anything_loads():
    result = subprocess.run([sys.executable, "-m", "vgraph.cli", "serve", "--max-queue-len", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--max-queue-len must be at least 1" in result.stderr
    result = subprocess.run([sys.executable, "-m", "vgraph.cli", "serve", "a", "--model", "b"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "two models given" in result.stderr
