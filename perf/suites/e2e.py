"""End to end: what a user of ``LLM.generate`` and of ``vgraph serve`` gets per decode step,
next to transformers, with and without overlapped scheduling, on the issue's GPU shapes.

Why this suite: the decode suite times the model part of one step on a prepared batch; a user
waits for the whole engine loop (schedule, batch build, sampling, the host reading the tokens,
outputs). Issue 33 measured 5.29 ms per engine step for the Llama-3-8B shape at batch 1 where
the weights alone explain 3.80 ms: the gap is the host's serial work, and overlapped scheduling
(``async_scheduling``) is meant to hide it. This suite measures that gap the way users meet it.

Workload (CUDA): prompts of ``PROMPT_LEN`` token ids, ``NEW_TOKENS`` new tokens each, greedy,
``ignore_eos``; bf16, random weights (``load_format="dummy"`` on a config-only folder written by
perf/suites/decode.py, whose ``SHAPES`` are the Qwen2.5-0.5B and Llama-3-8B shapes). On CPU the
perf checkpoint the decode suite uses there, fp32, shorter lengths. ``PERF_DECODE_SHAPES`` /
``PERF_DECODE_LAYERS`` choose shapes and a layer count as in the decode suite (e.g. the GPU shapes
at 2 layers on CPU, as a smoke test; the targets then read "not measured").

Systems and how each is timed:
- offline, batch 1 / 16 / 64: **vgraph_async** and **vgraph_sync** (``LLM(async_scheduling=True /
  False)``; both built at once and timed interleaved), **hf_eager** (transformers ``generate``)
  and **hf_static_compile** (``cache_implementation="static"`` with transformers' own
  ``torch.compile`` of the decode step; on CUDA its default CompileConfig), both on one
  transformers model, interleaved with each other. Each round runs the batch twice: once with
  1 new token (the prefill and its token) and once with all of them, so
  ``ms_per_step = (full - prefill) / (new_tokens - 1)`` is the engine's decode step as the caller
  sees it, measured the same way for every system (``cpu_peers.timing_summary``, medians of
  the per-round differences). Rounds rotate the order (``perf.timing.time_variants``).
- served, 1 and 64 concurrent streams: ``vgraph serve`` in a child process, once with
  ``--async-scheduling`` and once with ``--no-async-scheduling``, both up at once and the levels
  alternated A B / B A per round; the load generator is serving.py's closed loop (streamed
  ``/v1/completions`` over HTTP, ``logprobs: 0`` so every token is counted). Per level: output
  tokens/s and TPOT p50, the server's time per step as the client sees it.
- ``copy_fraction`` = (weight bytes / step time) / measured copy bandwidth (decode.py's
  ``copy_bandwidth_gbs``): the share of the memory bandwidth a batch-1 step would use if it
  did nothing but read the weights, the number the issue's "72% of the copy bandwidth" is.

Order: every shape's vgraph rows (offline, then served), then every shape's transformers rows,
so a run cut short has the targets' figures first. Memory: one kind of system is resident at a
time (the two vgraph LLMs, the two servers, the transformers model), each freed (gc,
``torch.cuda.empty_cache``, dynamo reset) before the next; a pair that would not fit in 85% of
free memory runs one after the other instead of interleaved (``interleaved`` in the results).
The 8B shape's pair needs about 2 x 21 GiB.

Targets (issue 33, CUDA, default mode = ``vgraph_async``): ``TARGETS``. ``--quick`` runs the 0.5B
shape fully (transformers' compiled variant at batch 1 only: each batch size recompiles) and
the 8B shape at batch 1 and 64 and at 64 streams only, to fit a 10-minute device call (batch 64
offline says whether the 64-stream served step is the device's step or more).
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from vgraph.engine.step_trace import ENV as STEP_TRACE_ENV

from ..timing import time_variants, write_results
from .cpu_peers import FIRST_REGULAR_ID, TOKENIZER_VOCAB, timing_summary
from .decode import (BLOCK_SIZE, CPU_SHAPE, FIT_FRACTION, MAX_MODEL_LEN, _free, build_llm, copy_bandwidth_gbs,
                     estimate_llm_bytes, num_blocks, shape_config, shapes_for, weights_bytes, write_model_dir)
from .offline import HFSystem
from .serving import ServerUnderTest, _closed_level

PROMPT_LEN, NEW_TOKENS = 128, 128
BATCHES, STREAMS = (1, 16, 64), (1, 64)
VGRAPH = {"vgraph_async": True, "vgraph_sync": False}  # system -> async_scheduling
HF = {"hf_eager": False, "hf_static_compile": True}  # system -> static cache + torch.compile
DEFAULT_SYSTEM = "vgraph_async"  # what vgraph runs on CUDA unless told otherwise
PROMPT_SEED = 0

# The GPU targets: (shape, "offline"/"served", batch or streams, metric, bound, "max"/"min").
TARGETS: dict[str, tuple[str, str, int, str, float, str]] = {
    "llama3-8b batch 1 <= 4.4 ms/step": ("llama3-8b", "offline", 1, "ms_per_step", 4.4, "max"),
    "llama3-8b batch 1 >= 86% of copy bandwidth": ("llama3-8b", "offline", 1, "copy_fraction", 0.86, "min"),
    "qwen2.5-0.5b batch 1 <= 0.6 ms/step": ("qwen2.5-0.5b", "offline", 1, "ms_per_step", 0.6, "max"),
    "llama3-8b served 64 streams >= 7000 output tok/s": ("llama3-8b", "served", 64, "tok_s", 7000.0, "min"),
}


@dataclass(frozen=True)
class Plan:
    """What one shape runs: offline batch sizes, served stream counts, the batch sizes that
    get transformers' compiled variant (a compile each), lengths and rounds."""
    shape: str
    batches: tuple[int, ...]
    streams: tuple[int, ...]
    hf_static_batches: tuple[int, ...]
    prompt_len: int = PROMPT_LEN
    new_tokens: int = NEW_TOKENS
    rounds: int = 5
    hf_rounds: int = 3


