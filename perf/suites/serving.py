"""Serving latency and throughput: TTFT, TPOT, ITL and end-to-end latency (p50/p90/p99) and
request throughput, from an HTTP load generator against a real ``vgraph serve`` process, at
fixed concurrency levels (closed loop) and at Poisson arrival rates (open loop).

Why this shape: what a user of the server feels is the latency of its HTTP stream, which
includes everything the engine's own timers do not see (the event loop, SSE framing, the
kernel's socket buffers, GIL contention between the HTTP thread and the engine thread). So the
server runs as a separate process started the way a user starts it (``vgraph serve`` on the
demo model, compiled by default, and ``--enforce-eager`` for reference), and the client here
speaks plain HTTP with ``aiohttp``, timestamping each SSE event as it arrives. Why aiohttp (as
``vllm bench serve`` uses) and not httpx: a load generator must not be what it measures, and
httpx's connection pool cost the client about 5 ms per new request at 64 connections, so a wave
of 64 requests reached the server over 300-450 ms after the client had started them all, which
the results then counted as the server's time to first token (``python -m perf.client_ab``).

Every request: a streaming ``/v1/completions`` with a distinct prompt of ~48 tokens (so the
prefix cache does not shortcut prefills), greedy, ``ignore_eos``, a fixed number of new tokens.
Requests ask for ``logprobs: 0``: every generated token is then reported in some event even when
it completes no printable character (a byte-level model can emit partial UTF-8 sequences),
so events map to tokens.

Two workloads per server:
- closed loop at concurrency C in ``CONCURRENCY``: C workers send requests back to back until
  ``max(32, 4C)`` have finished. Its request throughput at the largest C is the server's
  measured capacity.
- open loop (Poisson): requests are sent at exponential inter-arrival times (seed
  ``POISSON_SEED``), each as its own asyncio task launched on schedule whether or not earlier
  ones finished, so a slow server meets a growing queue as it would with real users (a closed
  loop instead slows its arrivals down with the server). Rates are ``RATE_FRACTIONS`` of the
  compiled server's capacity, rounded, and the eager server gets the same rates.

Metrics, per request unless said otherwise:
- TTFT: request sent -> first event carrying a token.
- E2E: request sent -> end of the response stream.
- TPOT: ``(E2E - TTFT) / (tokens - 1)``, the mean time per output token after the first.
- ITL (per token): gaps between successive token-carrying events of a stream; an event carrying
  k tokens (the server coalesces when the client falls behind) counts as k samples of gap / k.
- request throughput: finished requests / (first send -> last response end); output token
  throughput likewise. Open loop also: the achieved send rate and how late the client sent.
- Server-side means (from ``/metrics`` histogram sums, same requests) are reported alongside,
  so the HTTP overhead is visible as the difference.

On a 2-core machine the load generator competes with the server for the CPU; the load average
before and after is stored in the results so a noisy run can be recognized and repeated.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

import aiohttp
import httpx

CONCURRENCY = (1, 8, 32)
RATE_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
POISSON_SEED = 0
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")
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
    """p50/p90/p99/mean in ms; with n samples, p99 is the maximum until n >= 100."""
    scaled = [v * 1e3 for v in values]
    out: dict[str, Optional[float]] = {f"p{q}": _percentile(scaled, q) for q in PERCENTILES}
    out.update(mean=statistics.fmean(scaled) if scaled else None, samples=len(scaled))
    return out


def wait_until_healthy(proc: subprocess.Popen, url: str, start: float, log_text: Callable[[], str]) -> float:
    """Seconds from ``start`` until ``/health`` answers 200; raises with the server's log if it
    exits or takes longer than ``STARTUP_TIMEOUT_S``."""
    deadline = start + STARTUP_TIMEOUT_S
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vgraph serve exited with {proc.returncode}: {log_text()}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"vgraph serve was not ready in {STARTUP_TIMEOUT_S} s: {log_text()}")


def stop_server(proc: subprocess.Popen, log: IO[str]) -> int:
    """SIGTERM (a kill after 120 s), then the log file removed; the server's exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
    finally:
        log.close()
        os.unlink(log.name)


