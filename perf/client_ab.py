"""``python -m perf.client_ab [--rounds N] [--streams C] [--tokens N] [--device-ms MS] [--out F]``:
the served load generator's own cost, ``aiohttp`` (what the serving and e2e suites use) against
``httpx`` (what they used before), in turns against one ``vgraph serve`` whose engine steps on an
emulated device (``perf/emulated_site``: every step also takes ``--device-ms``, as a GPU's
would, so the CPU left over goes to the HTTP layer and the client, as on a GPU machine).

Why: the e2e suite's served rows (64 streams, 128-token prompts, 128 new tokens, closed loop)
are issue 33's served target, and a client that is slow to start its requests shows up there as
the server's time to first token and lost throughput. Each level sends ``2 x streams`` requests
(two waves); the engine can make at most ``streams`` tokens per ``--device-ms``, the
device-bound rate each row is compared with. Reports per client: output tok/s, TTFT p50/p90,
TPOT p50 and the client's CPU time per token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from .suites.e2e import make_prompts
from .suites.serving import (ServerUnderTest, _closed_level, _level_stats, closed_loop, request_body,
                             stream_record, timed_events)
from .timing import RESULTS_DIR, machine_info

ROOT = Path(__file__).resolve().parent.parent
EMULATED_SITE = ROOT / "perf" / "emulated_site"
PROMPT_LEN = 128


async def httpx_closed_level(url: str, concurrency: int, num_requests: int, max_tokens: int, offset: int,
                             prompt_of: Callable[[int], list[int]]) -> dict[str, Any]:
    """The closed loop as the suites ran it with httpx (one ``AsyncClient``, ``concurrency``
    kept-alive connections, ``aiter_lines``): the baseline."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient, index: int) -> dict[str, Any]:
        sent = time.perf_counter()
        async with client.stream("POST", url + "/v1/completions",
                                 json=request_body(prompt_of(index), max_tokens)) as response:
            response.raise_for_status()
            events = await timed_events(response.aiter_lines())
        return stream_record(index, max_tokens, sent, events, time.perf_counter(), None)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        records = await closed_loop(concurrency, num_requests, offset, lambda i: one(client, i))
    return {"concurrency": concurrency, "max_tokens": max_tokens, **_level_stats(records)}


CLIENTS = {"aiohttp": _closed_level, "httpx": httpx_closed_level}


def emulated_server(streams: int, device_ms: float) -> ServerUnderTest:
    """The demo model, eager (the device is emulated: compiling would only slow the start), at
    one torch thread, with a KV pool and a token budget that take a whole wave in one step."""
    env = {"PYTHONPATH": os.pathsep.join([str(EMULATED_SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "VGRAPH_PERF_EMULATED_DEVICE_MS": str(device_ms), "OMP_NUM_THREADS": "1"}
    args = ["--max-num-batched-tokens", str(streams * PROMPT_LEN), "--max-model-len", "512", "--no-prefix-caching",
            "--async-scheduling"]  # as on a GPU, where it is the default
    return ServerUnderTest("cpu", eager=True, max_num_seqs=streams, extra_args=args, extra_env=env)


def level_row(level: dict[str, Any], cpu_s: float, streams: int, device_ms: float) -> dict[str, Any]:
    tokens = level["requests"] * level["max_tokens"]
    return {"tok_s": level["output_tokens_per_s"], "device_bound_fraction": level["output_tokens_per_s"] / (streams / (device_ms / 1e3)),
            "ttft_p50_ms": level["ttft_ms"]["p50"], "ttft_p90_ms": level["ttft_ms"]["p90"],
            "tpot_p50_ms": level["tpot_ms"]["p50"], "client_cpu_us_per_token": cpu_s / tokens * 1e6,
            "wall_s": level["wall_s"]}


def run(rounds: int, streams: int, tokens: int, device_ms: float) -> dict[str, Any]:
    prompts = make_prompts(4 * streams, PROMPT_LEN)
    prompt_of = lambda i: prompts[i % len(prompts)]  # noqa: E731
    server = emulated_server(streams, device_ms)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in CLIENTS}
    load = [os.getloadavg()[0]]
    try:
        server.wait_ready()
        asyncio.run(_closed_level(server.url, streams, streams, 4, 10_000, prompt_of))  # warm-up
        offset = 0
        for r in range(rounds):
            for name in (list(CLIENTS) if r % 2 == 0 else list(CLIENTS)[::-1]):
                cpu = time.process_time()
                level = asyncio.run(CLIENTS[name](server.url, streams, 2 * streams, tokens, offset, prompt_of))
                rows[name].append(level_row(level, time.process_time() - cpu, streams, device_ms))
                offset += 2 * streams
                load.append(os.getloadavg()[0])
                print(f"  round {r} {name}: {rows[name][-1]['tok_s']:.0f} tok/s, TTFT p50 "
                      f"{rows[name][-1]['ttft_p50_ms']:.0f} ms", flush=True)
    finally:
        server.stop()
    medians = {name: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for name, rs in rows.items()}
    return {"tool": "client_ab",
            "config": {"streams": streams, "requests_per_level": 2 * streams, "prompt_tokens": PROMPT_LEN,
                       "new_tokens": tokens, "emulated_device_ms_per_step": device_ms, "rounds": rounds,
                       "device_bound_tok_s": streams / (device_ms / 1e3), "server": "demo model, eager, 1 torch thread",
                       "loadavg": load},
            "medians": medians, "rounds": rows, "machine": machine_info("cpu")}


def summarize(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"{cfg['streams']} streams, {cfg['new_tokens']} tokens, emulated device {cfg['emulated_device_ms_per_step']} "
             f"ms/step (device-bound {cfg['device_bound_tok_s']:.0f} tok/s), medians of {cfg['rounds']} rounds, "
             f"load {min(cfg['loadavg']):.2f}-{max(cfg['loadavg']):.2f}",
             "client    tok/s  of bound  TTFT p50  TTFT p90  TPOT p50  client us/token"]
    for name, m in result["medians"].items():
        lines.append(f"{name:8s} {m['tok_s']:6.0f}  {m['device_bound_fraction']:7.1%}  {m['ttft_p50_ms']:7.0f}  "
                     f"{m['ttft_p90_ms']:8.0f}  {m['tpot_p50_ms']:8.1f}  {m['client_cpu_us_per_token']:10.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device-ms", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "client-ab-cpu.json")
    args = parser.parse_args()
    result = run(args.rounds, args.streams, args.tokens, args.device_ms)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(summarize(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
