"""A real ``vgraph serve`` process on 127.0.0.1 and a free port, and clients for it.

The servers run the demo model (shipped in the package) with the session's compile cache
($VGRAPH_CACHE_DIR, set by tests/conftest.py), so compiled servers compile it once per session.
One eager server is shared by the modules that only need a well-behaved server; modules that
need other flags (auth, queue limits, the compiled default, fault injection) start their own.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

EAGER_ARGS = ["--enforce-eager", "--kv-cache-gib", "0.05", "--max-num-seqs", "32", "--device", "cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``vgraph serve ARGS`` in a subprocess, logging to a file (read on failure)."""

    def __init__(self, *args: str, program: Optional[list[str]] = None, env: Optional[dict] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="vgraph-serve-", suffix=".log")[1])
        full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        full_env.update(env or {})
        command = (program or [sys.executable, "-m", "vgraph.cli"]) + [
            "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self.health_statuses: list[int] = []

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 240.0) -> "ServerProcess":
        """Polls /health until 200, recording what it answered before (503 while loading)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
                self.health_statuses.append(status)
                if status == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the server was not ready in {timeout} s:\n{self.log()}")

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def post(self, path: str, body: object, timeout: object = 120, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout, **kwargs)

    def tokenize(self, prompt: str) -> list[int]:
        response = self.post("/tokenize", {"prompt": prompt})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as ``name{label=value,...}`` -> value (model_name dropped)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Waits until nothing runs or waits and no KV block is held (the server's totals over
        its replicas, in the router-facing gauges); returns the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                    and m["vllm:kv_cache_usage_perc"] == 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle: {m}")
            time.sleep(0.05)

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def close(self) -> None:
        self.terminate()
        self.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def server():
    """The shared eager server on the demo model (32 seats, a small KV pool)."""
    proc = ServerProcess(*EAGER_ARGS, "--max-logprobs", "5")
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


TINY_MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny_server():
    """An eager fp32 server on the tiny Llama test checkpoint, which transformers scores the
    same way (prompt logprobs, embeddings, lm-eval); 32-token steps, so longer prompts run
    as chunked prefills. Its ``checkpoint`` attribute is the model directory."""
    from tests.checkpoints import tiny_checkpoint

    path = tiny_checkpoint(arch="llama")
    proc = ServerProcess("--model", path, "--served-model-name", TINY_MODEL, *EAGER_ARGS, "--dtype", "float32",
                         "--max-logprobs", "5", "--max-num-batched-tokens", "32")
    proc.checkpoint = path
    try:
        yield proc.wait_ready()
    finally:
        proc.close()
