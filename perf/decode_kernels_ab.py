"""``python -m perf.decode_kernels_ab [--shapes llama3-8b,qwen2.5-0.5b] [--rows 1,2] [--chosen]
[--norm] [--out FILE]``: the
batch-1 decode step's two big device costs, each kernel against its alternatives, on a GPU.

Why: at batch 1 a step is a weight stream (the projections) plus attention over the context;
the e2e suite says how far the step is from the copy bandwidth, this says which kernel loses
it. Per model shape:

- every projection (fused qkv, o, gate_up, down, lm_head) at one row (``--rows``: also two,
  batch 1 as the compiled forward pads it): torch's ``F.linear`` (cuBLAS, and cuBLASLt as
  ``preferred_blas_library`` picks it) against ``ops/kernels/gemv.py`` at each launch
  configuration of ``GEMV_CONFIGS`` (``--chosen``: ``config_for``'s only); microseconds per
  call and GB/s of weight read;
- the MLP's gate_up projection and SwiGLU: cuBLAS then ``silu_and_mul``, against the fused
  one-row kernel (``gemv_silu_mul_triton``);
- decode attention of one sequence at contexts 256 and 1024: the unified kernel against the
  split-KV pair at several split counts;
- ``--norm``: the two norm -> projection sites of a layer (residual add + RMSNorm, then qkv;
  then gate_up with SwiGLU), the norm kernel followed by the GEMV against the GEMV with the
  norm inside it (``rms_norm_gemv_triton``, what ``passes/norm_linear.py`` makes), at
  ``--rows``. This decides whether that pass joins the default passes.

Timing: each candidate is captured in a CUDA graph that calls it on ``copies`` distinct
weights (or KV caches), as many as make the working set at least ``WORKING_SET_BYTES`` (well
past the L2 cache, as a model's layers are), replayed and timed with events; per call = graph
time / copies, the fastest of ``REPEATS`` replays. Outputs are checked against the reference
first. Results go to ``--out`` (default ``perf/results/decode-kernels-cuda.json``).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from vgraph.ops.dense_linear import takes_gemv
from vgraph.ops.kernels.attention import (paged_attention_decode_split_kv_triton,
                                          paged_attention_triton)
from vgraph.ops.kernels.gemv import (GemvConfig, NormPrologue, config_for, gemv_silu_mul_triton, gemv_triton,
                                     rms_norm_gemv_triton)

from .suites.decode import SHAPES

WORKING_SET_BYTES = 512 << 20
MAX_COPIES = 64
REPEATS = 7
GEMV_CONFIGS = [GemvConfig(block_n=n, block_k=k, num_warps=w, num_stages=s)
                for n in (4, 8, 16) for k in (256, 512, 1024) for w in (4, 8) for s in (3,)]
CONTEXTS = (256, 1024)
SPLITS = (2, 4, 8, 16, 32)
BLOCK_SIZE = 16


def projections(cfg: dict) -> list[tuple[str, int, int, bool]]:
    """(name, out_features, in_features, has_bias) of one layer's projections and the head."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    bias = "use_sliding_window" in cfg  # the Qwen2 shape's qkv bias
    return [("qkv", q + 2 * kv, h, bias), ("o", h, q, False), ("gate_up", 2 * inter, h, False),
            ("down", h, inter, False), ("lm_head", cfg["vocab_size"], h, False)]


def graph_us(calls: list[Callable[[], object]]) -> float:
    """Fastest replay of one CUDA graph of ``calls``, in microseconds per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:
            call()  # compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    best = math.inf
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPEATS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return best


def copies_for(nbytes: int) -> int:
    return max(2, min(MAX_COPIES, -(-WORKING_SET_BYTES // max(nbytes, 1))))


def projection_rows(cfg: dict, dtype: torch.dtype, m: int, sweep: bool) -> list[dict]:
    """Each projection at ``m`` rows; ``sweep``: every ``GEMV_CONFIGS`` entry, else ``config_for``'s."""
    rows = []
    for name, n, k, has_bias in projections(cfg):
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = copies_for(nbytes)
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
        bias = torch.randn(n, device="cuda", dtype=dtype) if has_bias else None
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        ref = F.linear(x, weights[0], bias)
        row = {"name": name, "rows": m, "out_features": n, "in_features": k, "bias": has_bias, "copies": copies,
               "weight_bytes": nbytes}
        library = [lambda w=w: torch.addmm(bias, x, w.t(), out=out) if bias is not None
                   else torch.mm(x, w.t(), out=out) for w in weights]
        row["cublas_us"] = graph_us(library)
        default = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            row["cublaslt_us"] = graph_us(library)
        finally:
            torch.backends.cuda.preferred_blas_library(default)
        gemv = {}
        for config in (GEMV_CONFIGS if sweep else [config_for(n, k, m)]):
            got = gemv_triton(x, weights[0], bias, config)
            if not torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2):
                raise AssertionError(f"gemv {config} disagrees with F.linear on {name}")
            gemv[_key(config)] = graph_us([lambda w=w, c=config: gemv_triton(x, w, bias, c, out=out)
                                           for w in weights])
        best = min(gemv, key=gemv.get)
        row.update(gemv_us=gemv, gemv_best=best, gemv_best_us=gemv[best],
                   cublas_gbs=nbytes / row["cublas_us"] / 1e3, gemv_best_gbs=nbytes / gemv[best] / 1e3,
                   gemv_speedup=row["cublas_us"] / gemv[best])
        print(f"  {name:8s} {m} x {n:6d} x {k:5d}: cublas {row['cublas_us']:8.2f} us ({row['cublas_gbs']:6.0f} GB/s)"
              f"  cublaslt {row['cublaslt_us']:8.2f} us"
              f"  gemv {gemv[best]:8.2f} us ({row['gemv_best_gbs']:6.0f} GB/s, {best})"
              f"  {row['gemv_speedup']:.2f}x", flush=True)
        if name == "gate_up":
            row.update(swiglu_rows(x, weights, out))
        rows.append(row)
        del weights
        torch.cuda.empty_cache()
    return rows


