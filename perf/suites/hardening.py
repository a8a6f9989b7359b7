"""Hardening: what hostile requests and slow clients do to a running ``vgraph serve``.

One real server (demo model, ``--enforce-eager``, ``--api-key``), started the way a user starts
it, in a process whose descriptor limit is 1024 (a common ``ulimit -n``), and three workloads:

1. **Hostile classes.** Fixed, seeded lists of requests per class (lone surrogates as JSON
   escapes and as raw bytes, nesting 1,000-100,000 deep, invalid UTF-8, bodies that are not one
   JSON object, wrong content types, huge numbers in every numeric field, seeds past 64 bits,
   huge stop lists, n x prompts explosions, Authorization spellings, bodies over the 16 MiB
   limit, malformed HTTP on a raw socket), sent one at a time. Recorded per class: requests
   tried, the status codes returned (or the connection error), latency, and whether a greedy
   completion still gives the text it gave before. The target: no 5xx at all.
2. **A 15 MB request's stall.** While one client streams completions back to back (every
   token's arrival timestamped; ``logprobs: 0`` makes every token an event), a second polls
   ``/health`` every 25 ms and a thread samples the server's RSS every 20 ms, one 15 MB request
   is sent: a completion prompt, a chat message, a ``/tokenize`` prompt. Twice each. Reported per request:
   its status and time, the stream's inter-token gaps and ``/health`` latency (p50 / max)
   before, during and after it, and the server's RSS before, at its peak during, and after.
   (``/health`` and the slowloris probes use a new connection per request, as a load
   balancer's health check does; ``health_idle_ms`` compares keep-alive and fresh connections
   on the idle server.)
3. **Slowloris.** N sockets (0, 256, 1024, 2048) that never finish a request: half send
   headers one byte a second, half send complete headers and then the body one byte a second.
   They are held for longer than the server's header timeout while a probe sends a fresh-
   connection greedy completion and a ``/health`` every 250 ms. Reported per N: sockets the
   server still holds over time, what the closed ones received, and the probes' status and
   latency: whether normal requests are still served, and how fast.

On a 2-core machine the client shares the CPUs with the server; the load average before and
after is stored with the results.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Optional

import httpx

from .serving import _free_port, _percentile, stop_server, wait_until_healthy

KEY = "sk-perf-hardening-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "demo-model-v1"
SERVER_ARGS = ["--enforce-eager", "--max-num-seqs", "32", "--kv-cache-gib", "0.25", "--api-key", KEY]
SERVER_NOFILE = 1024
GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
REQUEST_TIMEOUT_S = 300
BIG_BYTES = 15_000_000
BIG_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize")
WINDOW_S = 1.5  # before and after the big request
HEALTH_EVERY_S = 0.025
RSS_EVERY_S = 0.02
SLOW_LEVELS = (0, 256, 1024, 2048)
SLOW_HOLD_S = 14.0  # longer than the default --header-timeout (10 s)
PROBE_EVERY_S = 0.25
WORDS = ("the quick brown fox jumps over the lazy dog while a river runs past the old mill "
         "and the village bakers sell warm bread in the morning market ").split()


# ----------------------------------------------------------------------------- the server


class _Server:
    """``vgraph serve`` in a child process with a 1024-descriptor limit; log to a temp file."""

    def __init__(self, device: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vgraph-serve-hardening-", suffix=".log", delete=False)
        self.cmd = [sys.executable, "-m", "vgraph.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    "--device", device, *SERVER_ARGS]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_limit_descriptors)

    def wait_ready(self) -> float:
        return wait_until_healthy(self.proc, self.url, self.start, self.log_tail)

    def rss_bytes(self) -> Optional[int]:
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        return stop_server(self.proc, self.log)

    def log_tail(self, chars: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-chars:]


def _limit_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (SERVER_NOFILE, SERVER_NOFILE))


def _greedy_text(url: str) -> Optional[str]:
    try:
        r = httpx.post(url + "/v1/completions", json=GREEDY, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
        return r.json()["choices"][0]["text"] if r.status_code == 200 else f"<status {r.status_code}>"
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return f"<{type(exc).__name__}>"


# ----------------------------------------------------------------------------- 1. hostile classes


def _j(value: Any, ensure_ascii: bool = True) -> bytes:
    """JSON bytes; with ``ensure_ascii=False`` a lone surrogate is written as raw ED xx xx bytes."""
    return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


Case = tuple[str, str, str, dict[str, Any], Any]  # (label, method, path, headers, content)
JSON = {"Content-Type": "application/json"}


def _post(label: str, path: str, content: Any, headers: Optional[dict] = None) -> Case:
    return label, "POST", path, {**AUTH, **JSON, **(headers or {})}, content


MINIMAL = {"/v1/completions": {"prompt": "hello", "max_tokens": 2},
           "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
           "/tokenize": {"prompt": "hello"}, "/detokenize": {"tokens": [10, 20]}}


def _surrogate_cases(raw: bool) -> Iterator[Case]:
    for cp in (0xD800, 0xDBFF, 0xDC00, 0xDFFF, 0xDABC):
        s = f"a{chr(cp)}b"
        bodies = [("/v1/completions", "prompt", {"prompt": s, "max_tokens": 2}),
                  ("/v1/completions", "prompt[1]", {"prompt": ["ok", s], "max_tokens": 2}),
                  ("/v1/completions", "stop", {"prompt": "hi", "stop": [s], "max_tokens": 2}),
                  ("/v1/completions", "model", {"prompt": "hi", "model": s, "max_tokens": 2}),
                  ("/v1/completions", "unknown key", {"prompt": "hi", s: 1, "max_tokens": 2}),
                  ("/v1/chat/completions", "content", {"messages": [{"role": "user", "content": s}], "max_tokens": 2}),
                  ("/v1/chat/completions", "content part",
                   {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}], "max_tokens": 2}),
                  ("/v1/chat/completions", "name",
                   {"messages": [{"role": "user", "content": "x", "name": s}], "max_tokens": 2}),
                  ("/tokenize", "prompt", {"prompt": s}),
                  ("/tokenize", "content", {"messages": [{"role": "user", "content": s}]})]
        for path, spot, body in bodies:
            yield _post(f"U+{cp:04X} in {spot}", path, _j(body, ensure_ascii=not raw))


def _deep_cases() -> Iterator[Case]:
    for depth in (1000, 10_000, 100_000):
        for kind, nested in (("array", b"[" * depth + b"]" * depth),
                             ("object", b'{"a":' * depth + b"1" + b"}" * depth)):
            for path in MINIMAL:
                yield _post(f"{kind} {depth} deep as the body", path, nested)
                field = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/tokenize": "prompt",
                         "/detokenize": "tokens"}[path]
                body = _j(MINIMAL[path])
                yield _post(f"{kind} {depth} deep in {field}", path, body[:1] + _j(field) + b":" + nested + b"," + body[1:])


BAD_UTF8 = (b"\xff", b"\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xc3", b"\xe2\x82", b"\xf4\x90\x80\x80",
            b"\xf8\x88\x80\x80\x80", b"caf\xe9")


def _utf8_cases() -> Iterator[Case]:
    for bad in BAD_UTF8:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            body = _j(MINIMAL[path])
            at = body.index(b'"h') + 1
            yield _post(f"{bad!r} in a string", path, body[:at] + bad + body[at:])


NON_OBJECTS = (b"", b" ", b"null", b"1", b'"hi"', b"[]", b'[{"prompt": "hi"}]', b"true", b"{", b'{"prompt": "hi"',
               b'{"prompt": "hi"} {}', b"{'prompt': 'hi'}", b'{"prompt": NaN}', b'{"prompt": "hi", "top_p": Infinity}',
               b'{prompt: "hi"}', b"prompt=hi", b'{"prompt": "\\u12"}', b"\x00", b"1" * 5000)


def _non_object_cases() -> Iterator[Case]:
    for content in NON_OBJECTS:
        for path in ("/v1/completions", "/v1/chat/completions"):
            yield _post(f"body {content[:24]!r}", path, content)


CONTENT_TYPES = (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/jsonx", "application/json-patch+json", "text/json", "application/octet-stream", "*/*",
                 "application/json; charset=latin-1", "APPLICATION/JSON")


def _content_type_cases() -> Iterator[Case]:
    for ct in CONTENT_TYPES:
        for path in MINIMAL:
            headers = dict(AUTH) if ct is None else {**AUTH, "Content-Type": ct}
            yield f"Content-Type {ct!r}", "POST", path, headers, _j(MINIMAL[path])


HUGE = (2**70, -2**70, 10**100, 2**63, 2**64)
RAW_HUGE = (b"1e400", b"-1e400", b"1" + b"0" * 5000)
NUMERIC_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "logprobs", "temperature", "top_p", "min_p",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "best_of")


def _huge_number_cases() -> Iterator[Case]:
    for field in NUMERIC_FIELDS:
        for value in HUGE:
            yield _post(f"{field}={value if value < 10**30 else '10**100'}", "/v1/completions",
                        _j({**MINIMAL["/v1/completions"], field: value}))
        for raw in RAW_HUGE:
            body = _j(MINIMAL["/v1/completions"])
            yield _post(f"{field}={raw[:8].decode()}...", "/v1/completions", body[:-1] + b', "' + field.encode() + b'": ' + raw + b"}")
    for value in HUGE:
        yield _post(f"stop_token_ids=[{value}]", "/v1/completions", _j({**MINIMAL["/v1/completions"], "stop_token_ids": [value]}))
        yield _post(f"prompt=[{value}]", "/v1/completions", _j({"prompt": [value], "max_tokens": 2}))
        yield _post(f"tokens=[{value}]", "/detokenize", _j({"tokens": [value]}))
        yield _post(f"top_logprobs={value}", "/v1/chat/completions",
                    _j({**MINIMAL["/v1/chat/completions"], "logprobs": True, "top_logprobs": value}))


SEEDS = (2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -2**63, -2**63 - 1, 10**100, -10**100)


def _seed_cases() -> Iterator[Case]:
    for seed in SEEDS:
        for n in (1, 2):
            for path in ("/v1/completions", "/v1/chat/completions"):
                label = f"seed={seed if abs(seed) < 10**30 else '+-10**100'} n={n}"
                yield _post(label, path, _j({**MINIMAL[path], "seed": seed, "n": n, "temperature": 1.0}))


def _stop_cases() -> Iterator[Case]:
    for count in (65, 1000, 10_000, 100_000):
        for length in (1, 100):
            stops = ["x" * length + str(i) for i in range(count)]
            yield _post(f"{count} stop strings of {length}+ chars", "/v1/completions",
                        _j({"prompt": "hello", "max_tokens": 4, "stop": stops}))
    for count, length in ((1, 1_000_000), (4, 1_000_000), (1, 5_000)):
        yield _post(f"{count} stop strings of {length} chars", "/v1/completions",
                    _j({"prompt": "hello", "max_tokens": 4, "stop": ["y" * length] * count}))


EXPLOSIONS = ((128, 9), (128, 100), (128, 800), (2, 1000), (1, 2000), (1, 10_000), (1, 100_000), (64, 1000),
              (128, 10_000))


def _explosion_cases() -> Iterator[Case]:
    for n, prompts in EXPLOSIONS:
        for element in ("a", [5, 6]):
            yield _post(f"n={n} x {prompts} {'text' if isinstance(element, str) else 'token-id'} prompts",
                        "/v1/completions", _j({"prompt": [element] * prompts, "n": n, "max_tokens": 1}))


AUTH_VALUES = (None, "", f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}", f"Bearer\t{KEY}", f"Bearer {KEY}x",
               f"Bearer {KEY[:-1]}", f"Basic {KEY}", KEY, "Bearer", f"Bearer:{KEY}", "Bearer " + "k" * 60_000)


def _auth_cases() -> Iterator[Case]:
    for value in AUTH_VALUES:
        headers = {} if value is None else {"Authorization": value}
        shown = value if value is None or len(value) < 80 else value[:12] + f"...({len(value)} chars)"
        yield f"Authorization {shown!r}", "POST", "/v1/completions", {**JSON, **headers}, _j(MINIMAL["/v1/completions"])
        yield f"Authorization {shown!r}", "GET", "/v1/models", headers, None
        yield f"Authorization {shown!r}", "POST", "/tokenize", {**JSON, **headers}, _j(MINIMAL["/tokenize"])


def _oversized_cases() -> Iterator[Case]:
    size = 17 * 2**20
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        yield _post("17 MiB with Content-Length", path, b'{"prompt": "' + b"a" * (size - 20) + b'"}')
        yield _post("17 MiB chunked", path, lambda: iter([b" " * 2**20] * 17))


RAW_HTTP = (
    ("request line garbage", b"HELLO\r\n\r\n"),
    ("bad HTTP version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n"),
    ("header without colon", b"GET /health HTTP/1.1\r\nHost: x\r\nbroken header\r\n\r\n"),
    ("NUL in a header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"),
    ("Content-Length and chunked", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    ("negative Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"),
    ("bad chunk size", b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
    ("200 KB header block in one write", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"),
    ("1 MB header block in one write", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n"),
    ("no Host, HTTP/1.0", b"GET /health HTTP/1.0\r\n\r\n"),
)

CLASSES: dict[str, Callable[[], Iterator[Case]]] = {
    "lone_surrogate_escape": lambda: _surrogate_cases(raw=False),
    "lone_surrogate_raw_bytes": lambda: _surrogate_cases(raw=True),
    "deep_nesting": _deep_cases,
    "invalid_utf8": _utf8_cases,
    "non_object_body": _non_object_cases,
    "wrong_content_type": _content_type_cases,
    "huge_numbers": _huge_number_cases,
    "seed_overflow": _seed_cases,
    "huge_stop_lists": _stop_cases,
    "n_x_prompts": _explosion_cases,
    "authorization": _auth_cases,
    "oversized_body": _oversized_cases,
}


def _send_case(client: httpx.Client, case: Case) -> dict[str, Any]:
    label, method, path, headers, content = case
    start = time.perf_counter()
    try:
        body = content() if callable(content) else content
        response = client.request(method, path, headers=headers, content=body, timeout=REQUEST_TIMEOUT_S)
        status: Any = response.status_code
        shaped = _shaped(response.content) if status >= 400 else None
        stream_done = (response.text.rstrip().endswith("data: [DONE]")
                       if response.headers.get("content-type", "").startswith("text/event-stream") else None)
    except httpx.HTTPError as exc:
        status, shaped, stream_done = f"connection error: {type(exc).__name__}", None, None
    sample = {"case": label, "route": path, "status": status, "ms": round((time.perf_counter() - start) * 1e3, 3)}
    if shaped is not None:
        sample["openai_error_shape"] = shaped
    if stream_done is not None:
        sample["stream_done"] = stream_done
    return sample


def _raw_http(url: str) -> list[dict[str, Any]]:
    """Malformed HTTP on a raw socket: the status that comes back, or how the socket ended."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    samples = []
    for label, data in RAW_HTTP:
        start = time.perf_counter()
        received = b""
        error: Optional[str] = None
        try:
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(data)
                while len(received) < 65536 and not _complete(received):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    received += chunk
        except OSError as exc:
            error = type(exc).__name__
        head, _, body = received.partition(b"\r\n\r\n")
        parts = head.split(b" ", 2)
        status: Any
        if len(parts) > 1 and parts[1].isdigit():
            status = int(parts[1])
        elif received:
            status = f"unparsed: {received[:40]!r}"
        else:
            status = f"connection error: {error}" if error else "closed without a response"
        sample = {"case": label, "route": "raw socket", "status": status,
                  "ms": round((time.perf_counter() - start) * 1e3, 3)}
        if isinstance(status, int) and status >= 400:
            sample["openai_error_shape"] = _shaped(body)
        if error and isinstance(status, int):
            sample["then"] = error
        samples.append(sample)
    return samples


