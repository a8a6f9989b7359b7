"""Speculative decoding's verify step against a plain decode step: what checking k guesses
costs the device, on the runner's own dispatch path (FULL graphs on CUDA for both).

Why: at batch 1 a decode step reads every weight to make one token; a verify step reads them
once to score k + 1 rows. If it costs about the same, every accepted guess is nearly free, and
that is what makes speculation pay. Issue 34's GPU target: k = 4 at batch 1 on the Llama-3-8B
shape costs at most 1.15x a plain decode step, both in FULL graphs.

How: one engine per shape with ``speculative_config`` (n-gram, k = 4), so its runner has
captured both the decode buckets and the verify buckets (S sequences x (k + 1) rows). For each
batch size n: a pure-decode step of n sequences of ``CONTEXT`` cached tokens (decode.py's
``dummy_decode``), and the same step with k guesses after each decode token; each built by the
runner's batch builder on the dispatcher's path, then forward + logits of the sampled rows,
timed interleaved (``time_variants``: device events on CUDA, rounds rotated). Reported per n:
both times, the ratio, and the path and bucket each took. Shapes as decode.py's
(``PERF_DECODE_SHAPES`` / ``PERF_DECODE_LAYERS``); bf16, random weights on CUDA; the perf
checkpoint in fp32 on CPU, where the default mode runs no graphs (the plumbing runs).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from typing import Any

import torch

from ..timing import time_variants
from .decode import (BLOCK_SIZE, CONTEXT, CPU_SHAPE, MAX_MODEL_LEN, _free, num_blocks, shapes_for, step_fn,
                     weights_bytes, write_model_dir)

K = 4
BATCHES = (1, 4, 16)
TARGET = ("llama3-8b", 1, 1.15)  # shape, batch, verify / decode at most


def build(path: str, device: str, dummy: bool) -> Any:
    from vgraph import LLM
    return LLM(path, dtype="bfloat16" if device == "cuda" else "float32", device=device,
               max_num_seqs=max(BATCHES), max_num_batched_tokens=2048, block_size=BLOCK_SIZE,
               num_gpu_blocks=num_blocks(max(BATCHES)), max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
               load_format="dummy" if dummy else "auto",
               speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                   "disable_by_batch_size": max(BATCHES)})


def steps(runner: Any, n: int) -> dict[str, Any]:
    """The decode step of n sequences and the same step verifying K guesses each."""
    from vgraph.worker.dummy import dummy_decode
    decode = dummy_decode(n, CONTEXT, BLOCK_SIZE, runner.num_blocks, first_token=7)
    guesses = tuple(range(8, 8 + K))  # blocks hold CONTEXT + 1 tokens rounded up to a block: room for K
    verify = replace(decode, chunks=tuple(replace(c, num_new_tokens=1 + K, draft_token_ids=guesses)
                                          for c in decode.chunks))
    return {"decode": decode, "verify": verify}


def measure(llm: Any, device: str, reps: int) -> list[dict]:
    runner = llm.engine.runner
    rows = []
    for n in BATCHES:
        built = {name: runner.graphs.build(step) for name, step in steps(runner, n).items()}
        timed = time_variants({name: step_fn(runner, b) for name, b in built.items()}, device, reps=reps)
        ms = {name: timed[name]["median_s"] * 1e3 for name in built}
        rows.append({"batch": n, "decode_ms": ms["decode"], "verify_ms": ms["verify"],
                     "ratio": ms["verify"] / ms["decode"],
                     "paths": {name: f"{d.path.value} {d.bucket} rows" for name, (_, d) in built.items()}})
        print(f"  batch {n}: decode {ms['decode']:.3f} ms ({rows[-1]['paths']['decode']}), verify k={K} "
              f"{ms['verify']:.3f} ms ({rows[-1]['paths']['verify']}): {rows[-1]['ratio']:.3f}x", flush=True)
    return rows


def run(device: str, quick: bool = False) -> dict:
    from vgraph.testing.checkpoints import build_perf_checkpoint
    names, layers = shapes_for(device)
    shapes = {}
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-verify-") as tmp:
        for name in names:
            dummy = name != CPU_SHAPE
            path = (write_model_dir(os.path.join(tmp, name), name, layers) if dummy
                    else build_perf_checkpoint(os.path.join(tmp, name), seed=0))
            print(f"{name}:", flush=True)
            llms = {"spec": build(path, device, dummy)}
            capture = llms["spec"].engine.runner.startup.capture
            shapes[name] = {"weights_bytes": weights_bytes(llms["spec"].engine.runner.model),
                            "graphs": {"full": capture.full_graphs, "verify": capture.verify_graphs},
                            "rows": measure(llms["spec"], device, 5 if quick else 15)}
            _free(llms, device)  # the only reference: its memory goes before the next shape's
            torch._dynamo.reset()
    shape, batch, bound = TARGET
    row = next((r for r in shapes.get(shape, {}).get("rows", []) if r["batch"] == batch), None)
    target = {"bound": bound, "measured": None if row is None else row["ratio"],
              "met": None if row is None or layers is not None else row["ratio"] <= bound,
              "both_full": None if row is None else all(p.startswith("full") for p in row["paths"].values())}
    return {"suite": "spec-verify",
            "config": {"device": device, "k": K, "context": CONTEXT, "batches": list(BATCHES),
                       "layers_override": layers, "loadavg": os.getloadavg()},
            "shapes": shapes, "target": {f"{shape} batch {batch} verify k={K} <= {bound}x decode": target}}


def headline_figures(result: dict) -> dict[str, float]:
    return {f"{shape} batch {r['batch']} verify/decode": r["ratio"]
            for shape, s in result["shapes"].items() for r in s["rows"]}


def summarize(result: dict) -> str:
    lines = [f"spec-verify ({result['config']['device']}): forward + logits of a verify step (k={K}) "
             f"against a decode step, context {CONTEXT}"]
    for shape, s in result["shapes"].items():
        lines.append(f"== {shape}: {s['weights_bytes'] / 1e9:.2f} GB weights; graphs {s['graphs']}")
        for r in s["rows"]:
            lines.append(f"batch {r['batch']:3d}: decode {r['decode_ms']:8.3f} ms  verify {r['verify_ms']:8.3f} ms  "
                         f"{r['ratio']:.3f}x   ({r['paths']['decode']} / {r['paths']['verify']})")
    for name, t in result["target"].items():
        status = "not measured" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        lines.append(f"target {name}: {status} (measured {t['measured']}, both FULL: {t['both_full']})")
    return "\n".join(lines)
