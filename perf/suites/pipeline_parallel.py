"""Pipeline parallelism: PP=2 against PP=1, end to end, one torch thread per stage.

Run it as ``python -m perf run pipeline-parallel --threads 1``: PP=1 is one process at one thread,
PP=2 two stage processes at one thread each (``threads_per_rank``: the 2 cores split in two), so
PP=2 has twice the cores and gains only where its stages work at the same time, that is, when the
engine keeps more than one step in flight (stage 0 runs step N + 1 while stage 1 runs step N).
With one step in flight the stages take turns and PP=2 can only lose: each step pays both
stages' forward one after the other, plus the activation hand-off (one gloo send/recv of
``[tokens, 2 * hidden]`` fp32 over TCP on 127.0.0.1) and an extra pipe round trip per rank.

Measured, on the ~26M perf checkpoint (``build_perf_checkpoint``: hidden 512, 8 layers, so 4 per
stage), compiled, fp32: one offline batch of ``REQUESTS`` = 64 prompts of ``PROMPT_LEN`` tokens,
``NEW_TOKENS`` greedy tokens each, through ``LLM.generate`` at PP=1 and PP=2 in interleaved
rounds after one warm-up round each (medians): generated tokens/s and wall time; PP=2's tokens must equal PP=1's. The
hand-off alone (``handoff``): a gloo send/recv of ``[rows, 2 * hidden]`` fp32 between two spawned
processes, timed at a decode step's rows and a 512-token prefill step's. The load
average before and after is recorded: on this shared 2-core VM another process on a core takes it
from a stage, and the comparison means little above a load of ~2.

What changes on real GPUs and nodes: a stage is a GPU (or T of them), the hand-off is an NCCL
send/recv (NVLink within a node, InfiniBand or Ethernet between nodes: for decode a few KB per
step, for a 4096-token prefill ``4096 * 2 * hidden * 2`` bytes, tens of MB at hidden 4096), and
each stage replays its own CUDA graphs. The point there is memory, not speed: P stages hold a
model P times larger (and P times the KV cache for the same model), at the cost of a pipeline
bubble that in-flight steps (microbatches) fill; per-token latency grows by the hand-offs. On
this CPU the same code runs, and the measured figure is the overlap the engine achieves, since
the per-stage kernels are the same as PP=1's.
"""
from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any

import torch

ROUNDS = 3
REQUESTS, PROMPT_LEN, NEW_TOKENS = 64, 32, 48
QUICK = dict(rounds=1, requests=16, prompt_len=16, new_tokens=8)
SYSTEMS = (("pp1", 1), ("pp2", 2))
HANDOFF_REPS = 50


def _workload(quick: bool) -> dict:
    if quick:
        return dict(QUICK)
    return dict(rounds=ROUNDS, requests=REQUESTS, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS)


def _handoff_rank(rank: int, init_method: str, width: int, row_counts: list[int], queue: Any) -> None:
    """Rank 0 sends ``[rows, width]`` to rank 1, which times each receive from a barrier."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    out = {}
    for rows in row_counts:
        x = torch.randn(rows, width)
        samples = []
        for i in range(HANDOFF_REPS + 5):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(x, dst=1)
            else:
                dist.recv(x, src=0)
            if i >= 5:
                samples.append(time.perf_counter() - start)
        out[rows] = statistics.median(samples)
    if rank == 1:
        queue.put(out)
    dist.destroy_process_group()


def measure_handoff(width: int, row_counts: list[int]) -> dict[int, float]:
    """Median seconds of one stage-to-stage hand-off per row count (gloo on 127.0.0.1)."""
    from vgraph.distributed.executor import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_handoff_rank, args=(r, init, width, row_counts, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def _prompts(w: dict, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (w["prompt_len"],), generator=g).tolist() for _ in range(w["requests"])]


def _run_batch(llm: Any, prompts: list[list[int]], new_tokens: int) -> dict:
    """The batch through ``LLM.generate`` (the engine's own step loop, in-flight steps included)."""
    from vgraph import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"wall_s": time.perf_counter() - start, "tokens": [o.outputs[0].token_ids for o in outs]}