def _complete(received: bytes) -> bool:
    """Whether ``received`` holds a whole response with a Content-Length (the connection may
    stay open for the next request, so end of stream is not the only end)."""
    head, sep, body = received.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value.strip())
    return False


def _shaped(body: bytes) -> bool:
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    return (isinstance(obj, dict) and set(obj) == {"error"} and isinstance(obj["error"], dict)
            and set(obj["error"]) == {"message", "type", "param", "code"})


def _class_summary(samples: list[dict[str, Any]], reference: str, after: Optional[str]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for s in samples:
        counts[str(s["status"])] = counts.get(str(s["status"]), 0) + 1
    statuses = [s["status"] for s in samples]
    ms = [s["ms"] for s in samples]
    return {"tried": len(samples), "status_counts": dict(sorted(counts.items())),
            "5xx": sum(1 for s in statuses if isinstance(s, int) and s >= 500),
            "connection_errors": sum(1 for s in statuses if not isinstance(s, int)),
            "4xx_without_openai_shape": sum(1 for s in samples if s.get("openai_error_shape") is False),
            "streams_without_done": sum(1 for s in samples if s.get("stream_done") is False),
            "latency_ms": {"p50": _percentile(ms, 50), "max": max(ms) if ms else None},
            "greedy_unchanged_after": after == reference, "samples": samples}


def _hostile(server: _Server, quick: bool, reference: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rss_before = server.rss_bytes()
    with httpx.Client(base_url=server.url) as client:
        for name, cases in CLASSES.items():
            chosen = list(cases())
            if quick:
                chosen = random.Random(0).sample(chosen, min(len(chosen), 6))
            samples = [_send_case(client, case) for case in chosen]
            out[name] = _class_summary(samples, reference, _greedy_text(server.url))
            print(f"  hostile {name}: {out[name]['tried']} tried, {out[name]['status_counts']}", flush=True)
    raw = _raw_http(server.url)
    out["malformed_http"] = _class_summary(raw, reference, _greedy_text(server.url))
    print(f"  hostile malformed_http: {out['malformed_http']['status_counts']}", flush=True)
    return {"classes": out, "rss_before_mib": _mib(rss_before), "rss_after_mib": _mib(server.rss_bytes()),
            "server_alive_after": server.alive()}


# ----------------------------------------------------------------------------- 2. the 15 MB stall


def _big_body(route: str) -> bytes:
    """A body of about 15 MB: English-like words as a prompt, a chat message or /tokenize input."""
    rng = random.Random(0)
    words: list[str] = []
    size = 0
    while size < BIG_BYTES - 200:
        w = rng.choice(WORDS)
        words.append(w)
        size += len(w) + 1
    text = " ".join(words)
    if route == "/v1/chat/completions":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    elif route == "/tokenize":
        body = {"prompt": text}
    else:
        body = {"prompt": text, "max_tokens": 1}
    return _j(body)


class _Sampler(threading.Thread):
    """The server's RSS every ``RSS_EVERY_S`` seconds, timestamped."""

    def __init__(self, server: _Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            rss = self.server.rss_bytes()
            if rss is not None:
                self.samples.append((time.perf_counter(), rss))
            self.done.wait(RSS_EVERY_S)


async def _stream_worker(url: str, stop: asyncio.Event, gaps: list[tuple[float, float, float]],
                         ttfts: list[tuple[float, float]], errors: list[str]) -> None:
    """Streams greedy completions back to back; records each token's gap inside a stream as
    (previous arrival, this arrival, gap), an event carrying k tokens as k gaps of gap / k, and
    each stream's (send, first token)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, headers=AUTH) as client:
        while not stop.is_set():
            sent = time.perf_counter()
            last: Optional[float] = None
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        chunk = json.loads(line[6:])
                        new = sum(len(c["logprobs"]["tokens"]) for c in chunk.get("choices", []) if c.get("logprobs"))
                        if not new:
                            continue
                        if last is None:
                            ttfts.append((sent, now))
                        else:
                            gaps.extend([(last, now, (now - last) / new)] * new)
                        last = now
                        if stop.is_set():
                            break
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.05)


def _fresh_connections(timeout: float) -> httpx.AsyncClient:
    """A client that opens a new connection for every request (as a load balancer's health
    check does), built once so that its construction is not timed."""
    return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))


async def _health_poller(url: str, stop: asyncio.Event, out: list[tuple[float, float, Any]]) -> None:
    async with _fresh_connections(REQUEST_TIMEOUT_S) as client:
        while not stop.is_set():
            sent = time.perf_counter()
            try:
                status: Any = (await client.get(url + "/health")).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            out.append((sent, time.perf_counter(), status))
            await asyncio.sleep(max(0.0, HEALTH_EVERY_S - (time.perf_counter() - sent)))


def _send_big(url: str, route: str, content: bytes) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        r = httpx.post(url + route, content=content, headers={**AUTH, **JSON}, timeout=REQUEST_TIMEOUT_S)
        status: Any = r.status_code
        detail = r.text[:300]
    except httpx.HTTPError as exc:
        status, detail = f"connection error: {type(exc).__name__}", str(exc)[:300]
    return {"status": status, "detail": detail, "start": start, "end": time.perf_counter()}


def _window(start: float, end: float, t0: float, t1: float) -> str:
    """Where the interval [start, end] lies relative to the big request's [t0, t1]."""
    if end < t0:
        return "before"
    if start > t1:
        return "after"
    return "during"


async def _stall_trial(server: _Server, route: str, content: bytes) -> dict[str, Any]:
    gaps: list[tuple[float, float, float]] = []
    ttfts: list[tuple[float, float]] = []
    health: list[tuple[float, float, Any]] = []
    errors: list[str] = []
    stop = asyncio.Event()
    sampler = _Sampler(server)
    sampler.start()
    tasks = [asyncio.create_task(_stream_worker(server.url, stop, gaps, ttfts, errors)),
             asyncio.create_task(_health_poller(server.url, stop, health))]
    origin = time.perf_counter()
    await asyncio.sleep(WINDOW_S)
    big = await asyncio.to_thread(_send_big, server.url, route, content)
    await asyncio.sleep(WINDOW_S)
    stop.set()
    await asyncio.gather(*tasks)
    sampler.done.set()
    sampler.join()
    t0, t1 = big["start"], big["end"]
    out: dict[str, Any] = {"route": route, "body_bytes": len(content), "status": big["status"],
                           "detail": big["detail"], "request_s": round(t1 - t0, 4), "stream_errors": errors}
    for name, spans in (("itl", gaps),
                        ("health", [(a, b, b - a) for a, b, _ in health]),
                        ("ttft", [(a, b, b - a) for a, b in ttfts])):
        out[f"{name}_ms"] = {w: _stats([d for a, b, d in spans if _window(a, b, t0, t1) == w])
                             for w in ("before", "during", "after")}
    out["health_statuses"] = sorted({str(s) for _, _, s in health})
    rss = {w: [r for t, r in sampler.samples if _window(t, t, t0, t1) == w] for w in ("before", "during", "after")}
    out["rss_mib"] = {"before": _mib(statistics.median(rss["before"])) if rss["before"] else None,
                      "during_peak": _mib(max(rss["during"])) if rss["during"] else None,
                      "after": _mib(rss["after"][-1]) if rss["after"] else None}
    rel = lambda t: round(t - t0, 4)  # noqa: E731  (times relative to the big request's start)
    out["samples"] = {"request_window_s": [0.0, rel(t1)], "origin_s": rel(origin),
                      "itl_at_s_ms": [[rel(b), round(d * 1e3, 3)] for a, b, d in dict.fromkeys(gaps)],
                      "health_at_s_ms": [[rel(a), round((b - a) * 1e3, 3)] for a, b, _ in health],
                      "rss_at_s_mib": [[rel(t), _mib(r)] for t, r in sampler.samples[::2]]}
    return out


def _stats(values: list[float]) -> dict[str, Any]:
    ms = [v * 1e3 for v in values]
    return {"p50": _round(_percentile(ms, 50)), "max": _round(max(ms)) if ms else None, "samples": len(ms)}


def _round(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 3)


def _mib(b: Optional[float]) -> Optional[float]:
    return None if b is None else round(b / 2**20, 2)


def _stall(server: _Server, quick: bool) -> list[dict[str, Any]]:
    trials = []
    for rep in range(1 if quick else 2):
        for route in BIG_ROUTES:
            content = _big_body(route)
            trial = asyncio.run(_stall_trial(server, route, content))
            trial["rep"] = rep
            trials.append(trial)
            print(f"  15 MB {route} (rep {rep}): {trial['status']} in {trial['request_s']:.2f} s; ITL max "
                  f"before/during {trial['itl_ms']['before']['max']}/{trial['itl_ms']['during']['max']} ms; "
                  f"health max {trial['health_ms']['before']['max']}/{trial['health_ms']['during']['max']} ms; "
                  f"RSS {trial['rss_mib']}", flush=True)
    return trials


# ----------------------------------------------------------------------------- 3. slowloris


class _SlowSocket:
    """A connection that sends a request one byte a second and never finishes it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.opened: Optional[float] = None
        self.closed: Optional[float] = None
        self.received = b""
        self.error: Optional[str] = None

    async def run(self, host: str, port: int, stop: asyncio.Event) -> None:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            self.error = f"connect: {type(exc).__name__}"
            return
        self.opened = time.perf_counter()
        if self.kind == "headers":
            head, drip = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a"
        else:
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000000\r\n\r\n{\"prompt\": \"")
            drip = b"a"
        read = asyncio.create_task(self._read(reader))
        try:
            writer.write(head)
            while not stop.is_set() and not read.done():
                await asyncio.wait([read], timeout=1.0)
                if read.done() or stop.is_set():
                    break
                writer.write(drip)
                await writer.drain()
        except OSError as exc:
            self.error = type(exc).__name__
            if self.closed is None:
                self.closed = time.perf_counter()
        finally:
            read.cancel()
            writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                self.received += chunk[:2048 - len(self.received)] if len(self.received) < 2048 else b""
        except OSError as exc:
            self.error = type(exc).__name__
        self.closed = time.perf_counter()

    def held(self) -> bool:
        return self.opened is not None and self.closed is None

    def ending(self) -> str:
        if self.opened is None:
            return self.error or "not connected"
        if self.closed is None:
            return "held to the end"
        if self.received.startswith(b"HTTP/1.1 "):
            return f"closed after {self.received[9:12].decode(errors='replace')}"
        return f"closed without a response ({self.error})" if self.error else "closed without a response"


async def _probe_loop(url: str, stop: asyncio.Event, out: list[dict[str, Any]], origin: float) -> None:
    """A fresh-connection greedy completion and /health every ``PROBE_EVERY_S`` seconds."""
    async with _fresh_connections(10) as client:
        while not stop.is_set():
            for path, body in (("/v1/completions", GREEDY), ("/health", None)):
                sent = time.perf_counter()
                try:
                    if body is None:
                        r = await client.get(url + path)
                    else:
                        r = await client.post(url + path, json=body, headers=AUTH)
                    status: Any = r.status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                out.append({"at_s": round(sent - origin, 3), "route": path, "status": status,
                            "ms": round((time.perf_counter() - sent) * 1e3, 3)})
            await asyncio.sleep(PROBE_EVERY_S)


async def _slow_level(server: _Server, count: int, hold_s: float) -> dict[str, Any]:
    host, port = "127.0.0.1", server.port
    stop = asyncio.Event()
    sockets = [_SlowSocket("headers" if i % 2 == 0 else "body") for i in range(count)]
    origin = time.perf_counter()
    runs = []
    for i, s in enumerate(sockets):  # open in batches, as a client would ramp up
        runs.append(asyncio.create_task(s.run(host, port, stop)))
        if i % 64 == 63:
            await asyncio.sleep(0.01)
    probes: list[dict[str, Any]] = []
    probe = asyncio.create_task(_probe_loop(server.url, stop, probes, origin))
    held_over_time = []
    while time.perf_counter() - origin < hold_s:
        await asyncio.sleep(1.0)
        held_over_time.append([round(time.perf_counter() - origin, 2), sum(s.held() for s in sockets),
                               sum(s.held() for s in sockets if s.kind == "headers")])
    stop.set()
    await probe
    await asyncio.gather(*runs, return_exceptions=True)
    endings: dict[str, int] = {}
    for s in sockets:
        endings[f"{s.kind}: {s.ending()}"] = endings.get(f"{s.kind}: {s.ending()}", 0) + 1
    closed_after = [s.closed - s.opened for s in sockets if s.opened is not None and s.closed is not None]
    ok = [p for p in probes if p["status"] == 200]
    return {"slow_sockets": count, "hold_s": hold_s, "connected": sum(s.opened is not None for s in sockets),
            "held_at_end": held_over_time[-1][1] if held_over_time else 0,
            "held_max": max((h[1] for h in held_over_time), default=0),
            "held_over_time_s_total_headers": held_over_time, "endings": dict(sorted(endings.items())),
            "closed_after_s": {"min": _round(min(closed_after)) if closed_after else None,
                               "p50": _round(_percentile(closed_after, 50)),
                               "max": _round(max(closed_after)) if closed_after else None},
            "probes": len(probes), "probes_ok": len(ok),
            "probe_ms": {route: _stats([p["ms"] / 1e3 for p in ok if p["route"] == route])
                         for route in ("/v1/completions", "/health")},
            "probe_failures": sorted({str(p["status"]) for p in probes if p["status"] != 200}),
            "probe_samples": probes}


def _slowloris(server: _Server, quick: bool) -> list[dict[str, Any]]:
    levels = (0, 64) if quick else SLOW_LEVELS
    out = []
    for count in levels:
        level = asyncio.run(_slow_level(server, count, 3.0 if quick else SLOW_HOLD_S))
        level["server_alive_after"] = server.alive()
        out.append(level)
        print(f"  slowloris {count}: held max {level['held_max']} / end {level['held_at_end']}; probes "
              f"{level['probes_ok']}/{level['probes']} ok; completion p50/max {level['probe_ms']['/v1/completions']}",
              flush=True)
        time.sleep(1.0)
    return out


def _keepalive_vs_fresh(url: str, count: int = 40) -> dict[str, Any]:
    """Sequential /health on an idle server, over one keep-alive connection and over a new
    connection each: the keep-alive figure shows what a response costs on a reused connection
    (e.g. ~40 ms of Nagle + delayed ACK when accepted sockets lack TCP_NODELAY)."""
    out = {}
    for name, limits in (("keepalive", httpx.Limits()), ("fresh_connection", httpx.Limits(max_keepalive_connections=0))):
        with httpx.Client(limits=limits, timeout=30) as client:
            client.get(url + "/health")
            times = []
            for _ in range(count):
                start = time.perf_counter()
                client.get(url + "/health")
                times.append(time.perf_counter() - start)
        out[name] = _stats(times)
    return out


# ----------------------------------------------------------------------------- the suite


def _versions() -> dict[str, Optional[str]]:
    from importlib import metadata
    out = {}
    for name in ("fastapi", "starlette", "uvicorn", "h11", "pydantic", "tokenizers", "transformers", "httpx"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run(device: str, quick: bool = False) -> dict:
    from .compile import git_state
    load_before, git = os.getloadavg(), git_state()
    server = _Server(device)
    try:
        startup = server.wait_ready()
        reference = _greedy_text(server.url)
        health_idle = _keepalive_vs_fresh(server.url)
        print("hostile classes", flush=True)
        hostile = _hostile(server, quick, reference)
        print("15 MB requests", flush=True)
        stall = _stall(server, quick)
        print("slowloris", flush=True)
        slow = _slowloris(server, quick)
        greedy_at_end = _greedy_text(server.url)
        log_tail = server.log_tail(3000)
    finally:
        exit_code = server.stop()
    classes = hostile["classes"]
    total_5xx = sum(c["5xx"] for c in classes.values())
    return {"suite": "hardening",
            "config": {"model": "demo model (vgraph.models.demo, served as demo-model-v1)",
                       "server_flags": " ".join(SERVER_ARGS[:-1] + ["<key>"]),
                       "server_descriptor_limit": SERVER_NOFILE, "versions": _versions(),
                       "big_request_bytes": BIG_BYTES, "big_routes": list(BIG_ROUTES), "window_s": WINDOW_S,
                       "health_poll_every_s": HEALTH_EVERY_S, "rss_every_s": RSS_EVERY_S,
                       "slowloris_levels": list((0, 64) if quick else SLOW_LEVELS),
                       "slowloris_hold_s": 3.0 if quick else SLOW_HOLD_S, "probe_every_s": PROBE_EVERY_S,
                       "server_omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "git": git,
                       "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
            "startup_to_ready_s": startup, "exit_code_after_sigterm": exit_code,
            "health_idle_ms": health_idle, "greedy_reference": reference, "greedy_unchanged_at_end": greedy_at_end == reference,
            "hostile": hostile, "stall": stall, "slowloris": slow,
            "target": {"no_5xx": {"value": total_5xx, "met": total_5xx == 0},
                       "no_connection_errors": {"value": sum(c["connection_errors"] for c in classes.values()),
                                                "met": all(c["connection_errors"] == 0 for c in classes.values())},
                       "slowloris_all_probes_served_up_to": max(
                           (lv["slow_sockets"] for lv in slow if lv["probes"] and lv["probes_ok"] == lv["probes"]),
                           default=None)},
            "server_log_tail": log_tail}


def summarize(result: dict) -> str:
    lines = [f"{'class':26s} tried  5xx conn-err  status codes"]
    for name, c in result["hostile"]["classes"].items():
        lines.append(f"{name:26s} {c['tried']:5d} {c['5xx']:4d} {c['connection_errors']:8d}  "
                     f"{', '.join(f'{k}: {v}' for k, v in c['status_counts'].items())}")
    lines.append(f"target no 5xx: {result['target']['no_5xx']}")
    idle = result["health_idle_ms"]
    lines.append(f"/health on an idle server, p50/max ms: keep-alive {idle['keepalive']['p50']}/"
                 f"{idle['keepalive']['max']}, fresh connection {idle['fresh_connection']['p50']}/"
                 f"{idle['fresh_connection']['max']}")
    lines.append("15 MB request      status  time(s) | ITL p50/max ms before -> during | /health p50/max ms "
                 "before -> during | RSS MiB before/peak/after")
    for t in result["stall"]:
        itl, h, r = t["itl_ms"], t["health_ms"], t["rss_mib"]
        lines.append(f"{t['route']:20s} {str(t['status']):>5s} {t['request_s']:8.2f} | "
                     f"{itl['before']['p50']}/{itl['before']['max']} -> {itl['during']['p50']}/{itl['during']['max']} | "
                     f"{h['before']['p50']}/{h['before']['max']} -> {h['during']['p50']}/{h['during']['max']} | "
                     f"{r['before']}/{r['during_peak']}/{r['after']}")
    lines.append(f"slow sockets with every probe served: up to {result['target']['slowloris_all_probes_served_up_to']}")
    lines.append("slowloris sockets  held max/end  probes ok  completion p50/max ms  /health p50/max ms")
    for lv in result["slowloris"]:
        c, h = lv["probe_ms"]["/v1/completions"], lv["probe_ms"]["/health"]
        lines.append(f"{lv['slow_sockets']:17d}  {lv['held_max']:5d}/{lv['held_at_end']:<5d} "
                     f"{lv['probes_ok']:4d}/{lv['probes']:<4d}  {c['p50']}/{c['max']}  {h['p50']}/{h['max']}")
    return "\n".join(lines)


def plot(result: dict):
    """Per 15 MB request: the stream's inter-token gaps and /health latency (log ms) and the
    server's RSS around it; and slow sockets held over time per slowloris level."""
    import matplotlib.pyplot as plt
    trials = [t for t in result["stall"] if t.get("rep", 0) == 0]
    fig, axes = plt.subplots(1, len(trials) + 1, figsize=(6 * (len(trials) + 1), 4.5), constrained_layout=True)
    for ax, t in zip(axes, trials):
        s = t["samples"]
        if s["itl_at_s_ms"]:
            ax.plot(*zip(*s["itl_at_s_ms"]), ".", markersize=2, label="inter-token gap", color="tab:blue")
        if s["health_at_s_ms"]:
            ax.plot(*zip(*s["health_at_s_ms"]), "-", linewidth=0.8, label="/health latency", color="tab:orange")
        ax.axvspan(*s["request_window_s"], color="grey", alpha=0.2, label="15 MB request in flight")
        ax.set_yscale("log")
        ax.set_xlabel("s from the 15 MB request's start")
        ax.set_ylabel("ms")
        ax.set_title(f"{t['route']}: {t['status']} in {t['request_s']:.2f} s")
        right = ax.twinx()
        if s["rss_at_s_mib"]:
            right.plot(*zip(*s["rss_at_s_mib"]), color="tab:green", linewidth=1, label="server RSS")
        right.set_ylabel("RSS MiB")
        right.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)
        right.legend(loc="upper right", fontsize=8)
    ax = axes[-1]
    for lv in result["slowloris"]:
        if lv["held_over_time_s_total_headers"]:
            xs, totals, _ = zip(*lv["held_over_time_s_total_headers"])
            ax.plot(xs, totals, "-o", markersize=3,
                    label=f"{lv['slow_sockets']} slow: probes {lv['probes_ok']}/{lv['probes']} ok")
    ax.set_xlabel("s since the slow sockets opened")
    ax.set_ylabel("slow sockets the server still holds")
    ax.set_title("slowloris")
    ax.legend(fontsize=8)
    m = result.get("machine", {})
    fig.suptitle(f"hardening: vgraph serve (demo model, eager)  [{m.get('date', '')}, {m.get('device', '')}]")
    return fig