def plans(device: str, quick: bool) -> tuple[list[Plan], Optional[int]]:
    """The plan per shape (decode.py's ``shapes_for``: its shapes and env overrides) and the
    layer override. CPU plans are small: the point there is that the plumbing runs."""
    names, layers = shapes_for(device)
    out = []
    for name in names:
        if device == "cpu":
            out.append(Plan(name, (1, 4), (1, 4), (1,), 16, 8, 2, 1) if quick
                       else Plan(name, (1, 16), (1, 16), (1, 16), 128, 32, 3, 2))
        elif not quick:
            out.append(Plan(name, BATCHES, STREAMS, BATCHES))
        elif name == "llama3-8b":  # batch 64 offline: is the served 64-stream row its device's step or more?
            out.append(Plan(name, (1, 64), (64,), (1,), rounds=3, hf_rounds=1))
        else:
            out.append(Plan(name, BATCHES, STREAMS, (1,), rounds=3, hf_rounds=2))
    if device == "cuda" and quick:  # the 8B shape holds three of the four targets: first, if time runs out
        out.sort(key=lambda p: p.shape != "llama3-8b")
    return out, layers


def make_prompts(n: int, length: int) -> list[list[int]]:
    """``n`` fixed prompts of ``length`` ids inside the demo tokenizer's vocabulary (every shape's
    folder carries that tokenizer, and the server decodes prompts with it)."""
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(FIRST_REGULAR_ID, TOKENIZER_VOCAB, (n, length), generator=g).tolist()


def cell(samples: list[dict], batch: int, plan: Plan, weights: int, copy_gbs: float) -> dict:
    """One system at one size: medians (``timing_summary``), ms per decode step, tok/s and the
    copy-bandwidth fraction of the step."""
    summary = timing_summary(samples, batch * plan.prompt_len, batch, plan.new_tokens)
    step_s = summary["decode_s"] / (plan.new_tokens - 1)
    return {"ms_per_step": step_s * 1e3, "tok_s": summary["tok_s"]["generated"],
            "decode_tok_s": summary["tok_s"]["decode"], "copy_fraction": fraction(weights, step_s, copy_gbs),
            "prefill_s": summary["prefill_s"], "total_s": summary["total_s"], "samples": samples}