def run(device: str, quick: bool = False) -> dict:
    from vgraph import LLM
    from vgraph.testing.checkpoints import build_perf_checkpoint

    from .compile import git_state
    w = _workload(quick)
    load_before = os.getloadavg()
    git = git_state()
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-pp-") as tmp:
        path = build_perf_checkpoint(os.path.join(tmp, "ckpt"), seed=0)
        kw = dict(dtype="bfloat16" if device == "cuda" else "float32", device=device, max_model_len=512,
                  num_gpu_blocks=1024, max_num_seqs=max(64, w["requests"]))
        llms, builds = {}, {}
        for name, pp in SYSTEMS:
            t0 = time.perf_counter()
            llms[name] = LLM(path, pipeline_parallel_size=pp, **kw)
            builds[name] = time.perf_counter() - t0
        handoff = measure_handoff(2 * llms["pp1"].engine.runner.model.hidden_size,
                                  sorted({w["requests"] // 2, min(512, w["requests"] * w["prompt_len"])}))
        prompts = _prompts(w, llms["pp1"].engine.vocab_size)
        for llm in llms.values():  # warm-up, not counted: the first batches at new row counts are slower
            _run_batch(llm, prompts, w["new_tokens"])
        runs: dict[str, list[dict]] = {name: [] for name in llms}
        for r in range(w["rounds"]):
            for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
                runs[name].append(_run_batch(llms[name], prompts, w["new_tokens"]))
        in_flight = _max_in_flight(llms["pp2"].engine)
        llms["pp2"].close()
    result = _result(device, w, builds, runs, load_before, git, in_flight)
    result["handoff_s"] = handoff
    return result


def _max_in_flight(engine: Any) -> int:
    """Steps the engine keeps in flight (read for the record; 1 where its loop has none)."""
    return int(getattr(engine, "_max_in_flight", 1))


def _result(device: str, w: dict, builds: dict, runs: dict, load_before: Any, git: Any, in_flight: int) -> dict:
    generated = w["requests"] * w["new_tokens"]
    systems = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        systems[name] = {"median_wall_s": wall, "tokens_per_s": generated / wall,
                         "wall_samples_s": [r["wall_s"] for r in rs], "build_s": builds[name]}
    return {
        "suite": "pipeline-parallel",
        "config": {**w, "device": device, "checkpoint": "build_perf_checkpoint(seed=0)", "compiled": True,
                   "torch_threads_pp1": torch.get_num_threads(),
                   "torch_threads_per_stage_pp2": max(1, (os.cpu_count() or 1) // 2),
                   "steps_in_flight_pp2": in_flight,
                   "loadavg_before_after": [load_before, os.getloadavg()], "git": git},
        "systems": systems,
        "tokens_equal_pp1": all(a["tokens"] == b["tokens"] for a, b in zip(runs["pp1"], runs["pp2"])),
        "ratio": {"pp2/pp1_tokens_per_s": systems["pp2"]["tokens_per_s"] / systems["pp1"]["tokens_per_s"]},
    }


def summarize(result: dict) -> str:
    c, s = result["config"], result["systems"]
    before, after = c["loadavg_before_after"]
    lines = [f"pipeline-parallel ({c['device']}): {c['requests']} prompts x {c['prompt_len']} tokens, "
             f"{c['new_tokens']} new each, compiled, median of {c['rounds']} rounds; PP=1 at "
             f"{c['torch_threads_pp1']} threads, PP=2 at {c['torch_threads_per_stage_pp2']} per stage, "
             f"{c['steps_in_flight_pp2']} step(s) in flight",
             f"  load average before {before[0]:.2f}, after {after[0]:.2f}",
             f"  {'system':<8}{'tok/s':>9}{'wall s':>9}{'build s':>9}"]
    for name, x in s.items():
        lines.append(f"  {name:<8}{x['tokens_per_s']:>9.1f}{x['median_wall_s']:>9.2f}{x['build_s']:>9.1f}")
    lines.append(f"  PP=2 tokens equal PP=1: {result['tokens_equal_pp1']}; PP=2/PP=1 throughput "
                 f"{result['ratio']['pp2/pp1_tokens_per_s']:.2f}x")
    lines.append("  hand-off [rows, 2 x hidden] fp32 over gloo, ms: " + ", ".join(
        f"{rows} rows: {1e3 * t:.3f}" for rows, t in result["handoff_s"].items()))
    return "\n".join(lines)


def headline_figures(result: dict) -> dict[str, float]:
    s = result["systems"]
    return {"pp1 tok/s": s["pp1"]["tokens_per_s"], "pp2 tok/s": s["pp2"]["tokens_per_s"],
            "pp2/pp1": result["ratio"]["pp2/pp1_tokens_per_s"]}