class ServerUnderTest:
    """``vgraph serve`` in a child process; its log goes to a temporary file."""

    def __init__(self, device: str, eager: bool, max_num_seqs: int, extra_args: Sequence[str] = (),
                 extra_env: Optional[dict[str, str]] = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vgraph-serve-perf-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "vgraph.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--device", device, "--max-num-seqs", str(max_num_seqs), "--kv-cache-gib", "0.25"]
        if eager:
            cmd.append("--enforce-eager")
        cmd.extend(extra_args)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(extra_env or {})
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> float:
        return wait_until_healthy(self.proc, self.url, self.start, self._log_text)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vgraph:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                out[name.split("{", 1)[0]] = float(value)
        return out

    def stop(self) -> int:
        return stop_server(self.proc, self.log)

    def _log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]


def request_body(prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "demo-model-v1", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True}


async def _one_stream(session: aiohttp.ClientSession, url: str, index: int, max_tokens: int,
                      scheduled: Optional[float] = None,
                      prompt_of: Callable[[int], str | list[int]] = _prompt) -> dict[str, Any]:
    """One streamed request, timed from inside its task, so an open-loop request that the event
    loop started late is timed from its real send (the lateness is kept separately).
    ``prompt_of(index)``: the prompt, text or token ids (the e2e suite sends fixed-length ids)."""
    sent = time.perf_counter()
    async with session.post(url + "/v1/completions", json=request_body(prompt_of(index), max_tokens)) as response:
        response.raise_for_status()
        events = await timed_events(response.content)  # one SSE line at a time
    return stream_record(index, max_tokens, sent, events, time.perf_counter(), scheduled)


async def timed_events(lines: AsyncIterator[bytes | str]) -> list[tuple[float, int]]:
    """(arrival time, tokens) of each SSE event that carries tokens (counted by their logprobs
    entries, so a token that completes no printable character still counts)."""
    out = []
    async for line in lines:
        if line[:7] not in (b"data: {", "data: {"):
            continue
        now = time.perf_counter()
        chunk = json.loads(line[6:])
        new = sum(len(c["logprobs"]["tokens"]) for c in chunk["choices"] if c.get("logprobs"))
        if new:
            out.append((now, new))
    return out