def fraction(weights: int, step_s: float, copy_gbs: float) -> Optional[float]:
    """Weight bytes per step time over the copy bandwidth (None for a step measured as <= 0,
    which a noisy machine can give when the prefill-only run took longer than the full one)."""
    return weights / step_s / 1e9 / copy_gbs if step_s > 0 else None


def interleaved(calls: dict[str, Callable[[int], list[list[int]]]], plan: Plan, batch: int, device: str,
                rounds: int) -> tuple[dict[str, list[dict]], dict[str, list[list[int]]]]:
    """Every system's prefill-only and full run of ``batch`` prompts, rounds rotated; per system
    the per-round {prefill_s, total_s} and the tokens of its last full run. The first call of
    each (time_variants' sizing call) is the warm-up; with ``target_seconds=0`` each sample is
    one call."""
    tokens: dict[str, list[list[int]]] = {}

    def run(name: str, new: int) -> Callable[[], None]:
        def go() -> None:
            out = calls[name](new)
            if any(len(t) != new for t in out):
                raise RuntimeError(f"{name} generated {sorted({len(t) for t in out})} tokens, expected {new}")
            if new == plan.new_tokens:
                tokens[name] = out
        return go

    variants = {f"{name}|{kind}": run(name, new) for name in calls
                for kind, new in (("prefill", 1), ("full", plan.new_tokens))}
    timed = time_variants(variants, device, reps=rounds, warmup=0, target_seconds=0.0)
    samples = {name: [{"prefill_s": p, "total_s": f} for p, f in zip(timed[f"{name}|prefill"]["samples_s"],
                                                                         timed[f"{name}|full"]["samples_s"])]
               for name in calls}
    return samples, tokens


def fits_together(path_cfg: Optional[dict], device: str, count: int, max_seqs: int) -> bool:
    """Whether ``count`` LLMs of this shape fit in FIT_FRACTION of free device memory at once
    (decode.py's estimate); always on CPU."""
    if device != "cuda" or path_cfg is None:
        return True
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return count * estimate_llm_bytes(path_cfg, 2, max_seqs) <= FIT_FRACTION * free


def vgraph_offline(path: str, device: str, plan: Plan, dummy: bool, cfg: Optional[dict], prompts: list[list[int]],
                   copy_gbs: float) -> dict:
    """Both vgraph systems (together when they fit, timed interleaved), every batch size."""
    from vgraph import SamplingParams
    max_seqs = max(plan.batches)
    options = {"max_num_batched_tokens": max(2048, max_seqs * plan.prompt_len)}  # prefill: one step
    together = fits_together(cfg, device, len(VGRAPH), max_seqs)
    groups = [list(VGRAPH)] if together else [[name] for name in VGRAPH]
    out: dict[str, Any] = {"interleaved": together, "build_s": {}, "rows": {b: {} for b in plan.batches},
                           "tokens": {b: {} for b in plan.batches}}
    for group in groups:
        llms = {}
        for name in group:
            llms[name], out["build_s"][name] = build_llm(path, device, max_seqs,
                                                         {**options, "async_scheduling": VGRAPH[name]}, dummy)
            print(f"  built {name} in {out['build_s'][name]:.1f} s", flush=True)
        out.setdefault("weights_bytes", weights_bytes(next(iter(llms.values())).engine.runner.model))

        def call(llm: Any, batch: int) -> Callable[[int], list[list[int]]]:
            def go(new: int) -> list[list[int]]:
                params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params, use_tqdm=False)
                return [list(o.outputs[0].token_ids) for o in outs]
            return go

        for b in plan.batches:
            samples, tokens = interleaved({n: call(llm, b) for n, llm in llms.items()}, plan, b, device, plan.rounds)
            for name in group:
                out["rows"][b][name] = cell(samples[name], b, plan, out["weights_bytes"], copy_gbs)
                out["tokens"][b][name] = tokens[name]
            print(f"  offline batch {b}: " + ", ".join(f"{n} {out['rows'][b][n]['ms_per_step']:.3f} ms/step"
                                                       for n in group), flush=True)
        _free(llms, device)
        torch._dynamo.reset()
    return out


