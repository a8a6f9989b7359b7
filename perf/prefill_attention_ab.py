"""``python -m perf.prefill_attention_ab [--threads N]``: the CPU prefill attention, the C++
prefill kernel (``ops/csrc/prefill_attention_cpu.cpp``) against the SDPA route it replaced, on
the prefill steps the offline and cpu-peers suites run (512-token steps, the CPU default).

Why a separate tool: attention is a few percent of a prefill's FLOPs but was ~14% of its time
on the perf Llama, and the end-to-end suites cannot say how much of a change is the attention.
Both routes are timed in turns in one process (``perf.timing.time_variants``), the SDPA route
as the model ran it (fresh prefills read the step's own K/V rows, ``new_kv``; prefix-cache hits
gather from the cache). Every result is first checked against the per-sequence reference.
Writes ``perf/results/prefill-attention-cpu.json``.
"""
from __future__ import annotations

import argparse
import random

import torch

from vgraph.ops.attention import paged_attention_reference
from vgraph.ops.attention_batch import RandomPagedBatch, random_paged_batch
from vgraph.ops.cpu_attention import paged_attention_cpu

from .timing import machine_info, time_variants, write_results

# (name, kv heads, query heads per KV head, head_dim): the perf Llama and the 0.5B-shaped Qwen2.
MODELS = [("llama-24m", 4, 2, 64), ("qwen2-0.5b-shape", 2, 7, 64)]
# Tokens per engine step: the CPU default of --max-num-batched-tokens.
STEP_TOKENS = 512


def steps_of(prompts: list[int], step_tokens: int = STEP_TOKENS) -> list[list[tuple[int, int]]]:
    """The engine's steps over ``prompts``: at most ``step_tokens`` tokens each, a prompt that
    does not fit split into a chunk now and the rest (after that context) in the next step."""
    steps, step, room = [], [], step_tokens
    for length in prompts:
        done = 0
        while done < length:
            take = min(length - done, room)
            step.append((done, take))
            done, room = done + take, room - take
            if room == 0:
                steps.append(step)
                step, room = [], step_tokens
    return steps + ([step] if step else [])


def workloads() -> dict[str, list[list[tuple[int, int]]]]:
    """Per workload, the steps the engine runs: (context, query length) per sequence. The
    suites' fresh prompts of 16-256 tokens, and long prompts (chunks after a context)."""
    rng = random.Random(0)
    return {"64 prompts of 16-256": steps_of([rng.randint(16, 256) for _ in range(64)]),
            "4 prompts of 1536": steps_of([1536] * 4)}


def step_kv(batch: RandomPagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V row each query row wrote (what ``unified_attention`` passes as ``new_kv``)."""
    block_size = batch.k_cache.shape[1]
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    slots = []
    for i, seq_len in enumerate(lens):
        for pos in range(seq_len - (starts[i + 1] - starts[i]), seq_len):
            slots.append(int(batch.block_table[i, pos // block_size]) * block_size + pos % block_size)
    index = torch.tensor(slots)
    return tuple(cache.flatten(0, 1)[index] for cache in (batch.k_cache, batch.v_cache))


def measure(kv_heads: int, group: int, head_dim: int, steps: list[list[tuple[int, int]]]) -> dict:
    batches = [random_paged_batch(specs, kv_heads, group, head_dim, 16, torch.float32) for specs in steps]
    calls = [(batch.args(), step_kv(batch)) for batch in batches]
    variants = {"vgraph_kernel": lambda: [paged_attention_cpu(*args) for args, _ in calls],
                "sdpa_route": lambda: [paged_attention_cpu(*args, native_kernel=False, new_kv=new_kv)
                                       for args, new_kv in calls]}
    references = [paged_attention_reference(*args) for args, _ in calls]
    for name, run in variants.items():
        for out, reference in zip(run(), references):
            torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-4, msg=f"{name} is wrong")
    timings = time_variants(variants, "cpu", reps=11)
    flops = sum(4 * kv_heads * group * head_dim * q * (c + (q + 1) / 2) for specs in steps for c, q in specs)
    result = {name: {"median_ms": t["median_s"] * 1e3, "gflops": flops / t["median_s"] / 1e9}
              for name, t in timings.items()}
    result["speedup"] = timings["sdpa_route"]["median_s"] / timings["vgraph_kernel"]["median_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    rows = []
    for model, kv_heads, group, head_dim in MODELS:
        for workload, specs in workloads().items():
            result = measure(kv_heads, group, head_dim, specs)
            rows.append({"model": model, "workload": workload, **result})
            print(f"{model:18s} {workload:22s} kernel {result['vgraph_kernel']['median_ms']:7.2f} ms "
                  f"({result['vgraph_kernel']['gflops']:5.1f} GFLOP/s)  SDPA route "
                  f"{result['sdpa_route']['median_ms']:7.2f} ms ({result['sdpa_route']['gflops']:5.1f})"
                  f"  {result['speedup']:.2f}x")
    payload = {"machine": machine_info("cpu"), "threads": torch.get_num_threads(), "rows": rows}
    print("wrote", write_results(f"prefill-attention-cpu-t{torch.get_num_threads()}", payload))


if __name__ == "__main__":
    main()
