"""vgraph's server against vLLM's CPU build, both measured by ``vllm bench serve``.

Why ``vllm bench serve``: it is the load generator vLLM's own figures come from, it speaks
plain OpenAI ``/v1/completions`` to any server, so both servers meet the same client, the same
random prompts (random 128-token inputs, 64 output tokens, EOS ignored, 64 prompts, 16 at a
time) and the same metric definitions: request throughput, TTFT, TPOT (per-request mean time
per output token after the first) and ITL (every gap between two streamed chunks).

Both servers serve the same checkpoint: the perf Llama of ``cpu-peers`` (``llama-24m``: fp32,
hidden 512, 8 layers) from the peers' cache. Both stay up for the whole run and are measured
alternately (A B B A ...), each after one untimed warm-up run, so slow drift of a shared
machine lands on both. The load average is recorded with every run.

Both servers run with ``SEATS`` sequence seats (vLLM's CPU server default) and otherwise their
defaults: the serving step budget on CPU is then 2048 tokens for both.

Targets (issue 33): vgraph's req/s >= 1.1x vLLM's; vgraph's ITL p99 <= 2x its TPOT p50.

``VGRAPH_SERVING_VLLM_VARIANTS="name=--flag value --flag2;name2=..."`` adds vgraph servers with
extra ``vgraph serve`` flags (``ENV=value`` items set their environment) to compare a fix side
by side; ``VGRAPH_SERVING_VLLM_SKIP_VLLM=1`` measures the vgraph servers only;
``VGRAPH_SERVING_VLLM_ROUNDS`` overrides the number of rounds.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

THREADS_1_BUILT_IN = True  # each server runs at its own (all-core) thread count; no 1-thread rerun
MODEL_NAME = "perf-llama"
INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS, CONCURRENCY = 128, 64, 64, 16
ROUNDS = 3
BENCH_TIMEOUT_S = 900
VLLM_KV_CACHE_GIB = 1
SEATS = 128  # --max-num-seqs of both servers: vLLM's CPU server default (vgraph's own is 256)
METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")


@dataclass
class Server:
    """One OpenAI server under test: how it is started, and its process once started."""
    name: str
    argv: list[str]
    env: dict[str, str]
    runs: list[dict] = field(default_factory=list)
    proc: Optional[subprocess.Popen] = None
    log: Optional[Any] = None
    port: int = 0
    startup_s: Optional[float] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _checkpoint() -> str:
    from perf.peers import envs
    from .cpu_peers import MODELS
    model = next(m for m in MODELS if m.name == "llama-24m")
    return envs.ensure_checkpoint(model.name, model.build)


def vgraph_server(name: str, checkpoint: str, port: int, extra: list[str]) -> Server:
    """``vgraph serve`` as a user starts it, plus ``extra`` flags (``ENV=value`` items: environment)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    flags = [item for item in extra if "=" not in item or item.startswith("-")]
    env.update(item.split("=", 1) for item in extra if "=" in item and not item.startswith("-"))
    argv = [sys.executable, "-m", "vgraph.cli", "serve", checkpoint, "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--served-model-name", MODEL_NAME, "--kv-cache-gib", "1", "--max-num-seqs", str(SEATS),
            *flags]
    return Server(name, argv, env, port=port)


def vllm_server(bin_dir: Path, checkpoint: str, port: int) -> Server:
    """``vllm serve`` with its CPU docs' environment (KV space, OpenMP binding, preloads), fp32."""
    from perf.peers import vllm_cpu
    cores = f"0-{(os.cpu_count() or 1) - 1}"
    argv = [str(bin_dir / "vllm"), "serve", checkpoint, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL_NAME, "--dtype", "float32", "--seed", "0", "--max-num-seqs", str(SEATS)]
    return Server("vllm", argv, vllm_cpu.serve_env(bin_dir, VLLM_KV_CACHE_GIB, cores), port=port)


def start(server: Server) -> None:
    """Starts the server's process, its output to a temporary log file."""
    server.log = tempfile.NamedTemporaryFile("w+", prefix=f"serving-vllm-{server.name}-", suffix=".log", delete=False)
    server.proc = subprocess.Popen(server.argv, stdout=server.log, stderr=subprocess.STDOUT, env=server.env)


def wait_ready(server: Server, began: float) -> None:
    from .serving import wait_until_healthy
    server.startup_s = wait_until_healthy(server.proc, server.url, began, lambda: _log_tail(server))


def _log_tail(server: Server) -> str:
    server.log.flush()
    return Path(server.log.name).read_text(errors="replace")[-4000:]