def hf_offline(path: str, device: str, plan: Plan, dummy: bool, prompts: list[list[int]], weights: int,
               copy_gbs: float) -> dict:
    """transformers eager and static-cache compiled on one model, interleaved per batch size
    (the compiled variant only at ``plan.hf_static_batches``: each batch size compiles anew)."""
    start = time.perf_counter()
    hf = HFSystem(path, device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                  random_weights=dummy, compile_mode=None if device == "cuda" else "default")
    out: dict[str, Any] = {"build_s": time.perf_counter() - start, "rows": {}}

    def call(static: bool, batch: int) -> Callable[[int], list[list[int]]]:
        def go(new: int) -> list[list[int]]:
            hf.static_compile = static
            try:
                return hf.generate_batch(prompts[:batch], new)
            finally:
                hf.static_compile = False
        return go

    for b in plan.batches:
        systems = {n: call(static, b) for n, static in HF.items() if not static or b in plan.hf_static_batches}
        samples, _ = interleaved(systems, plan, b, device, plan.hf_rounds)
        out["rows"][b] = {n: cell(samples[n], b, plan, weights, copy_gbs) for n in systems}
        print(f"  offline batch {b}: " + ", ".join(f"{n} {c['ms_per_step']:.3f} ms/step"
                                                   for n, c in out["rows"][b].items()), flush=True)
    # Whether generate() really compiled the decode forward (as offline.try_static_compile checks).
    out["static_compiled"] = hasattr(hf.model, "_compiled_call")
    del hf
    gc_models(device)
    return out


def gc_models(device: str) -> None:
    """Frees what the last system left (the caller dropped its references)."""
    _free({}, device)
    torch._dynamo.reset()


def server_args(path: str, device: str, plan: Plan, dummy: bool, overlap: bool) -> list[str]:
    """``vgraph serve`` flags: the model folder, the same engine sizing as offline (a KV pool
    bounded by ``--num-gpu-blocks``, so two servers share one device), served under the demo
    model's name, which serving.py's client asks for."""
    streams = max(plan.streams)
    return [path, "--load-format", "dummy" if dummy else "auto",
            "--dtype", "bfloat16" if device == "cuda" else "float32",
            "--num-gpu-blocks", str(num_blocks(streams)), "--block-size", str(BLOCK_SIZE),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(max(2048, streams * plan.prompt_len)),
            "--no-prefix-caching", "--served-model-name", "demo-model-v1",
            "--async-scheduling" if overlap else "--no-async-scheduling"]


