"""The server survives the faults we can throw at it (issue 19).

Slow clients (slowloris headers, trickled bodies) over the descriptor limit, malformed HTTP,
a client that never reads its stream, SIGTERM with streams still running at the deadline,
KV-cache exhaustion under many long prompts, and a long run of requests (memory must stay
flat). Each runs against a real ``vgraph serve`` on 127.0.0.1. Set VGRAPH_LONG_FAULTS=1 for
the full-length versions (2,000 sequential requests instead of a few hundred).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

from tests.server.conftest import EAGER_ARGS, ServerProcess
from tests.server.slow_clients import NeverReader, Slowloris, response_status
from vgraph.models.demo import build_tiny_checkpoint
from vgraph.server.connections import LogRateLimit, plan_connections, raw_response
from vgraph.server.errors import APIError

LIMITED = str(Path(__file__).with_name("limited_serve.py"))
LONG = os.environ.get("VGRAPH_LONG_FAULTS") == "1"
FD_LIMIT = 256
TIMEOUT_S = 1.5  # header, body and stall timeouts of the hardened server
LONG_CONTEXT = 8192
GREEDY = {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """A tiny checkpoint with 8,192 positions (the demo model has 512): its streams can run far
    longer than a test's stall or shutdown timeout, however fast the machine is."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("long-model"), max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def hardened(long_model):
    """An eager server of ``long_model`` under a 256-descriptor limit, read and stall timeouts 1.5 s."""
    model = long_model
    timeouts = [f"--{name}-timeout" for name in ("header", "body", "stall")]
    proc = ServerProcess(*EAGER_ARGS, "--model", model, *[arg for flag in timeouts for arg in (flag, str(TIMEOUT_S))],
                         program=[sys.executable, LIMITED], env={"VGRAPH_TEST_NOFILE": str(FD_LIMIT)})
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _raw_exchange(port: int, data: bytes, timeout: float = 30.0) -> bytes:
    """Sends ``data`` on a fresh connection and reads until the server closes it."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(data)
        return _read_until_closed(sock, timeout)


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def _json_error(response: bytes) -> tuple[bytes, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return head.split(b"\r\n", 1)[0], json.loads(body)["error"]


# ---------------------------------------------------------------------------- slow clients


def test_slowloris_over_the_descriptor_limit_leaves_normal_clients_served(hardened):
    """More slow sockets than the server has descriptors; normal requests still get answers."""
    want = hardened.post("/v1/completions", GREEDY).json()["choices"][0]["text"]
    log_before = len(_attack_log(hardened.log()))
    served, most_descriptors = 0, 0
    with Slowloris(hardened.port, count=FD_LIMIT + 64, interval=0.3) as attack:
        deadline = time.monotonic() + 60
        while attack.most_open < FD_LIMIT + 64 and time.monotonic() < deadline:
            time.sleep(0.1)
        attack_end = time.monotonic() + 10
        while time.monotonic() < attack_end:
            response = hardened.post("/v1/completions", GREEDY, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == want
            served += 1
            most_descriptors = max(most_descriptors, _open_descriptors(hardened.proc.pid))
        assert attack.open_now > FD_LIMIT // 2, "the attack kept its sockets open meanwhile"
        closed = attack.closed_by_server
    assert served >= 5 and closed > 0
    log_growth = len(_attack_log(hardened.log())) - log_before
    assert log_growth < 16 * 1024, f"the log grew by {log_growth} bytes:\n{hardened.log()[-3000:]}"


def _attack_log(log: str) -> str:
    """The log without the one line per finished request: what the attack itself made it write
    (the normal clients' requests served meanwhile are logged, as they should be)."""
    return "".join(line for line in log.splitlines(keepends=True) if "[vgraph.server.requests]" not in line)
    max_connections, _ = plan_connections(FD_LIMIT, None)
    assert most_descriptors < FD_LIMIT, most_descriptors
    assert f"at most {max_connections} open" in hardened.log()
    hardened.wait_idle()


def test_slow_request_headers_get_a_408_and_the_connection_closed(hardened):
    started = time.monotonic()
    status, error = _json_error(_raw_exchange(hardened.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a"))
    assert status == b"HTTP/1.1 408 Request Timeout" and error["code"] == "request_timeout"
    assert time.monotonic() - started >= TIMEOUT_S * 0.9
    assert _raw_exchange(hardened.port, b"") == b"", "a connection that sends nothing is closed quietly"


def test_the_header_deadline_also_covers_the_next_request_on_a_kept_alive_connection(hardened):
    """uvicorn's keep-alive timer stops at the first byte of the next request; ours does not."""
    with socket.create_connection(("127.0.0.1", hardened.port)) as sock:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        first = response_status(sock, 30)
        assert first == b"HTTP/1.1 200 OK"
        sock.sendall(b"GET /version HTTP/1.1\r\nHo")
        rest = _read_until_closed(sock, 30)
    assert b"HTTP/1.1 408 Request Timeout" in rest


def test_a_trickled_body_gets_a_408(hardened):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")
    with socket.create_connection(("127.0.0.1", hardened.port)) as sock:
        sock.sendall(head)
        for byte in b'{"prompt": "a slow trickle of a body"':  # a byte every 0.2 s: alive, far too slow
            if select.select([sock], [], [], 0.2)[0]:  # the server has answered: stop sending
                break
            sock.sendall(bytes([byte]))
        response = _read_until_closed(sock, 30)
    status, error = _json_error(response)
    assert status == b"HTTP/1.1 408 Request Timeout" and "body" in error["message"]


def test_malformed_http_gets_a_400_in_the_error_shape(hardened):
    status, error = _json_error(_raw_exchange(hardened.port, b"HELLO WORLD\r\n\r\n"))
    assert status == b"HTTP/1.1 400 Bad Request" and error["code"] == "invalid_http_request"
    assert set(error) == {"message", "type", "param", "code"}
    oversized = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (80 * 1024)  # never ends
    status, error = _json_error(_raw_exchange(hardened.port, oversized))
    assert status == b"HTTP/1.1 400 Bad Request" and error["code"] == "headers_too_large"


# ---------------------------------------------------------------------------- backpressure


def test_a_client_that_never_reads_its_stream_is_dropped_and_its_request_aborted(hardened):
    before = hardened.wait_idle()
    n, max_tokens = 8, LONG_CONTEXT - 64  # minutes of generation: it is still running at the stall
    reader = NeverReader(hardened.port, {"prompt": "Never read", "max_tokens": max_tokens, "n": n, "logprobs": 5,
                                         "ignore_eos": True, "stream": True})
    try:
        assert reader.wait_closed_by_server(120), "the server kept a stalled stream open"
    finally:
        reader.close()
    after = hardened.wait_idle(timeout=60)
    key = "vgraph:request_success_total{finished_reason=abort}"
    assert after[key] - before[key] == n, "every choice was aborted, not generated for nobody"
    generated = after["vgraph:generation_tokens_total"] - before["vgraph:generation_tokens_total"]
    assert generated < n * max_tokens
    assert "read nothing for" in hardened.log()


# ---------------------------------------------------------------------------- shutdown


def _stream_events(url: str, body: dict, events: list, started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()


def test_streams_cut_by_the_shutdown_deadline_end_with_an_error_event_and_done(long_model):
    proc = ServerProcess(*EAGER_ARGS, "--model", long_model, "--shutdown-timeout", "1")
    try:
        proc.wait_ready()
        body = {"prompt": "A long story", "max_tokens": LONG_CONTEXT - 64, "n": 4, "ignore_eos": True,
                "stream": True}
        streams = [([], threading.Event()) for _ in range(3)]
        readers = [threading.Thread(target=_stream_events, args=(proc.url, body, events, started))
                   for events, started in streams]
        plain: dict = {}
        waiter = threading.Thread(target=lambda: plain.update(response=proc.post(
            "/v1/completions", {**body, "stream": False})))
        for thread in [*readers, waiter]:
            thread.start()
        assert all(started.wait(60) for _, started in streams)
        # The plain request too must be in the engine when SIGTERM lands (4 requests of n=4:
        # 16 sequences), or on a loaded machine it may not have been sent yet.
        deadline = time.monotonic() + 60
        while sum(proc.metrics()[f"vllm:num_requests_{q}"] for q in ("running", "waiting")) < 16:
            assert time.monotonic() < deadline, "the four requests reached the engine"
            time.sleep(0.02)
        proc.proc.send_signal(signal.SIGTERM)
        for thread in [*readers, waiter]:
            thread.join(60)
        assert proc.proc.wait(60) == 0, proc.log()
        for events, _ in streams:
            assert events[-1] == "[DONE]", events[-3:]
            error = events[-2]["error"]
            assert "shutting down" in error["message"] and set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "shutting_down"
            assert all("choices" in e for e in events[:-2])
            finished = sum(c["finish_reason"] is not None for e in events[:-2] for c in e["choices"])
            assert finished < 4, "the streams were cut, not finished"
        response = plain["response"]
        assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
        assert "shutting down" in response.json()["error"]["message"]
        assert "--shutdown-timeout (1 s) passed" in proc.log()
    finally:
        proc.close()


# ---------------------------------------------------------------------------- engine pressure


def test_kv_exhaustion_preempts_and_greedy_outputs_match_requests_made_alone():
    """64 long prompts against a KV cache of 1,040 tokens (about six of them): preemption,
    and every greedy output equals the same request's made alone."""
    args = ["--enforce-eager", "--kv-cache-gib", "0.0005", "--max-num-seqs", "64", "--device", "cpu"]
    proc = ServerProcess(*args)
    try:
        proc.wait_ready()
        words = "river bread oven village stone bridge garden window rain night".split()
        prompts = [" ".join(words[(i + j) % len(words)] for j in range(40 + i // 2)) + f" {i}" for i in range(64)]
        params = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}  # 94-167 + 16 tokens

        async def together() -> list[str]:
            async with proc.async_client() as client:
                outs = await asyncio.gather(*(client.completions.create(model="demo-model-v1", prompt=p, **params)
                                              for p in prompts))
            return [o.choices[0].text for o in outs]

        concurrent = asyncio.run(together())
        metrics = proc.wait_idle()
        assert metrics["vgraph:num_preemptions_total{engine=0}"] > 0, "the test needs preemption to happen"
        client = proc.client()
        alone = [client.completions.create(model="demo-model-v1", prompt=p, **params).choices[0].text
                 for p in prompts]
        assert concurrent == alone
    finally:
        proc.close()


def test_memory_stays_flat_over_many_sequential_requests(server, model):
    """RSS after warm-up vs after N more requests of every kind (streamed, chat, aborted)."""
    total = 2000 if LONG else 300
    client = server.client()

    def one(i: int) -> None:
        kind = i % 4
        if kind == 0:
            client.completions.create(model=model, prompt=f"Request {i}", max_tokens=8, logprobs=2)
        elif kind == 1:
            list(client.completions.create(model=model, prompt=f"Stream {i}", max_tokens=8, stream=True))
        elif kind == 2:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Hi {i}"}],
                                           max_tokens=8)
        else:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                              json={"prompt": f"Abandon {i}", "max_tokens": 64, "stream": True}) as response:
                next(response.iter_lines())  # hang up after the first event: an abort

    for i in range(60):  # warm-up: allocator pools, tokenizer caches, lazily built state
        one(i)
    start = _rss_bytes(server.proc.pid)
    samples = []
    for i in range(total):
        one(i)
        if i % 50 == 49:
            samples.append(_rss_bytes(server.proc.pid))
    growth = samples[-1] - start
    logging.getLogger(__name__).info("RSS %.1f MiB -> %.1f MiB over %d requests", start / 2**20,
                                     samples[-1] / 2**20, total)
    assert growth < 24 * 2**20, [round(s / 2**20, 1) for s in [start, *samples]]
    server.wait_idle()


# ---------------------------------------------------------------------------- the pieces alone


def test_log_rate_limit_passes_a_burst_per_window_and_counts_the_rest():
    now = [0.0]
    limit = LogRateLimit(burst=3, window=10.0, clock=lambda: now[0])
    records = [logging.LogRecord("asyncio", logging.ERROR, "", 0, f"Exception in callback x(when={i}.5)", (), None)
               for i in range(1000)]
    passed = [r for r in records if limit.filter(r)]
    assert len(passed) == 3
    other = logging.LogRecord("asyncio", logging.ERROR, "", 0, "socket.accept() out of system resource", (), None)
    assert limit.filter(other), "another kind has its own budget"
    now[0] = 11.0
    late = logging.LogRecord("asyncio", logging.ERROR, "", 0, "Exception in callback x(when=7.0)", (), None)
    assert limit.filter(late) and "997 more like this" in late.getMessage()


def test_the_connection_cap_leaves_room_for_the_accept_loop_and_the_reserve():
    assert plan_connections(256, None) == (128, 16)
    assert plan_connections(1024, None) == (704, 64)
    assert plan_connections(65536, None) == (65536 - 64 - 4 * 2048, 2048)
    assert plan_connections(1024, 100) == (100, 64)
    assert plan_connections(1024, 10**6)[0] == 704


def test_raw_responses_are_complete_http_messages():
    data = raw_response(APIError(503, "busy", code="too_many_connections", headers={"Retry-After": "1"}))
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"\r\nretry-after: 1" in head.lower()
    assert f"content-length: {len(body)}".encode() in head
    assert json.loads(body)["error"]["code"] == "too_many_connections"


class _FakeTransport(asyncio.Transport):
    """Records what the protocol writes and how it ends the connection, which it reports to
    the protocol a loop iteration later, as asyncio's transports do."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port, self.written, self.ended = port, b"", None
        self.protocol: Optional[asyncio.Protocol] = None

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", self.port), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self._end("closed")

    def abort(self) -> None:
        self._end("reset")

    def _end(self, how: str) -> None:
        if self.ended is None:
            self.ended = how
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return self.ended is not None

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _guarded_connections(count: int, requests: int, **limits: float) -> list:
    """``count`` connections to a guarded protocol (cap 2); the first ``requests`` send a request
    the app never finishes answering, the rest send nothing."""
    import uvicorn
    from uvicorn.server import ServerState as UvicornState

    from vgraph.server.connections import ConnectionGuard, ConnectionLimits, protocol_class

    async def app(scope, receive, send) -> None:  # a request that stays in progress
        await asyncio.Event().wait()

    config = uvicorn.Config(app, lifespan="off")
    config.load()
    defaults = dict(header_timeout=30.0, body_timeout=30.0, stall_timeout=30.0, max_connections=2, backlog=16)
    protocol = protocol_class(ConnectionGuard(ConnectionLimits(**{**defaults, **limits})))
    state = UvicornState()
    made = []
    for i in range(count):
        conn = protocol(config=config, server_state=state, app_state={})
        transport = _FakeTransport(5000 + i)
        transport.protocol = conn
        conn.connection_made(transport)
        if i < requests:
            conn.data_received(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        made.append(conn)
    await asyncio.sleep(0)
    return made


def test_a_connection_over_the_cap_evicts_the_longest_header_waiter():
    async def scenario() -> list:
        conns = await _guarded_connections(4, requests=1)  # one busy, then three silent
        return [conn.transport.ended for conn in conns]

    assert asyncio.run(scenario()) == [None, "reset", "reset", None], "busy kept, oldest waiters evicted"


def test_a_connection_over_the_cap_of_busy_ones_gets_a_503():
    async def scenario() -> _FakeTransport:
        conns = await _guarded_connections(3, requests=2)
        assert [c.transport.ended for c in conns[:2]] == [None, None]
        return conns[2].transport

    transport = asyncio.run(scenario())
    status, error = _json_error(transport.written)
    assert status == b"HTTP/1.1 503 Service Unavailable" and error["code"] == "too_many_connections"
    assert transport.ended == "closed"


def test_a_response_stalled_past_the_stall_timeout_is_reset():
    async def scenario() -> list:
        conns = await _guarded_connections(2, requests=2, stall_timeout=0.05)
        conns[0].pause_writing()  # its client stopped reading
        conns[1].pause_writing()
        conns[1].resume_writing()  # this one caught up
        await asyncio.sleep(0.3)
        return [conn.transport.ended for conn in conns]

    assert asyncio.run(scenario()) == ["reset", None]