def stop(server: Server) -> None:
    from .serving import stop_server
    if server.proc is not None:
        stop_server(server.proc, server.log)


def bench(bin_dir: Path, server: Server, checkpoint: str, num_prompts: int, seed: int) -> dict:
    """One ``vllm bench serve`` run against ``server``: its saved result, plus the load average."""
    with tempfile.TemporaryDirectory(prefix="vgraph-bench-") as tmp:
        argv = [str(bin_dir / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", server.url,
                "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", checkpoint,
                "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
                "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(num_prompts),
                "--max-concurrency", str(CONCURRENCY), "--ignore-eos", "--seed", str(seed),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                "--save-result", "--save-detailed", "--result-dir", tmp, "--result-filename", "out.json", "--disable-tqdm"]
        load = os.getloadavg()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
                              env=_bench_env(bin_dir))
        if proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve against {server.name} failed: {proc.stdout[-2000:]}"
                               f"{proc.stderr[-2000:]}")
        raw = json.loads((Path(tmp) / "out.json").read_text())
    return {**{m: raw.get(m) for m in METRICS}, "completed": raw.get("completed"), "seed": seed,
            "load_avg_before": load, "load_avg_after": os.getloadavg(), "itls_ms": _itls(raw),
            "tokens_per_event": _tokens_per_event(raw)}


def _tokens_per_event(raw: dict) -> Optional[float]:
    """Output tokens per streamed chunk: 1.0 when every step's tokens reached the client as an
    event of their own; above it, chunks carried several steps' tokens and an ITL gap spans
    them (so a high ITL p99 is the server batching events, not slow steps)."""
    itls, lens = raw.get("itls") or [], raw.get("output_lens") or []
    chunks = sum(len(gaps) + 1 for gaps, n in zip(itls, lens) if n)
    return sum(lens) / chunks if chunks else None


def gap_shape(itls_ms: list[float]) -> dict[str, float]:
    """The fractions of gaps at about one median step (<= 1.25x the median gap), at one and a
    half (to 1.75x), about two (to 2.5x) and beyond: where an ITL p99 of 2x comes from."""
    if not itls_ms:
        return {}
    med = statistics.median(itls_ms)
    edges = [("le_1_25x", 1.25), ("le_1_75x", 1.75), ("le_2_5x", 2.5), ("above", float("inf"))]
    out, low = {}, 0.0
    for name, high in edges:
        out[name] = sum(low * med < g <= high * med for g in itls_ms) / len(itls_ms)
        low = high
    return out


def _itls(raw: dict) -> list[float]:
    """Every inter-chunk gap of the run, ms, sorted (for the stall histogram)."""
    return sorted(round(g * 1e3, 2) for gaps in raw.get("itls", []) or [] for g in gaps)


def _bench_env(bin_dir: Path) -> dict[str, str]:
    """The load generator's environment: vLLM's CPU platform, no preloads (it is a client)."""
    from perf.peers import vllm_cpu
    return vllm_cpu.platform_env({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})


def variants_from_env() -> dict[str, list[str]]:
    spec = os.environ.get("VGRAPH_SERVING_VLLM_VARIANTS", "").strip()
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, flags = item.partition("=")
        out[name.strip()] = flags.split()
    return out


def servers(bin_dir: Path, checkpoint: str) -> list[Server]:
    from .serving import _free_port
    out = [vgraph_server("vgraph", checkpoint, _free_port(), [])]
    out += [vgraph_server(name, checkpoint, _free_port(), extra) for name, extra in variants_from_env().items()]
    if os.environ.get("VGRAPH_SERVING_VLLM_SKIP_VLLM") != "1":
        out.append(vllm_server(bin_dir, checkpoint, _free_port()))
    return out


def measure(all_servers: list[Server], bin_dir: Path, checkpoint: str, rounds: int, num_prompts: int) -> None:
    """Warm-up each, then ``rounds`` timed runs each, the order reversed every round. A server
    is started and made ready one at a time (two compiling at once would distort startup)."""
    for server in all_servers:
        began = time.perf_counter()
        start(server)
        wait_ready(server, began)
        print(f"  {server.name}: ready in {server.startup_s:.1f} s", flush=True)
        bench(bin_dir, server, checkpoint, min(num_prompts, 2 * CONCURRENCY), seed=1000)
    for r in range(rounds):
        order = all_servers if r % 2 == 0 else list(reversed(all_servers))
        for server in order:
            run = bench(bin_dir, server, checkpoint, num_prompts, seed=r)
            server.runs.append(run)
            print(f"  round {r} {server.name}: {_line(run)}", flush=True)