def served(path: str, device: str, plan: Plan, dummy: bool, cfg: Optional[dict], prompts: list[list[int]],
           weights: int, copy_gbs: float) -> dict:
    """Both servers (up at once when they fit), closed-loop levels alternated per round."""
    together = fits_together(cfg, device, len(VGRAPH), max(plan.streams))
    groups = [list(VGRAPH)] if together else [[name] for name in VGRAPH]
    rounds = max(1, plan.rounds - 1)
    levels: dict[tuple[str, int], list[dict]] = {(n, c): [] for n in VGRAPH for c in plan.streams}
    startup: dict[str, float] = {}
    exits: dict[str, int] = {}

    def prompt_of(i: int) -> list[int]:
        return prompts[i % len(prompts)]

    traces = {n: tempfile.NamedTemporaryFile(prefix=f"vgraph-e2e-steps-{n}-", suffix=".jsonl", delete=False).name
              for n in VGRAPH}
    for group in groups:
        servers = {n: ServerUnderTest(device, eager=False, max_num_seqs=max(plan.streams),
                                      extra_args=server_args(path, device, plan, dummy, VGRAPH[n]),
                                      extra_env={STEP_TRACE_ENV: traces[n]}) for n in group}
        try:
            for n, server in servers.items():
                startup[n] = server.wait_ready()
                print(f"  server {n} ready in {startup[n]:.1f} s", flush=True)
                asyncio.run(_closed_level(server.url, max(plan.streams), max(plan.streams), 4, 10_000, prompt_of))
            offset = 0
            for r in range(rounds):
                order = group if r % 2 == 0 else group[::-1]
                for c in plan.streams:
                    for n in order:
                        levels[n, c].append(asyncio.run(_closed_level(servers[n].url, c, 2 * c, plan.new_tokens,
                                                                      offset, prompt_of)))
                        offset += 2 * c
        finally:
            exits.update({n: server.stop() for n, server in servers.items()})
    rows = {}
    for c in plan.streams:
        rows[c] = {}
        for n in VGRAPH:
            tpot = statistics.median(lv["tpot_ms"]["p50"] for lv in levels[n, c])
            rows[c][n] = {"ms_per_step": tpot, "tok_s": statistics.median(lv["output_tokens_per_s"] for lv in levels[n, c]),
                          "copy_fraction": fraction(weights, tpot / 1e3, copy_gbs),
                          "ttft_p50_ms": statistics.median(lv["ttft_ms"]["p50"] for lv in levels[n, c]),
                          "itl_p99_ms": statistics.median(lv["itl_ms"]["p99"] for lv in levels[n, c]),
                          "requests": sum(lv["requests"] for lv in levels[n, c]),
                          "levels": levels[n, c]}
        print(f"  served {c} streams: " + ", ".join(f"{n} {v['tok_s']:.0f} tok/s" for n, v in rows[c].items()),
              flush=True)
    return {"interleaved": together, "rounds": rounds, "startup_to_ready_s": startup,
            "exit_codes_after_sigterm": exits, "rows": rows, "engine_steps": {n: step_summary(traces[n]) for n in VGRAPH}}


