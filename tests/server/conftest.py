"""A real ``vgraph serve`` process on 127.0.0.1 and a free port, and clients for it.

The servers run the demo model (shipped in the package) with the session's compile cache
($VGRAPH_CACHE_DIR, set by tests/conftest.py), so compiled servers compile it once per session.
One eager server is shared by the modules that only need a well-behaved server; modules that
need other flags (auth, queue limits, the compiled default, fault injection) start their own.

Servers run the engine out of process (``vgraph serve``'s default: an engine-core process);
a few modules pass ``--engine-in-process``. Every server's descendant processes (the
engine-core process, multiprocessing's resource tracker) are recorded by PID and must be
gone once it has exited: ``terminate`` fails the test that leaves one behind.
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


def descendants(pid: int) -> dict[int, str]:
    """The processes below ``pid`` now, from /proc: PID -> start time (told apart from a later
    process that reuses the PID)."""
    children: dict[int, list[int]] = {}
    start: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        children.setdefault(int(fields[1]), []).append(int(entry))
        start[int(entry)] = fields[19]
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found[child] = start[child]
        todo.extend(children.get(child, []))
    return found


def still_running(processes: dict[int, str]) -> list[int]:
    """The PIDs of ``processes`` (from ``descendants``) that still run (zombies count as gone)."""
    alive = []
    for pid, started in processes.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[19] == started and fields[0] != "Z":
            alive.append(pid)
    return alive


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
        self.children: dict[int, str] = {}  # every descendant seen, by PID (see ``descendants``)

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
                    self.children.update(descendants(self.proc.pid))
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

    def engine_pid(self) -> int:
        """The engine-core process's PID (the server's child running ``spawn_main``)."""
        for pid in descendants(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return pid
        raise AssertionError("the server has no engine-core process")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.children.update(descendants(self.proc.pid))
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.check_no_orphans()
        return self.proc.returncode

    def check_no_orphans(self, timeout: float = 15.0) -> None:
        """Fails when a process the server started outlives it (after killing it)."""
        deadline = time.monotonic() + timeout
        while (left := still_running(self.children)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes {left} outlived the server (pid {self.proc.pid}):\n{self.log()}"

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