def _line(run: dict) -> str:
    return (f"{run['request_throughput']:.2f} req/s, TPOT p50 {run['median_tpot_ms']:.1f} ms, "
            f"ITL p99 {run['p99_itl_ms']:.1f} ms, TTFT p50 {run['median_ttft_ms']:.0f} ms "
            f"(load {run['load_avg_before'][0]:.2f})")


def summary_of(server: Server) -> dict:
    med = {m: statistics.median(r[m] for r in server.runs) for m in METRICS}
    itls = sorted(g for r in server.runs for g in r["itls_ms"])
    med["itl_over_100ms_fraction"] = sum(g > 100 for g in itls) / max(1, len(itls))
    med["itl_p99_over_tpot_p50"] = med["p99_itl_ms"] / med["median_tpot_ms"]
    med["gaps_by_median_multiple"] = gap_shape(itls)
    per_event = [r["tokens_per_event"] for r in server.runs if r.get("tokens_per_event")]
    med["tokens_per_event"] = statistics.median(per_event) if per_event else None
    return med


def run(device: str, quick: bool = False) -> dict:
    if device != "cpu":
        raise ValueError("serving-vllm compares with vLLM's CPU build: --device cpu")
    from perf.peers import envs, vllm_cpu
    from .compile import git_state
    load_before, git = os.getloadavg(), git_state()
    checkpoint = _checkpoint()
    bin_dir = vllm_cpu.ensure()
    rounds, num_prompts = (1, 32) if quick else (int(os.environ.get("VGRAPH_SERVING_VLLM_ROUNDS", ROUNDS)), NUM_PROMPTS)
    all_servers = servers(bin_dir, checkpoint)
    try:
        measure(all_servers, bin_dir, checkpoint, rounds, num_prompts)
    finally:
        for server in all_servers:
            stop(server)
    result = {s.name: {"argv": s.argv[1:], "startup_s": s.startup_s, "median": summary_of(s),
                       "runs": [{k: v for k, v in r.items() if k != "itls_ms"} | {"itl_max_ms": max(r["itls_ms"])}
                                for r in s.runs]}
              for s in all_servers}
    return {"suite": "serving-vllm", "servers": result, "targets": targets(result),
            "config": {"checkpoint": checkpoint, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                       "num_prompts": num_prompts, "max_concurrency": CONCURRENCY, "rounds": rounds,
                       "vllm": {"version": vllm_cpu.VERSION, "preloads": vllm_cpu.preloads(bin_dir),
                                "kv_cache_gib": VLLM_KV_CACHE_GIB},
                       "git": git, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                       "peers_dir": str(envs.cache_root())}}


def targets(result: dict) -> dict:
    """Issue 33's two served targets, from the medians over rounds."""
    vg = result["vgraph"]["median"]
    out = {"vgraph_itl_p99_over_tpot_p50": vg["itl_p99_over_tpot_p50"],
           "itl_target_met": vg["itl_p99_over_tpot_p50"] <= 2.0}
    if "vllm" in result:
        ratio = vg["request_throughput"] / result["vllm"]["median"]["request_throughput"]
        out.update(req_s_ratio_vs_vllm=ratio, req_s_target_met=ratio >= 1.1)
    return out


def summarize(result: dict) -> str:
    lines = [f"{'server':14s} {'req/s':>6s} {'TPOT p50':>8s} {'ITL p50':>8s} {'ITL p99':>8s} {'TTFT p50':>8s} "
             f"{'TTFT p99':>8s}  ITL>100ms"]
    for name, s in result["servers"].items():
        m = s["median"]
        lines.append(f"{name:14s} {m['request_throughput']:6.2f} {m['median_tpot_ms']:8.1f} {m['median_itl_ms']:8.1f} "
                     f"{m['p99_itl_ms']:8.1f} {m['median_ttft_ms']:8.0f} {m['p99_ttft_ms']:8.0f}  "
                     f"{100 * m['itl_over_100ms_fraction']:.1f}%")
        shape = m.get("gaps_by_median_multiple")
        if shape:
            lines.append(f"{'':14s} gaps by multiple of the median: " + ", ".join(
                f"{k.replace('le_', '<=').replace('_', '.')} {100 * v:.1f}%" for k, v in shape.items())
                + (f"; {m['tokens_per_event']:.3f} tokens per event" if m.get("tokens_per_event") else ""))
    lines.append(f"targets: {json.dumps(result['targets'])}")
    lines.append("(medians over rounds; ms; vllm bench serve random 128 in / 64 out, 64 prompts, concurrency 16)")
    return "\n".join(lines)