def step_summary(trace_path: str) -> dict:
    """The served engine's own steps (``VGRAPH_STEP_TRACE``, warm-up included): how many, how
    long the steps without a new request were (decode only) and the ones that scheduled one
    (prefill), in ms. Why: a served ms/step well above the offline one is either slow steps or
    time between them; this tells which."""
    with open(trace_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    os.unlink(trace_path)
    out: dict[str, Any] = {"steps": len(records)}
    if len(records) > 1:
        out["wall_s"] = records[-1]["end"] - records[0]["start"]
        out["busy_fraction"] = sum(r["end"] - r["start"] for r in records) / out["wall_s"]
    for kind, chosen in (("decode", [r for r in records if not r["first_scheduled"]]),
                         ("prefill", [r for r in records if r["first_scheduled"]])):
        ms = sorted((r["end"] - r["start"]) * 1e3 for r in chosen)
        out[kind] = {"steps": len(ms), **({"p50_ms": ms[len(ms) // 2], "p90_ms": ms[int(len(ms) * 0.9)],
                                           "total_s": sum(ms) / 1e3} if ms else {})}
    return out


def model_folder(plan: Plan, layers: Optional[int], tmp: str) -> tuple[str, bool, Optional[dict]]:
    """The shape's folder (written once per run): config + tokenizer for a dummy load, or the
    CPU perf checkpoint; whether it is dummy, and its config fields (None for the checkpoint)."""
    from vgraph.testing.checkpoints import build_perf_checkpoint
    dummy = plan.shape != CPU_SHAPE
    folder = os.path.join(tmp, plan.shape)
    if not os.path.exists(os.path.join(folder, "config.json")):
        write_model_dir(folder, plan.shape, layers) if dummy else build_perf_checkpoint(folder, seed=0)
    return folder, dummy, shape_config(plan.shape, layers) if dummy else None


def run_shape(plan: Plan, device: str, layers: Optional[int], tmp: str, copy_gbs: float) -> dict:
    """vgraph offline, then vgraph served: the systems the targets are about (the
    transformers rows come later, ``add_peers``, so a cut-off run has these first)."""
    path, dummy, cfg = model_folder(plan, layers, tmp)
    prompts = make_prompts(max(plan.batches + plan.streams), plan.prompt_len)
    print(f"{plan.shape}: {asdict(plan)}", flush=True)
    vg = vgraph_offline(path, device, plan, dummy, cfg, prompts, copy_gbs)
    srv = guarded("served", device, lambda: served(path, device, plan, dummy, cfg, prompts, vg["weights_bytes"],
                                                   copy_gbs))
    offline = [{"batch": b, "systems": dict(vg["rows"][b]),
                "async_sync_tokens_equal": vg["tokens"][b]["vgraph_async"] == vg["tokens"][b]["vgraph_sync"]}
               for b in plan.batches]
    return {"plan": asdict(plan), "weights_bytes": vg["weights_bytes"], "load_format": "dummy" if dummy else "auto",
            "config": cfg, "offline": offline,
            "served": [{"streams": c, "systems": srv["rows"][c]} for c in plan.streams if c in srv.get("rows", {})],
            "build_s": dict(vg["build_s"]),
            "interleaved": {"vgraph_offline": vg["interleaved"], "served": srv.get("interleaved")},
            "errors": {"served": srv["error"]} if "error" in srv else {},
            "server": {k: srv.get(k) for k in ("rounds", "startup_to_ready_s", "exit_codes_after_sigterm",
                                               "engine_steps")}}


def add_peers(shape: dict, plan: Plan, device: str, layers: Optional[int], tmp: str, copy_gbs: float) -> None:
    """transformers' rows into the shape's offline rows (or its error into ``errors``)."""
    path, dummy, _ = model_folder(plan, layers, tmp)
    prompts = make_prompts(max(plan.batches + plan.streams), plan.prompt_len)
    print(f"{plan.shape}: transformers", flush=True)
    hf = guarded("transformers", device, lambda: hf_offline(path, device, plan, dummy, prompts,
                                                              shape["weights_bytes"], copy_gbs))
    for row in shape["offline"]:
        row["systems"].update(hf.get("rows", {}).get(row["batch"], {}))
    shape["build_s"]["transformers"] = hf.get("build_s")
    shape["transformers_static_compiled"] = hf.get("static_compiled")
    if "error" in hf:
        shape["errors"]["transformers"] = hf["error"]


def guarded(what: str, device: str, fn: Callable[[], dict]) -> dict:
    """``fn()``, or ``{"error": ...}`` when it raises: a failing peer or server (a transformers
    compile, a missing server dependency) must not lose the vgraph rows already measured."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the results and the summary
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
    print(f"  {what} FAILED: {error}", flush=True)
    gc_models(device)  # the failed system's frames are gone with the exception
    return {"error": error}


def targets(device: str, shapes: dict[str, dict], reduced: bool) -> dict:
    """Each of the issue's GPU targets, checked on ``DEFAULT_SYSTEM`` (``met``: True / False,
    None where not measured: CPU, a layer override, or the size was not run); the other
    vgraph system's figure beside it."""
    out = {}
    for key, (shape, mode, size, metric, bound, kind) in TARGETS.items():
        rows = shapes.get(shape, {}).get(mode, [])
        row = next((r for r in rows if r.get("batch", r.get("streams")) == size), None)
        if device != "cuda" or reduced or row is None:
            out[key] = {"met": None, "note": "not measured (CUDA only, full layer count, size run)"}
            continue
        value = row["systems"][DEFAULT_SYSTEM][metric]
        met = value is not None and (value <= bound if kind == "max" else value >= bound)
        out[key] = {"met": met, "system": DEFAULT_SYSTEM, "measured": value, "bound": bound,
                    **{f"{n} measured": row["systems"][n][metric] for n in VGRAPH if n != DEFAULT_SYSTEM}}
    return out


def run(device: str, quick: bool = False) -> dict:
    from .compile import git_state
    shape_plans, layers = plans(device, quick)
    copy_gbs = copy_bandwidth_gbs(device)
    shapes: dict[str, dict] = {}
    partial = f"e2e-{device}{'-quick' if quick else ''}-partial"
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-e2e-") as tmp:
        # Every shape's vgraph rows, then every shape's transformers rows (their compiles take
        # minutes): a device call cut off late still has what the targets need. After each
        # part, what was measured so far is written.
        for p in shape_plans:
            shapes[p.shape] = run_shape(p, device, layers, tmp, copy_gbs)
            write_results(partial, {"suite": "e2e", "shapes": shapes})
        for p in shape_plans:
            add_peers(shapes[p.shape], p, device, layers, tmp, copy_gbs)
            write_results(partial, {"suite": "e2e", "shapes": shapes})
    return {"suite": "e2e",
            "config": {"device": device, "dtype": "bfloat16" if device == "cuda" else "float32",
                       "shapes": [p.shape for p in shape_plans], "layers_override": layers,
                       "systems": {"vgraph": {n: {"async_scheduling": a} for n, a in VGRAPH.items()},
                                   "transformers": {n: {"static_cache_compile": s} for n, s in HF.items()}},
                       "step": "(full - prefill-only) / (new_tokens - 1), medians of per-round differences; "
                               "served: TPOT p50",
                       "git": git_state(), "loadavg": os.getloadavg()},
            "bandwidth": {"copy_gbs": copy_gbs}, "shapes": shapes,
            "target": targets(device, shapes, reduced=layers is not None)}


def _pct(v: Optional[float]) -> str:
    return f"{v * 100:5.1f}%" if v is not None else "    -"


def headline_figures(result: dict) -> dict[str, float]:
    """ms per step of every system, offline per batch and served per stream count."""
    return {f"{shape} {mode} {row.get('batch', row.get('streams'))} {name} ms/step": c["ms_per_step"]
            for shape, s in result["shapes"].items() for mode in ("offline", "served") for row in s[mode]
            for name, c in row["systems"].items()}


def step_line(steps: dict) -> str:
    """One line of ``step_summary``."""
    parts = [f"{steps['steps']} steps"]
    if "busy_fraction" in steps:
        parts.append(f"busy {steps['busy_fraction']:.0%} of {steps['wall_s']:.1f} s")
    for kind in ("decode", "prefill"):
        k = steps[kind]
        parts.append(f"{kind} {k['steps']}" + (f" (p50 {k['p50_ms']:.2f} / p90 {k['p90_ms']:.2f} ms)" if k["steps"] else ""))
    return ", ".join(parts)


def summarize(result: dict) -> str:
    cfg = result["config"]
    lines = [f"e2e, {cfg['dtype']}, {cfg['device']}; copy bandwidth {result['bandwidth']['copy_gbs']:.1f} GB/s; "
             f"ms/step, tok/s, step's weight reads as a fraction of the copy bandwidth"]
    for shape, s in result["shapes"].items():
        p = s["plan"]
        layers = f", {cfg['layers_override']} layers" if cfg.get("layers_override") else ""
        lines.append(f"== {shape}{layers}: {s['weights_bytes'] / 1e9:.2f} GB weights ({s['load_format']}); prompt "
                     f"{p['prompt_len']}, {p['new_tokens']} new tokens, greedy, ignore_eos")
        lines.append(f"{'mode':8s} {'size':>5s} {'system':18s} {'ms/step':>9s} {'tok/s':>10s} {'copy':>6s}")
        for mode, key in (("offline", "batch"), ("served", "streams")):
            for row in s[mode]:
                for name, c in row["systems"].items():
                    lines.append(f"{mode:8s} {row[key]:5d} {name:18s} {c['ms_per_step']:9.3f} {c['tok_s']:10.1f} "
                                 f"{_pct(c['copy_fraction'])}")
        if s.get("transformers_static_compiled") is False:
            lines.append("hf_static_compile: generate() compiled no forward (no _compiled_call): that row ran eager "
                         "with a static cache")
        for what, error in s.get("errors", {}).items():
            lines.append(f"{what}: FAILED, not measured: {error}")
        for name, steps in (s.get("server", {}).get("engine_steps") or {}).items():
            lines.append(f"served engine steps, {name}: " + step_line(steps))
        same = [row["batch"] for row in s["offline"] if not row["async_sync_tokens_equal"]]
        lines.append("async vs sync tokens: " + ("identical at every batch" if not same else f"DIFFER at {same}"))
    for key, t in result["target"].items():
        status = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items() if k != "met"}
        lines.append(f"target {key}: {status} {shown}")
    return "\n".join(lines)