def swiglu_rows(x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor) -> dict:
    """The MLP's first half at one row: cuBLAS then ``silu_and_mul``, against the fused kernel."""
    from vgraph.ops.kernels.activation import silu_and_mul_triton
    d = weights[0].shape[0] // 2
    ref = silu_and_mul_triton(F.linear(x, weights[0]))
    got = gemv_silu_mul_triton(x, weights[0])
    if not torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2):
        raise AssertionError("the fused SwiGLU kernel disagrees with cuBLAS + silu_and_mul")
    act = torch.empty(x.shape[0], d, device=x.device, dtype=x.dtype)
    unfused = graph_us([lambda w=w: silu_and_mul_triton(torch.mm(x, w.t(), out=out)) for w in weights])
    fused = graph_us([lambda w=w: gemv_silu_mul_triton(x, w, out=act) for w in weights])
    print(f"  swiglu   cublas + silu_and_mul {unfused:8.2f} us  fused gemv {fused:8.2f} us  {unfused / fused:.2f}x",
          flush=True)
    return {"swiglu_unfused_us": unfused, "swiglu_fused_us": fused}


def norm_rows(cfg: dict, dtype: torch.dtype, m: int) -> list[dict]:
    """Residual add + RMSNorm then the qkv GEMV, and then the gate_up + SwiGLU GEMV: the norm
    kernel and the GEMV against the GEMV with the norm inside, at ``m`` rows (the sites whose
    call takes the GEMV at that row count)."""
    from vgraph.ops.kernels.norm import rms_norm_triton
    h = cfg["hidden_size"]
    sites = {name: (n, name == "gate_up") for name, n, _, _ in projections(cfg) if name in ("qkv", "gate_up")}
    rows = []
    for name, (n, silu_mul) in sites.items():
        if not takes_gemv(torch.empty(m, h, dtype=dtype, device="meta"), torch.empty(n, h, dtype=dtype, device="meta")):
            continue  # the model sends this call to the library, where the fused op is the pair
        copies = copies_for(n * h * torch.finfo(dtype).bits // 8)
        weights = [torch.randn(n, h, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
        x, residual = torch.randn(m, h, device="cuda", dtype=dtype), torch.randn(m, h, device="cuda", dtype=dtype)
        norm_w = torch.ones(h, device="cuda", dtype=dtype)
        project = gemv_silu_mul_triton if silu_mul else gemv_triton

        def unfused(w):
            normed, _ = rms_norm_triton(x, norm_w, 1e-6, residual=residual)
            return project(normed, w)

        def fused(w):
            return rms_norm_gemv_triton(x, NormPrologue(norm_w, 1e-6, residual), w, None, silu_mul)[0]

        if not torch.allclose(fused(weights[0]).float(), unfused(weights[0]).float(), atol=2e-2, rtol=2e-2):
            raise AssertionError(f"the norm-fused GEMV disagrees with norm + GEMV on {name}")
        row = {"site": name, "rows": m, "out_features": n, "in_features": h,
               "unfused_us": graph_us([lambda w=w: unfused(w) for w in weights]),
               "fused_us": graph_us([lambda w=w: fused(w) for w in weights])}
        row["speedup"] = row["unfused_us"] / row["fused_us"]
        print(f"  norm+{name:8s} {m} x {n:6d} x {h:5d}: norm kernel + gemv {row['unfused_us']:8.2f} us"
              f"  fused {row['fused_us']:8.2f} us  {row['speedup']:.2f}x", flush=True)
        rows.append(row)
        del weights
        torch.cuda.empty_cache()
    return rows


def _key(config: GemvConfig) -> str:
    return f"n{config.block_n}_k{config.block_k}_w{config.num_warps}_s{config.num_stages}"


def attention_rows(cfg: dict, dtype: torch.dtype, layers: int) -> list[dict]:
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // hq
    rows = []
    for context in CONTEXTS:
        blocks = context // BLOCK_SIZE
        caches = [(torch.randn(blocks, BLOCK_SIZE, hkv, hd, device="cuda", dtype=dtype),
                   torch.randn(blocks, BLOCK_SIZE, hkv, hd, device="cuda", dtype=dtype)) for _ in range(layers)]
        q = torch.randn(1, hq, hd, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        table = torch.arange(blocks, device="cuda", dtype=torch.int32)[None]
        seq_lens = torch.tensor([context], device="cuda", dtype=torch.int32)
        starts = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
        scale = hd ** -0.5
        ref = paged_attention_triton(q, *caches[0], table, starts, seq_lens, 1, scale)
        row = {"context": context, "layers": layers,
               "unified_us": graph_us([lambda c=c: paged_attention_triton(q, *c, table, starts, seq_lens, 1, scale,
                                                                          out=out) for c in caches])}
        for splits in SPLITS:
            got = paged_attention_decode_split_kv_triton(q, *caches[0], table, seq_lens, scale, splits)
            torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
            row[f"split{splits}_us"] = graph_us(
                [lambda c=c, s=splits: paged_attention_decode_split_kv_triton(q, *c, table, seq_lens, scale, s, out=out)
                 for c in caches])
        print(f"  attention context {context}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()
                                                             if k.endswith("_us")), flush=True)
        rows.append(row)
    return rows


def summary_rows(result: dict) -> list[dict]:
    """One flat row per projection (and row count) and per attention context: what the docs'
    results page tabulates."""
    rows = []
    for shape, found in result["shapes"].items():
        for p in found["projections"]:
            rows.append({"shape": shape, "kernel": p["name"], "rows": p.get("rows", 1),
                         "cublas_us": p["cublas_us"], "gemv_us": p["gemv_best_us"], "gemv_config": p["gemv_best"],
                         "gemv_speedup": p["gemv_speedup"]})
            if "swiglu_fused_us" in p:
                rows.append({"shape": shape, "kernel": "gate_up+swiglu", "rows": p.get("rows", 1),
                             "cublas_us": p["swiglu_unfused_us"], "gemv_us": p["swiglu_fused_us"],
                             "gemv_config": "fused", "gemv_speedup": p["swiglu_unfused_us"] / p["swiglu_fused_us"]})
        for a in found["attention"]:
            splits = {int(k[5:-3]): v for k, v in a.items() if k.startswith("split") and k.endswith("_us")}
            best = min(splits, key=splits.get)
            rows.append({"shape": shape, "kernel": f"attention, {a['context']} keys", "rows": 1,
                         "unified_us": a["unified_us"], "best_split": best, "split_us": splits[best],
                         "split_speedup": a["unified_us"] / splits[best]})
        for n in found.get("norm", []):
            rows.append({"shape": shape, "kernel": f"norm + {n['site']}", "rows": n["rows"],
                         "unfused_us": n["unfused_us"], "fused_us": n["fused_us"], "norm_speedup": n["speedup"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.decode_kernels_ab")
    parser.add_argument("--shapes", default="llama3-8b,qwen2.5-0.5b")
    parser.add_argument("--rows", default="1", help="comma-separated row counts of the projections (1, 2)")
    parser.add_argument("--chosen", action="store_true", help="time config_for's GEMV configuration only")
    parser.add_argument("--norm", action="store_true", help="also time the norm-fused GEMV against norm + GEMV")
    parser.add_argument("--out", type=Path, default=Path("perf/results/decode-kernels-cuda.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("perf.decode_kernels_ab times CUDA kernels: no CUDA device here")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {},
              "machine": {"device": "cuda", "gpu": torch.cuda.get_device_name(),
                          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    for name in args.shapes.split(","):
        cfg = SHAPES[name]["config"]
        print(f"{name}:", flush=True)
        result["shapes"][name] = {"projections": [row for m in map(int, args.rows.split(","))
                                                  for row in projection_rows(cfg, torch.bfloat16, m, not args.chosen)],
                                  "attention": attention_rows(cfg, torch.bfloat16, cfg["num_hidden_layers"])}
        if args.norm:
            result["shapes"][name]["norm"] = [row for m in map(int, args.rows.split(","))
                                              for row in norm_rows(cfg, torch.bfloat16, m)]
        result["rows"] = summary_rows(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
