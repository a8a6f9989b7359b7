"""Decode: one decode step's latency per batch size (bucket) for each execution path, and the
memory bandwidth it achieves.

A decode step reads every weight once and each sequence's KV cache, and computes little, so
at small batches it is bound by memory bandwidth, or, when the GPU waits on the host, by
kernel launches: that gap is what CUDA graphs close. The step measured is the model part of
``ModelRunner.execute`` on a prepared pure-decode batch: dispatch, padding or the copy into
the persistent buffers, the forward, and the logits of every sequence (no sampling, no
scheduler), for batch sizes on and off the buckets. Every sequence has ``CONTEXT`` tokens.

Systems, each a ``LLM`` on the ~26M perf checkpoint (bf16 on CUDA, fp32 on CPU), timed
interleaved (``perf.timing.time_variants``):

- **eager**: ``enforce_eager=True``;
- **compiled**: compiled, ``cudagraph_mode="none"``: the batch runs at its own size;
- CUDA only: **piecewise** (``cudagraph_mode="piecewise"``: the decode batch is padded to a
  token bucket and each compiled piece replays its graph, attention eager between them) and
  **full** (``cudagraph_mode="full"``: one graph of the whole forward per decode bucket);
- CPU only: **bucketed** (the default mode without CUDA: the batch is padded to its FULL
  bucket and the compiled forward runs at that size), which prices the padding.

Bandwidth: bytes a step must move (all weights, the sequences' KV read, the new KV written)
over its latency, against a measured copy bandwidth of the device (``peak_gbs``).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from ..timing import time_variants

CONTEXT = 256
BLOCK_SIZE = 16


def batch_sizes(device: str, quick: bool) -> list[int]:
    """Buckets and sizes between them (5 -> 8, 12 -> 16, 25 -> 32, 33 -> 40, 100 -> 104)."""
    if quick:
        return [1, 5, 8, 33] if device == "cpu" else [1, 8, 33, 64]
    if device == "cpu":
        return [1, 2, 4, 5, 8, 12, 16, 25, 32, 33, 64]
    return [1, 2, 4, 5, 8, 12, 16, 25, 32, 33, 64, 100, 128, 256]


def systems_for(device: str) -> dict[str, dict]:
    common = {"compiled": {"cudagraph_mode": "none"}, "eager": {"enforce_eager": True}}
    if device == "cuda":
        return {**common, "piecewise": {"cudagraph_mode": "piecewise"}, "full": {"cudagraph_mode": "full"}}
    return {**common, "bucketed": {"cudagraph_mode": "full_and_piecewise"}}


def build_llm(path: str, device: str, max_seqs: int, options: dict) -> tuple[Any, float]:
    from vgraph import LLM
    from vgraph.config import CompileConfig
    eager = options.get("enforce_eager", False)
    config = CompileConfig(cudagraph_mode=options.get("cudagraph_mode"))
    blocks = max_seqs * -(-(CONTEXT + 1) // BLOCK_SIZE) + 8
    start = time.perf_counter()
    llm = LLM(path, dtype="bfloat16" if device == "cuda" else "float32", device=device, max_num_seqs=max_seqs,
              max_num_batched_tokens=max(2048, max_seqs), block_size=BLOCK_SIZE, num_gpu_blocks=blocks,
              enable_prefix_caching=False, enforce_eager=eager, compile_config=config)
    return llm, time.perf_counter() - start


@torch.inference_mode()
def decode_batch(runner: Any, n: int, seed: int = 0) -> Any:
    """A pure-decode FlatBatch of n sequences of CONTEXT tokens over distinct blocks
    (inference tensors, as the runner makes them: the compiled forward guards on that)."""
    from vgraph.ops.forward_context import AttentionMetadata
    from vgraph.worker.batch import FlatBatch
    dev, per_seq = runner.device, -(-(CONTEXT + 1) // BLOCK_SIZE)
    table = torch.arange(n * per_seq, dtype=torch.int32).view(n, per_seq)
    pos = torch.full((n,), CONTEXT, dtype=torch.long)
    slots = table[:, CONTEXT // BLOCK_SIZE].long() * BLOCK_SIZE + CONTEXT % BLOCK_SIZE
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, runner.vocab_size, (n,), generator=g)
    meta = AttentionMetadata(slot_mapping=slots.to(dev), block_table=table.to(dev),
                             query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
                             seq_lens=torch.full((n,), CONTEXT + 1, dtype=torch.int32, device=dev),
                             max_query_len=1, max_seq_len=CONTEXT + 1)
    return FlatBatch(ids.to(dev), pos.to(dev), meta, torch.arange(n, device=dev), [])


def step_fn(runner: Any, batch: Any) -> Callable[[], object]:
    @torch.inference_mode()
    def step() -> object:
        return runner.model.compute_logits(runner.forward(batch))
    return step


def bytes_per_step(model: torch.nn.Module, n: int) -> int:
    """Weights read once, n sequences' KV read, n new KV rows written (lm_head counted once,
    tied or not)."""
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    elt = torch.empty((), dtype=model.dtype).element_size()
    kv_row = 2 * model.num_layers * model.num_kv_heads * model.head_dim * elt
    return int(weights + n * (CONTEXT + 1) * kv_row + n * kv_row)


def copy_bandwidth_gbs(device: str, mib: int = 256) -> float:
    """Device memory bandwidth as a large copy achieves it (read + write), GB/s."""
    src = torch.empty(mib << 18, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    timed = time_variants({"copy": lambda: dst.copy_(src)}, device, reps=7, target_seconds=0.05)
    return 2 * src.numel() * 4 / timed["copy"]["median_s"] / 1e9


def measure(llms: dict[str, Any], device: str, sizes: list[int], peak_gbs: float, reps: int) -> list[dict]:
    rows = []
    model = next(iter(llms.values())).engine.model
    for n in sizes:
        runners = {name: llm.engine.runner for name, llm in llms.items()}
        batches = {name: decode_batch(r, n) for name, r in runners.items()}
        timed = time_variants({name: step_fn(runners[name], batches[name]) for name in llms}, device, reps=reps)
        moved = bytes_per_step(model, n)
        row = {"batch": n, "bytes_per_step": moved, "systems": {}}
        for name, r in runners.items():
            decision = r.decide(batches[name])
            s = timed[name]["median_s"]
            row["systems"][name] = {"path": decision.path.value, "bucket": decision.bucket, "latency_ms": s * 1e3,
                                    "achieved_gbs": moved / s / 1e9, "bandwidth_util": moved / s / 1e9 / peak_gbs,
                                    "samples_ms": [x * 1e3 for x in timed[name]["samples_s"]]}
        eager = row["systems"]["eager"]["latency_ms"]
        for s in row["systems"].values():
            s["speedup_vs_eager"] = eager / s["latency_ms"]
        rows.append(row)
        print(f"  batch {n}: " + ", ".join(f"{k} {v['latency_ms']:.3f} ms" for k, v in row["systems"].items()),
              flush=True)
    return rows


def run(device: str, quick: bool = False) -> dict:
    from vgraph.models.demo import build_perf_checkpoint

    from .compile import git_state
    sizes = batch_sizes(device, quick)
    old_cache = os.environ.get("VGRAPH_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-decode-") as tmp:
        os.environ["VGRAPH_CACHE_DIR"] = os.path.join(tmp, "vgraph-cache")
        try:
            path = build_perf_checkpoint(os.path.join(tmp, "ckpt"), seed=0)
            built = {name: build_llm(path, device, max(sizes), opts) for name, opts in systems_for(device).items()}
            llms = {name: llm for name, (llm, _) in built.items()}
            peak = copy_bandwidth_gbs(device)
            rows = measure(llms, device, sizes, peak, reps=5 if quick else 11)
            graphs = {name: vars(llm.engine.cudagraph_report) for name, llm in llms.items()
                      if getattr(llm.engine, "cudagraph_report", None) is not None}
        finally:
            if old_cache is None:
                os.environ.pop("VGRAPH_CACHE_DIR", None)
            else:
                os.environ["VGRAPH_CACHE_DIR"] = old_cache
    return {"suite": "decode", "config": {"context": CONTEXT, "block_size": BLOCK_SIZE, "sizes": sizes,
                                          "dtype": "bfloat16" if device == "cuda" else "float32",
                                          "systems": systems_for(device), "git": git_state(),
                                          "loadavg": os.getloadavg()},
            "peak_gbs": peak, "build_s": {name: s for name, (_, s) in built.items()}, "graphs": graphs,
            "rows": rows}


def summarize(result: dict) -> str:
    cfg, names = result["config"], list(result["rows"][0]["systems"])
    lines = [f"decode step (forward + logits), context {cfg['context']}, {cfg['dtype']}; "
             f"copy bandwidth {result['peak_gbs']:.1f} GB/s; latency ms (bandwidth utilisation)",
             f"{'batch':>5} {'bucket':>6} " + "".join(f"{n:>20}" for n in names)]
    for row in result["rows"]:
        buckets = {s["bucket"] for s in row["systems"].values() if s["path"] != "none"}
        bucket = str(max(buckets)) if buckets else "-"
        cells = "".join(f"{s['latency_ms']:>11.3f} ({s['bandwidth_util'] * 100:>4.1f}%)" for s in row["systems"].values())
        lines.append(f"{row['batch']:>5} {bucket:>6} {cells}")
    for name in names:
        speedups = [row["systems"][name]["speedup_vs_eager"] for row in result["rows"]]
        lines.append(f"{name}: median speedup vs eager {statistics.median(speedups):.2f}x")
    for name, g in result["graphs"].items():
        if g["full_graphs"] or g["piecewise_graphs"]:
            lines.append(f"{name}: {g['full_graphs']} FULL + {g['piecewise_graphs']} PIECEWISE graphs, "
                         f"captured in {g['seconds']:.2f} s, {g['memory_bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)