def stream_record(index: int, max_tokens: int, sent: float, events: list[tuple[float, int]], done: float,
                  scheduled: Optional[float]) -> dict[str, Any]:
    """One request's timings from its events: TTFT, TPOT, and per-token gaps (an event carrying
    k tokens counts as k gaps of a k-th of its wait)."""
    tokens = sum(new for _, new in events)
    if tokens != max_tokens:
        raise RuntimeError(f"request {index} streamed {tokens} tokens, expected {max_tokens}")
    first = events[0][0]
    gaps = [(now - before) / new for (before, _), (now, new) in zip(events, events[1:]) for _ in range(new)]
    return {"sent": sent, "done": done, "ttft": first - sent, "e2e": done - sent, "gaps": gaps,
            "tpot": (done - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens, "events": len(events),
            "late": sent - scheduled if scheduled is not None else None}


def _session(connections: Optional[int]) -> aiohttp.ClientSession:
    """Kept-alive connections, at most ``connections`` at once (None: no limit)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections or 0),
                                 timeout=aiohttp.ClientTimeout(total=600))


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds * 1e3, 3)


def _level_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Percentiles, throughputs and the raw per-request samples (per-token gaps only as each
    request's max: all of them would make the results file ~10x larger)."""
    start = min(r["sent"] for r in records)
    wall = max(r["done"] for r in records) - start
    tokens = sum(r["tokens"] for r in records)
    out: dict[str, Any] = {"requests": len(records), "wall_s": wall, "request_throughput": len(records) / wall,
                           "output_tokens_per_s": tokens / wall,
                           "tokens_per_event": tokens / max(1, sum(r["events"] for r in records))}
    for m in METRICS:
        values = [g for r in records for g in r["gaps"]] if m == "itl" else [r[m] for r in records]
        out[f"{m}_ms"] = _stats_ms([v for v in values if v is not None])
    ordered = sorted(records, key=lambda r: r["sent"])
    out["samples"] = {"sent_at_s": [round(r["sent"] - start, 4) for r in ordered],
                      **{f"{m}_ms": [_ms(r[m]) for r in ordered] for m in ("ttft", "tpot", "e2e")},
                      "itl_max_ms": [_ms(max(r["gaps"], default=None)) for r in ordered]}
    return out


async def _closed_level(url: str, concurrency: int, num_requests: int, max_tokens: int,
                        offset: int, prompt_of: Callable[[int], str | list[int]] = _prompt) -> dict[str, Any]:
    """A closed loop of ``concurrency`` workers until ``num_requests`` streams have finished."""
    async with _session(concurrency) as session:
        records = await closed_loop(concurrency, num_requests, offset, lambda i: _one_stream(
            session, url, i, max_tokens, prompt_of=prompt_of))
    return {"concurrency": concurrency, "max_tokens": max_tokens, **_level_stats(records)}


async def closed_loop(concurrency: int, num_requests: int, offset: int,
                      one: Callable[[int], Awaitable[dict[str, Any]]]) -> list[dict[str, Any]]:
    """``concurrency`` workers each awaiting ``one(index)`` back to back, for indices
    ``offset..offset + num_requests - 1``: the records in the order they finished."""
    records: list[dict[str, Any]] = []
    counter = iter(range(offset, offset + num_requests))

    async def worker() -> None:
        for i in counter:
            records.append(await one(i))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def _poisson_arrivals(rate: float, num_requests: int, seed: int) -> list[float]:
    """Send times (s from the first send): exponential gaps rescaled to sum to (n - 1) / rate.

    That is a Poisson process conditioned on its n arrivals spanning exactly that time, so the
    schedule's mean rate is the nominal one (unscaled, 128 draws miss it by ~9% at one sigma;
    seed 0 sends 14% slower). The same seed at every rate gives the same burst pattern, scaled,
    so rates differ only in load."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(num_requests - 1)]
    scale = (num_requests - 1) / rate / sum(gaps) if gaps else 0.0
    return list(itertools.accumulate([0.0] + [g * scale for g in gaps]))


async def _poisson_level(url: str, rate: float, num_requests: int, max_tokens: int,
                         offset: int) -> dict[str, Any]:
    """Open loop: each request is a task started at its arrival time, independent of completions."""
    arrivals = _poisson_arrivals(rate, num_requests, POISSON_SEED)
    async with _session(None) as session:
        start = time.perf_counter()
        tasks = []
        for i, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(_one_stream(session, url, offset + i, max_tokens, start + at)))
        records = await asyncio.gather(*tasks)
    stats = _level_stats(records)
    sends = sorted(r["sent"] for r in records)
    late = [r["late"] * 1e3 for r in records]
    return {"rate": rate, "max_tokens": max_tokens, "seed": POISSON_SEED,
            "achieved_rate": (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 else None,
            "send_late_ms": {"mean": statistics.fmean(late), "max": max(late)},
            **stats, "samples": {**stats["samples"], "late_ms": [round(v, 3) for v in late]}}


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


def _measured(server: ServerUnderTest, level: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Runs one level and adds the engine's own means over exactly its requests."""
    before = server.metrics()
    result = asyncio.run(level)
    result.update(_server_means(before, server.metrics()))
    return result


def poisson_rates(capacity: float) -> list[float]:
    """``RATE_FRACTIONS`` of the measured capacity (req/s), to two significant digits."""
    return [float(f"{capacity * f:.2g}") for f in RATE_FRACTIONS]


def _serve_variant(device: str, eager: bool, quick: bool, rates: Optional[list[float]]) -> dict[str, Any]:
    """Both workloads against one server; ``rates`` None means derive them from this server."""
    max_tokens = 16 if quick else 64
    server = ServerUnderTest(device, eager, max_num_seqs=max(CONCURRENCY))
    try:
        startup = server.wait_ready()
        asyncio.run(_closed_level(server.url, 4, 8, 8, offset=10_000))  # warm-up: first-request effects
        closed, offset = [], 0
        for c in CONCURRENCY:
            n = c if quick else max(32, 4 * c)
            closed.append(_measured(server, _closed_level(server.url, c, n, max_tokens, offset)))
            offset += n
        rates = rates or poisson_rates(closed[-1]["request_throughput"])
        poisson = []
        for rate in rates:
            n = 16 if quick else 128
            poisson.append(_measured(server, _poisson_level(server.url, rate, n, max_tokens, offset)))
            offset += n
    finally:
        exit_code = server.stop()
    return {"startup_to_ready_s": startup, "exit_code_after_sigterm": exit_code, "levels": closed,
            "poisson": poisson}


def run(device: str, quick: bool = False) -> dict:
    from .compile import git_state
    load_before, git = os.getloadavg(), git_state()
    variants = {"compiled": _serve_variant(device, eager=False, quick=quick, rates=None)}
    rates = [p["rate"] for p in variants["compiled"]["poisson"]]
    if not quick:
        variants["eager"] = _serve_variant(device, eager=True, quick=quick, rates=rates)
    return {"suite": "serving",
            "config": {"model": "demo model (vgraph.models.demo, served as demo-model-v1)",
                       "concurrency": list(CONCURRENCY), "max_tokens": 16 if quick else 64,
                       "requests_per_level": "C" if quick else "max(32, 4C)", "prompt_tokens": "~48, distinct",
                       "poisson": {"rates_req_per_s": rates, "fractions_of_capacity": list(RATE_FRACTIONS),
                                   "capacity": "compiled request throughput at the largest concurrency",
                                   "requests_per_rate": 16 if quick else 128, "seed": POISSON_SEED},
                       "server_flags": "--max-num-seqs 32 --kv-cache-gib 0.25 (+ --enforce-eager for eager)",
                       "server_omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "git": git,
                       "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
            "variants": variants}


def _fmt3(stats: dict[str, Optional[float]]) -> str:
    return " ".join(f"{stats[f'p{q}']:6.1f}" if stats[f"p{q}"] is not None else "     -" for q in PERCENTILES)


def _metric_cols(lv: dict[str, Any]) -> str:
    return " | ".join(_fmt3(lv[f"{m}_ms"]) for m in METRICS)


def summarize(result: dict) -> str:
    """Two tables (closed loop, Poisson), each metric as p50 p90 p99 in ms."""
    head = " | ".join(f"{m.upper():>4s} p50    p90    p99" for m in METRICS)
    lines = [f"closed loop       conc reqs | {head} | req/s  tok/s | srvTTFT srvITL"]
    for name, variant in result["variants"].items():
        for lv in variant["levels"]:
            lines.append(f"{name:9s}         {lv['concurrency']:4d} {lv['requests']:4d} | {_metric_cols(lv)} | "
                         f"{lv['request_throughput']:5.2f} {lv['output_tokens_per_s']:6.0f} | "
                         f"{lv['server_ttft_mean_ms'] or 0:7.1f} {lv['server_itl_mean_ms'] or 0:6.1f}")
    lines.append(f"poisson  rate  sent reqs | {head} | req/s  tok/s | maxlate")
    for name, variant in result["variants"].items():
        for lv in variant.get("poisson", []):
            lines.append(f"{name:9s}{lv['rate']:5.1f} {lv['achieved_rate'] or 0:5.1f} {lv['requests']:4d} | "
                         f"{_metric_cols(lv)} | {lv['request_throughput']:5.2f} {lv['output_tokens_per_s']:6.0f} | "
                         f"{lv['send_late_ms']['max']:7.1f}")
    for name, variant in result["variants"].items():
        lines.append(f"{name}: startup to ready {variant['startup_to_ready_s']:.1f} s; "
                     f"exit code after SIGTERM {variant['exit_code_after_sigterm']}")
    lines.append("(ms, measured by the HTTP client; req/s and tok/s over first send -> last response end; "
                 "sent = achieved send rate; srv = engine-side means from /metrics; maxlate = latest client send)")
    return "\n".join(lines)


def _latency_panel(ax, result: dict, section: str, xkey: str, metric: str) -> None:
    """p50 solid with markers, p90 dashed, p99 dotted; one colour per variant."""
    for color, (name, variant) in zip(("tab:blue", "tab:orange"), result["variants"].items()):
        levels = variant.get(section, [])
        xs = [lv[xkey] for lv in levels]
        for q, style in zip(PERCENTILES, ("-o", "--", ":")):
            ax.plot(xs, [lv[f"{metric}_ms"][f"p{q}"] for lv in levels], style, color=color,
                    label=f"{name} p{q}", markersize=4)
    _plain_log_y(ax)


def _plain_log_y(ax) -> None:
    """Log y (latencies span 100x between levels) labelled 20, 50, 100 rather than 2x10^1; every
    in-between tick is labelled only when the panel spans less than a decade."""
    from matplotlib.ticker import FuncFormatter
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    wide = high / low >= 10
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda v, _: f"{v:g}" if not wide or f"{v:.0e}"[0] in "25" else ""))
    ax.grid(True, which="both", alpha=0.3)


