"""Tensor parallelism: TP=2 against TP=1, end to end, and what the all-reduces cost per step.

On the 2-core CPU machine this is correctness plus overhead, not a speedup: TP=1 already uses
both cores (torch's intra-op threads), and TP=2 splits them into two ranks of one thread each,
which then exchange every layer's activations over gloo (TCP on 127.0.0.1) and exchange each step
with the engine over pipes. Where ranks have a device each (2+ GPUs, NCCL), the same suite runs
with ``--device cuda``.

Measured, on the ~26M perf checkpoint (``build_perf_checkpoint``: hidden 512, 8 layers, 8 heads,
4 kv heads, intermediate 1408), compiled, fp32 on CPU (bf16 on CUDA):

- **end to end**: one offline batch (``REQUESTS`` prompts of ``PROMPT_LEN`` tokens, ``NEW_TOKENS``
  greedy tokens each) through ``LLM.generate`` at TP=1 and TP=2, interleaved rounds, medians:
  generated tokens/s, and the median time of a decode step (``LLMEngine.step`` of the whole
  batch, once every request is decoding) and of a prefill step; TP=2's tokens must equal TP=1's.
- **threads**: at default threads TP=1 runs one process at every core and TP=2 two ranks at
  ``cores // 2`` each; the threads-1 column (``threads_1``, perf/__main__.py) runs TP=1 at one thread
  and TP=2 at one thread per rank, which compares the same per-rank kernels and stays readable when
  other processes hold a core (a 2-thread OpenMP team then waits at every barrier: see
  ``machine.contention_probe_before_after``).
- **collectives**: in two spawned processes joined like the engine's ranks (same backend, one
  torch thread each), the functional all-reduce the model issues, timed at the shapes it runs
  ([tokens, hidden] for decode and prefill steps), and the lm_head's all-gather of the sampled
  rows' logits. Per step the model issues ``1 + 2 * layers`` all-reduces (embedding; o_proj and
  down_proj per layer) and one all-gather, so the step's communication is estimated as
  ``(1 + 2L) * t_all_reduce + t_all_gather``, reported against the measured TP=2 step time.
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
REQUESTS, PROMPT_LEN, NEW_TOKENS = 8, 128, 64
QUICK = dict(rounds=1, requests=4, prompt_len=64, new_tokens=16)
COLLECTIVE_REPS = 50


def _workload(quick: bool) -> dict:
    if quick:
        return dict(QUICK)
    return dict(rounds=ROUNDS, requests=REQUESTS, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS)


# ---------------------------------------------------------------------- collectives microbenchmark

def _collective_rank(rank: int, world: int, init_method: str, backend: str, device: str, hidden: int,
                     vocab: int, token_counts: list[int], queue: Any) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    group = dist.group.WORLD.group_name

    def timed(fn) -> float:
        for _ in range(5):
            fn()
        samples = []
        for _ in range(COLLECTIVE_REPS):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize(dev)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    out: dict[str, Any] = {"all_reduce_s": {}, "all_gather_logits_s": {}}
    with torch.inference_mode():
        for n in token_counts:
            x = torch.randn(n, hidden, dtype=dtype, device=dev)
            out["all_reduce_s"][n] = timed(lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group)))
            logits = torch.randn(n, vocab // world, dtype=dtype, device=dev)
            out["all_gather_logits_s"][n] = timed(
                lambda: funcol.wait_tensor(funcol.all_gather_single(logits, 0, group)))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_collectives(device: str, world: int, hidden: int, vocab: int, token_counts: list[int]) -> dict:
    from vgraph.distributed.executor import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    backend = "nccl" if device == "cuda" else "gloo"
    procs = [ctx.Process(target=_collective_rank, args=(r, world, init, backend, device, hidden, vocab,
                                                        token_counts, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return {"backend": backend, "world_size": world, **result}


# ---------------------------------------------------------------------- end to end

def _prompts(w: dict, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (w["prompt_len"],), generator=g).tolist() for _ in range(w["requests"])]


def _run_batch(llm: Any, prompts: list[list[int]], new_tokens: int) -> dict:
    """The batch through the engine's step loop, each step timed; steps where every request is
    already decoding are decode steps, steps that carry prompt tokens are prefill steps."""
    from vgraph import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        llm.add_request(rid, {"prompt_token_ids": p}, params)
    tokens: dict[str, list[int]] = {}
    decode_s, prefill_s = [], []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        prefilling = engine.scheduler.num_waiting > 0 or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        t0 = time.perf_counter()
        out = llm.step()  # the engine's step and the output processor's share, as LLM.generate runs them
        (prefill_s if prefilling else decode_s).append(time.perf_counter() - t0)
        for o in out.outputs:
            if o.finished:
                tokens[o.request_id] = o.outputs[0].token_ids
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": [tokens[i] for i in ids], "decode_step_s": decode_s, "prefill_step_s": prefill_s}


def run(device: str, quick: bool = False) -> dict:
    from vgraph import LLM
    from vgraph.testing.checkpoints import build_perf_checkpoint

    from .compile import git_state
    w = _workload(quick)
    load_before = os.getloadavg()
    git = git_state()
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-tp-") as tmp:
        path = build_perf_checkpoint(os.path.join(tmp, "ckpt"), seed=0)
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(path)
        layers, hidden, vocab = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
        decode_rows, prefill_rows = w["requests"], min(512, w["requests"] * w["prompt_len"])
        collectives = measure_collectives(device, 2, hidden, vocab, sorted({1, decode_rows, prefill_rows}))
        kw = dict(dtype="bfloat16" if device == "cuda" else "float32", device=device,
                  max_model_len=1024, num_gpu_blocks=512)
        builds, llms = {}, {}
        for name, tp in (("tp1", 1), ("tp2", 2)):
            t0 = time.perf_counter()
            llms[name] = LLM(path, tensor_parallel_size=tp, **kw)
            builds[name] = time.perf_counter() - t0
        prompts = _prompts(w, vocab)
        runs: dict[str, list[dict]] = {name: [] for name in llms}
        for r in range(w["rounds"]):
            for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
                runs[name].append(_run_batch(llms[name], prompts, w["new_tokens"]))
        round_trip = _round_trip_s(llms["tp2"].engine.runner)
        counters = {"tp1": [llms["tp1"].engine.runner.compile_counters.as_dict()],
                    "tp2": [c.as_dict() for c in llms["tp2"].engine.runner.collect_compile_counters()]}
        llms["tp2"].close()
    result = _result(device, w, layers, hidden, vocab, decode_rows, prefill_rows, collectives, builds, runs,
                     counters, load_before, git)
    result["executor_round_trip_ms"] = 1e3 * round_trip
    return result


def _round_trip_s(executor: Any, reps: int = 30) -> float:
    """Median seconds of one engine -> every rank -> engine exchange with no model work (the
    compile-counters query): the floor of what the process boundary adds to each step."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        executor.collect_compile_counters()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _result(device: str, w: dict, layers: int, hidden: int, vocab: int, decode_rows: int, prefill_rows: int,
            collectives: dict, builds: dict, runs: dict, counters: dict, load_before: Any, git: Any) -> dict:
    generated = w["requests"] * w["new_tokens"]
    systems = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        systems[name] = {"median_wall_s": wall, "tokens_per_s": generated / wall,
                         "decode_step_ms": 1e3 * statistics.median(s for r in rs for s in r["decode_step_s"]),
                         "prefill_step_ms": 1e3 * statistics.median(s for r in rs for s in r["prefill_step_s"]),
                         "decode_steps_per_round": len(rs[0]["decode_step_s"]),
                         "prefill_steps_per_round": len(rs[0]["prefill_step_s"]),
                         "wall_samples_s": [r["wall_s"] for r in rs], "build_s": builds[name]}
    reduces = 1 + 2 * layers
    ar, ag = collectives["all_reduce_s"], collectives["all_gather_logits_s"]
    comm_decode_ms = 1e3 * (reduces * ar[decode_rows] + ag[decode_rows])
    comm_prefill_ms = 1e3 * (reduces * ar[prefill_rows] + ag[min(decode_rows, prefill_rows)])
    tp2 = systems["tp2"]
    return {
        "suite": "tensor-parallel",
        "config": {**w, "device": device, "checkpoint": "build_perf_checkpoint(seed=0)", "layers": layers,
                   "hidden": hidden, "vocab": vocab, "compiled": True, "torch_num_threads_tp1": torch.get_num_threads(),
                   "torch_threads_per_rank_tp2": max(1, (os.cpu_count() or 1) // 2),
                   "loadavg_before_after": [load_before, os.getloadavg()], "git": git,
                   "compile_counters": counters},
        "systems": systems,
        "tokens_equal_tp1": all(a["tokens"] == b["tokens"] for a, b in zip(runs["tp1"], runs["tp2"])),
        "collectives": {**collectives, "all_reduces_per_step": reduces, "all_gathers_per_step": 1,
                        "decode_rows": decode_rows, "prefill_rows": prefill_rows},
        "communication": {
            "decode_step_ms": comm_decode_ms, "prefill_step_ms": comm_prefill_ms,
            "decode_fraction_of_tp2_step": comm_decode_ms / tp2["decode_step_ms"],
            "prefill_fraction_of_tp2_step": comm_prefill_ms / tp2["prefill_step_ms"]},
        "ratio": {"tp2/tp1_tokens_per_s": tp2["tokens_per_s"] / systems["tp1"]["tokens_per_s"],
                  "tp2/tp1_decode_step": tp2["decode_step_ms"] / systems["tp1"]["decode_step_ms"]},
    }


def summarize(result: dict) -> str:
    c, s, comm, col = result["config"], result["systems"], result["communication"], result["collectives"]
    lines = [f"tensor-parallel ({c['device']}, {col['backend']}): {c['requests']} prompts x {c['prompt_len']} tokens, "
             f"{c['new_tokens']} new each, compiled, median of {c['rounds']} rounds; TP=1 at "
             f"{c['torch_num_threads_tp1']} threads, TP=2 at {c['torch_threads_per_rank_tp2']} per rank",
             f"  {'system':<8}{'tok/s':>9}{'wall s':>9}{'decode ms':>11}{'prefill ms':>12}{'build s':>9}"]
    for name, x in s.items():
        lines.append(f"  {name:<8}{x['tokens_per_s']:>9.1f}{x['median_wall_s']:>9.2f}{x['decode_step_ms']:>11.2f}"
                     f"{x['prefill_step_ms']:>12.2f}{x['build_s']:>9.1f}")
    lines.append(f"  TP=2 tokens equal TP=1: {result['tokens_equal_tp1']}; TP=2/TP=1 throughput "
                 f"{result['ratio']['tp2/tp1_tokens_per_s']:.2f}x")
    lines.append("  all-reduce [tokens, hidden] ms: " + ", ".join(
        f"{n}: {1e3 * t:.3f}" for n, t in col["all_reduce_s"].items()))
    lines.append("  all-gather logits ms: " + ", ".join(f"{n}: {1e3 * t:.3f}" for n, t in col["all_gather_logits_s"].items()))
    lines.append(f"  communication per step ({col['all_reduces_per_step']} all-reduces + 1 all-gather): decode "
                 f"{comm['decode_step_ms']:.2f} ms ({100 * comm['decode_fraction_of_tp2_step']:.0f}% of the TP=2 step), "
                 f"prefill {comm['prefill_step_ms']:.2f} ms ({100 * comm['prefill_fraction_of_tp2_step']:.0f}%)")
    lines.append(f"  engine <-> ranks round trip (no model work): {result['executor_round_trip_ms']:.2f} ms per step")
    return "\n".join(lines)


def headline_figures(result: dict) -> dict[str, float]:
    s = result["systems"]
    return {"tp1 tok/s": s["tp1"]["tokens_per_s"], "tp2 tok/s": s["tp2"]["tokens_per_s"],
            "tp2 decode step ms": s["tp2"]["decode_step_ms"],
            "comm per decode step ms": result["communication"]["decode_step_ms"]}


def plot(result: dict) -> Any:
    """Decode and prefill step time per system, the estimated communication share drawn in."""
    import matplotlib.pyplot as plt

    s, comm = result["systems"], result["communication"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, kind in zip(axes, ("decode", "prefill")):
        names = list(s)
        ax.bar(names, [s[n][f"{kind}_step_ms"] for n in names], color=["#4c72b0", "#dd8452"])
        ax.bar(["tp2"], [comm[f"{kind}_step_ms"]], color="#c44e52", label="all-reduces + all-gather (est.)")
        ax.set_title(f"{kind} step (ms)")
        ax.legend(fontsize=8)
    fig.suptitle(f"TP=2 vs TP=1 ({result['config']['device']}): tokens equal = {result['tokens_equal_tp1']}")
    return fig
