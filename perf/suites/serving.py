"""Serving latency: time to first token and inter-token latency (p50/p99) at 1, 8 and 32
concurrent streams, from an HTTP load generator against a real ``vgraph serve`` process.

Why this shape: what a user of the server feels is the latency of its HTTP stream, which
includes everything the engine's own timers do not see (the event loop, SSE framing, the
kernel's socket buffers, GIL contention between the HTTP thread and the engine thread). So the
server runs as a separate process started the way a user starts it (``vgraph serve`` on the
demo model, compiled by default, and ``--enforce-eager`` for reference), and the client here
speaks plain HTTP with ``httpx``, timestamping each SSE event as it arrives.

Workload per concurrency level C: a closed loop of C workers, each sending streaming
``/v1/completions`` requests back to back until ``2 * C`` requests (at least 8) have finished;
distinct prompts of ~48 tokens (so the prefix cache does not shortcut prefills), greedy,
``ignore_eos``, a fixed number of new tokens. Requests ask for ``logprobs: 0``: every generated
token is then reported in some event even when it completes no printable character (the
untrained demo model produces many partial UTF-8 sequences), so events map to tokens.

- TTFT: request sent -> first event carrying a token.
- ITL: gaps between successive token-carrying events of a stream; an event carrying k tokens
  (the server coalesces when the client falls behind) counts as k samples of gap / k.
- Server-side means (from ``/metrics`` histogram sums, same requests) are reported alongside,
  so the HTTP overhead is visible as the difference.

On a 2-core machine the load generator competes with the server for the CPU; the load average
before and after is stored in the results so a noisy run can be recognized and repeated.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import httpx

CONCURRENCY = (1, 8, 32)
PROMPT_WORDS = ("river", "bread", "village", "morning", "engine", "garden", "window", "market", "winter",
                "bridge", "library", "summer", "castle", "forest", "number", "letter")
STARTUP_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(i: int) -> str:
    """A distinct ~48-token prompt per request index (no shared prefix beyond a few tokens)."""
    words = [PROMPT_WORDS[(i * 7 + k * 3 + k * k) % len(PROMPT_WORDS)] for k in range(24)]
    return f"{i}: " + " ".join(words)


def _percentile(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in [0, 100]); None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def _stats_ms(values: list[float]) -> dict[str, Optional[float]]:
    scaled = [v * 1e3 for v in values]
    return {"p50": _percentile(scaled, 50), "p99": _percentile(scaled, 99),
            "mean": statistics.fmean(scaled) if scaled else None, "samples": len(scaled)}


class ServerUnderTest:
    """``vgraph serve`` in a child process; its log goes to a temporary file."""

    def __init__(self, device: str, eager: bool, max_num_seqs: int) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vgraph-serve-perf-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "vgraph.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--device", device, "--max-num-seqs", str(max_num_seqs), "--kv-cache-gib", "0.25"]
        if eager:
            cmd.append("--enforce-eager")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> float:
        deadline = self.start + STARTUP_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vgraph serve exited with {self.proc.returncode}: {self._log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.perf_counter() - self.start
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"vgraph serve was not ready in {STARTUP_TIMEOUT_S} s: {self._log_text()}")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vgraph:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                out[name.split("{", 1)[0]] = float(value)
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()
            os.unlink(self.log.name)

    def _log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]


async def _one_stream(client: httpx.AsyncClient, url: str, index: int, max_tokens: int) -> dict[str, Any]:
    body = {"model": "demo-model-v1", "prompt": _prompt(index), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True}
    sent = time.perf_counter()
    first: Optional[float] = None
    last: Optional[float] = None
    gaps: list[float] = []
    tokens = events = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            new = sum(len(c["logprobs"]["tokens"]) for c in chunk["choices"] if c.get("logprobs"))
            if not new:
                continue
            events += 1
            tokens += new
            if first is None:
                first = now
            else:
                gaps.extend([(now - last) / new] * new)
            last = now
    if tokens != max_tokens:
        raise RuntimeError(f"request {index} streamed {tokens} tokens, expected {max_tokens}")
    return {"ttft": first - sent, "gaps": gaps, "tokens": tokens, "events": events, "e2e": last - sent}


async def _level(url: str, concurrency: int, num_requests: int, max_tokens: int, offset: int) -> dict[str, Any]:
    """A closed loop of ``concurrency`` workers until ``num_requests`` streams have finished."""
    results: list[dict[str, Any]] = []
    counter = iter(range(num_requests))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in counter:
            results.append(await _one_stream(client, url, offset + i, max_tokens))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "max_tokens": max_tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall, "ttft_ms": _stats_ms([r["ttft"] for r in results]),
            "itl_ms": _stats_ms([g for r in results for g in r["gaps"]]),
            "e2e_ms": _stats_ms([r["e2e"] for r in results]),
            "tokens_per_event": tokens / max(1, sum(r["events"] for r in results))}


def _server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, Optional[float]]:
    """Mean TTFT / ITL / queue time in ms as the engine measured them, over the same requests."""
    out: dict[str, Optional[float]] = {}
    for key, name in (("server_ttft_mean_ms", "time_to_first_token_seconds"),
                      ("server_itl_mean_ms", "inter_token_latency_seconds"),
                      ("server_queue_mean_ms", "request_queue_time_seconds")):
        count = after[f"vgraph:{name}_count"] - before[f"vgraph:{name}_count"]
        total = after[f"vgraph:{name}_sum"] - before[f"vgraph:{name}_sum"]
        out[key] = total / count * 1e3 if count else None
    return out


def _serve_variant(device: str, eager: bool, quick: bool) -> dict[str, Any]:
    max_tokens = 16 if quick else 64
    server = ServerUnderTest(device, eager, max_num_seqs=max(CONCURRENCY))
    try:
        startup = server.wait_ready()
        asyncio.run(_level(server.url, 4, 8, 8, offset=10_000))  # warm-up: first-request effects
        levels = []
        offset = 0
        for concurrency in CONCURRENCY:
            num_requests = concurrency if quick else max(8, 2 * concurrency)
            before = server.metrics()
            level = asyncio.run(_level(server.url, concurrency, num_requests, max_tokens, offset))
            level.update(_server_means(before, server.metrics()))
            levels.append(level)
            offset += num_requests
    finally:
        exit_code = server.stop()
    return {"startup_to_ready_s": startup, "exit_code_after_sigterm": exit_code, "levels": levels}


def run(device: str, quick: bool = False) -> dict:
    load_before = os.getloadavg()
    variants = {"compiled": _serve_variant(device, eager=False, quick=quick)}
    if not quick:
        variants["eager"] = _serve_variant(device, eager=True, quick=quick)
    return {"suite": "serving",
            "config": {"model": "demo model (vgraph.models.demo, served as demo-model-v1)",
                       "concurrency": list(CONCURRENCY), "max_tokens": 16 if quick else 64,
                       "requests_per_level": "C" if quick else "max(8, 2C)", "prompt_tokens": "~48, distinct",
                       "server_flags": "--max-num-seqs 32 --kv-cache-gib 0.25 (+ --enforce-eager for eager)",
                       "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
            "variants": variants}


def summarize(result: dict) -> str:
    def fmt(v: Optional[float]) -> str:
        return f"{v:8.1f}" if v is not None else "       -"

    lines = ["variant   conc  reqs  TTFT p50  TTFT p99   ITL p50   ITL p99  tok/s  srv TTFT  srv ITL  tok/event"]
    for name, variant in result["variants"].items():
        for lv in variant["levels"]:
            lines.append(f"{name:9s} {lv['concurrency']:4d} {lv['requests']:5d}  {fmt(lv['ttft_ms']['p50'])}  "
                         f"{fmt(lv['ttft_ms']['p99'])}  {fmt(lv['itl_ms']['p50'])}  {fmt(lv['itl_ms']['p99'])} "
                         f"{lv['output_tokens_per_s']:6.0f}  {fmt(lv['server_ttft_mean_ms'])} "
                         f"{fmt(lv['server_itl_mean_ms'])}  {lv['tokens_per_event']:6.2f}")
        lines.append(f"{name:9s} startup to ready {variant['startup_to_ready_s']:.1f} s; "
                     f"exit code after SIGTERM {variant['exit_code_after_sigterm']}")
    lines.append("(ms; TTFT/ITL measured by the HTTP client, srv = engine-side means from /metrics)")
    return "\n".join(lines)