def _throughput_panel(ax, result: dict, section: str, xkey: str) -> None:
    for color, (name, variant) in zip(("tab:blue", "tab:orange"), result["variants"].items()):
        levels = variant.get(section, [])
        ax.plot([lv[xkey] for lv in levels], [lv["request_throughput"] for lv in levels], "-o", color=color,
                label=name, markersize=4)
    if section == "poisson":
        rates = result["config"]["poisson"]["rates_req_per_s"]
        ax.plot(rates, rates, color="grey", linewidth=0.8, label="offered")
    ax.set_ylabel("finished req/s")
    ax.grid(True, alpha=0.3)


def plot(result: dict):
    """Latency percentiles and throughput vs concurrency (top) and vs Poisson rate (bottom)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(METRICS) + 1, figsize=(21, 8), constrained_layout=True)
    rows = (("levels", "concurrency", "closed loop: concurrency"), ("poisson", "rate", "Poisson: offered req/s"))
    for row, (section, xkey, xlabel) in zip(axes, rows):
        for ax, metric in zip(row, METRICS):
            _latency_panel(ax, result, section, xkey, metric)
            ax.set_title(f"{metric.upper()} (ms)")
        _throughput_panel(row[-1], result, section, xkey)
        row[-1].set_title("request throughput")
        for ax in row:
            ax.set_xlabel(xlabel)
        ticks = (result["config"]["concurrency"] if section == "levels"
                 else result["config"]["poisson"]["rates_req_per_s"])
        for ax in row:
            if section == "levels":
                ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncols=6, fontsize=9)
    axes[1][-1].legend(fontsize=8)
    m = result.get("machine", {})
    fig.suptitle(f"serving: vgraph serve (demo model), {result['config']['max_tokens']} new tokens/request, "
                 f"streamed over HTTP; p50 solid, p90 dashed, p99 dotted  [{m.get('date', '')}, "
                 f"{m.get('device', '')}, {m.get('torch_num_threads', '?')} thread(s)]")
    return fig


# ---------------------------------------------------------------------------- engine process vs in process

ENGINE_LAYOUTS = {"engine process": (), "in process": ("--engine-in-process",)}
LAYOUT_CONCURRENCY = (32, 64)


def compare_engine_layouts(device: str, quick: bool = False) -> dict:
    """``vgraph serve`` (compiled, the default) with the engine in its own process vs on a thread
    of the server process: TTFT and ITL at ``LAYOUT_CONCURRENCY`` streams (closed loop, same
    requests as above).

    Both servers run at once and the levels alternate between them, A B B A per round, so that
    a slow stretch of a shared, noisy machine falls on both; the samples of all rounds are
    pooled per layout and concurrency. The load average before and after is stored."""
    from .compile import git_state
    load_before, git = os.getloadavg(), git_state()
    rounds, max_tokens = (1, 16) if quick else (4, 64)
    servers = {name: ServerUnderTest(device, eager=False, max_num_seqs=max(LAYOUT_CONCURRENCY), extra_args=args)
               for name, args in ENGINE_LAYOUTS.items()}
    records: dict[tuple[str, int], list[dict[str, Any]]] = {(n, c): [] for n in servers for c in LAYOUT_CONCURRENCY}
    try:
        startup = {name: server.wait_ready() for name, server in servers.items()}
        for server in servers.values():
            asyncio.run(_closed_level(server.url, 4, 8, 8, offset=10_000))  # warm-up
        offset = 0
        for r in range(rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for c in LAYOUT_CONCURRENCY:
                for name in (order + order[::-1]) if not quick else order:
                    n = c if quick else 2 * c
                    records[name, c].append(_measured(servers[name], _closed_level(servers[name].url, c, n,
                                                                                      max_tokens, offset)))
                    offset += n
    finally:
        exits = {name: server.stop() for name, server in servers.items()}
    table = {f"{name} @ {c}": _pooled(levels) for (name, c), levels in records.items()}
    return {"suite": "serving-engine-process",
            "config": {"model": "demo model, compiled (the default)", "concurrency": list(LAYOUT_CONCURRENCY),
                       "max_tokens": max_tokens, "rounds": rounds, "requests_per_level": "C" if quick else "2C",
                       "order": "A B B A per concurrency, A/B swapped every round; both servers up at once",
                       "server_flags": f"--max-num-seqs {max(LAYOUT_CONCURRENCY)} --kv-cache-gib 0.25 "
                                       "(+ --engine-in-process for 'in process')",
                       "git": git, "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
            "startup_to_ready_s": startup, "exit_codes_after_sigterm": exits, "pooled": table,
            "levels": {f"{name} @ {c}": levels for (name, c), levels in records.items()}}


def _pooled(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT / TPOT / E2E percentiles over every request of the rounds (their per-request samples
    are stored); ITL's per-token gaps are not stored, so its percentiles are each level's,
    averaged over the rounds."""
    out: dict[str, Any] = {"requests": sum(lv["requests"] for lv in levels),
                           "request_throughput_mean": statistics.fmean(lv["request_throughput"] for lv in levels)}
    for m in ("ttft", "tpot", "e2e"):
        out[f"{m}_ms"] = _stats_ms([v / 1e3 for lv in levels for v in lv["samples"][f"{m}_ms"] if v is not None])
    for q in PERCENTILES:
        out[f"itl_p{q}_ms_mean_of_levels"] = statistics.fmean(lv["itl_ms"][f"p{q}"] for lv in levels)
    out["server_itl_mean_ms"] = statistics.fmean(lv["server_itl_mean_ms"] or 0 for lv in levels)
    return out


def summarize_engine_layouts(result: dict) -> str:
    lines = ["layout @ streams          reqs | TTFT p50    p99 | ITL p50    p99 | TPOT p50 | req/s"]
    for key, row in result["pooled"].items():
        lines.append(f"{key:24s} {row['requests']:5d} | {row['ttft_ms']['p50']:8.1f} {row['ttft_ms']['p99']:6.1f} | "
                     f"{row['itl_p50_ms_mean_of_levels']:7.1f} {row['itl_p99_ms_mean_of_levels']:6.1f} | "
                     f"{row['tpot_ms']['p50']:8.1f} | {row['request_throughput_mean']:5.2f}")
    cfg = result["config"]
    lines.append(f"(ms, HTTP client; {cfg['rounds']} interleaved round(s); load average {cfg['load_avg_before']} "
                 f"before, {cfg['load_avg_after']} after; ITL percentiles are means over the levels)")
    return "\n".join(lines)
