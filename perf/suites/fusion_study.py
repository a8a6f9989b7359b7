"""Fusion study: vgraph's custom-op fusion passes against Inductor's own fusion.

For each model family (the tiny llama, qwen2, qwen3 and mistral checkpoints, and the ~26M
perf model) in each precision (float32; fp8 with static activation scales, from a checkpoint
calibrated as AutoFP8 does; fp8 with dynamic per-token scales, ``quantization="fp8"``), three
compiled configurations of one engine:

- **ops+passes** (a): norms, activations and quantization as vgraph's custom ops, vgraph's
  fusion passes on (``custom_ops=True``, ``enable_fusion=True``);
- **inductor** (b): the same math in plain torch and no vgraph pass, so Inductor generates and
  fuses those kernels itself (``custom_ops=False``, ``enable_fusion=False``); fp8 GEMMs stay
  ``vgraph::fp8_gemm`` (there is no plain-torch fp8 GEMM that runs everywhere);
- **ops** (c): custom ops without the passes (``custom_ops=True``, ``enable_fusion=False``).

Per configuration: pass matches; Inductor's kernels per forward (generated, of which fusing
several ops, and custom-op calls left opaque; read from its output code, vgraph/lab/kernels.py);
the logits of a fixed batch and 16 greedy tokens against the **eager** engine (custom ops, no
compilation: the reference composition); compile time; and step time per bucket (decode of 1,
8 and 32 sequences with 64 cached tokens, one 128-token prefill), the three configurations timed
interleaved, rotating the order each round, median of the rounds.

Each (family, precision) runs in its own process, with cold Inductor caches and no compile
cache, at torch's default thread count, with ``OMP_WAIT_POLICY=PASSIVE`` (as ``vgraph serve``
sets it): on a shared machine, OpenMP threads that spin between parallel regions turn every
descheduled thread into a stall of the whole step, and the spread of the samples would then
measure the other processes' load more than the configurations. The medians of interleaved
rounds keep the comparison fair; each sample's minimum is recorded beside them.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .compile import git_state

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS: dict[str, dict[str, bool]] = {
    "ops+passes": {"custom_ops": True, "enable_fusion": True},
    "inductor": {"custom_ops": False, "enable_fusion": False},
    "ops": {"custom_ops": True, "enable_fusion": False},
}
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "perf")
PRECISIONS = ("fp32", "fp8-static", "fp8-dynamic")
GREEDY_TOKENS = 16
CASE_TIMEOUT_S = 900


# ----------------------------------------------------------------------------- checkpoints


def _tiny_mistral(seed: int) -> tuple[Any, Any]:
    """A seeded random MistralForCausalLM at the demo models' tiny sizes (full attention) and
    the demo tokenizer: the family the demo builder does not cover."""
    import transformers

    from vgraph.models.demo import build_tokenizer
    tokenizer = build_tokenizer()
    config = transformers.MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        initializer_range=0.1, sliding_window=None, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.MistralForCausalLM(config)
    return model, tokenizer


_PERF_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=1408, max_position_embeddings=4096, initializer_range=0.02)


def build_checkpoint(root: Path, family: str, precision: str) -> tuple[str, dict[str, Any]]:
    """(checkpoint dir, extra LLM keywords) for one case; fp8-dynamic reuses the fp32 files."""
    from vgraph.models.demo import build_tiny_checkpoint, save_tokenizer_files
    from vgraph.testing.checkpoints import (build_perf_checkpoint, build_tiny_fp8_static_checkpoint,
                                            write_fp8_static_checkpoint)
    static = precision == "fp8-static"
    path = root / f"{family}-{'fp8-static' if static else 'fp32'}"
    extra = {"quantization": "fp8"} if precision == "fp8-dynamic" else {}
    if (path / "config.json").exists():
        return str(path), extra
    if family == "mistral":
        model, tokenizer = _tiny_mistral(seed=0)
        if static:
            write_fp8_static_checkpoint(path, model, tokenizer, seed=0)
        else:
            model.save_pretrained(path)
            save_tokenizer_files(path, tokenizer)
    elif family == "perf":
        if static:
            build_tiny_fp8_static_checkpoint(path, seed=0, **_PERF_SHAPE)
        else:
            build_perf_checkpoint(path, seed=0)
    elif static:
        build_tiny_fp8_static_checkpoint(path, seed=0, arch=family)
    else:
        build_tiny_checkpoint(path, family, seed=0)
    return str(path), extra


# ----------------------------------------------------------------------------- one case (child process)


def _build(path: str, config: dict[str, bool], settings: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from vgraph import LLM
    from vgraph.lab.analysis import engine_records, kernel_rows, kernel_totals
    from vgraph.lab.kernels import KernelCapture
    from vgraph.lab.report import OBSERVER, observe_post_grad_graph

    # Without vgraph's passes the observer keeps a pass manager, whose fresh uuid makes
    # Inductor's FX-graph cache miss: every configuration compiles (and is read) cold.
    passes = [] if config["enable_fusion"] else [observe_post_grad_graph]
    capture = KernelCapture()
    start = time.perf_counter()
    with capture:
        llm = LLM(path, passes=passes, use_cache=False, **config, **settings)
    build_s = time.perf_counter() - start
    _, pieces = engine_records(llm)
    rows = kernel_rows(pieces, {"k": capture.summaries()})
    c = llm.engine.runner.compile_counters
    return llm, {
        "build_s": build_s, "dynamo_s": c.dynamo_seconds, "inductor_s": c.inductor_seconds,
        "pass_matches": {k: v for k, v in c.pass_matches.items() if k != OBSERVER},
        "kernels": kernel_totals(rows, "k"),
        "kernels_per_piece": [{"piece": r["piece"], "instances": r["instances"], "generated": r["k"]["generated"],
                               "fused": r["k"]["fused"], "custom_ops": r["k"]["custom_ops"]}
                              for r in rows if r["size"] == "dynamic" and r["k"] is not None]}


def case_main(path: str, extra: dict[str, Any], device: str, repeats: int, tokens: int) -> None:
    """Child process: the eager reference and the three configurations of one case; prints
    one CASE_RESULT line of JSON."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    from vgraph import LLM
    from vgraph.lab.measure import (buckets, fixed_prompts, greedy_tokens, logit_difference, prompt_logits,
                                    step_times, token_agreement, warm_inductor)

    settings = dict(dtype="float32", device=device, max_num_seqs=32, max_num_batched_tokens=512,
                    num_gpu_blocks=32 * 5 + 32, enable_prefix_caching=False, **extra)
    warm_inductor(device)
    eager = LLM(path, enforce_eager=True, **settings)
    prompts = fixed_prompts(eager.engine.vocab_size)
    ref_logits, ref_tokens = prompt_logits(eager, prompts), greedy_tokens(eager, prompts, tokens)
    llms, out = {}, {}
    for name, config in CONFIGS.items():
        llms[name], out[name] = _build(path, config, settings)
        print(f"  built {name} in {out[name]['build_s']:.1f} s", file=sys.stderr, flush=True)
    logits = {name: prompt_logits(llm, prompts) for name, llm in llms.items()}
    for name, llm in llms.items():
        out[name]["vs_eager"] = {"logits": logit_difference(logits[name], ref_logits),
                                 "greedy": token_agreement(greedy_tokens(llm, prompts, tokens), ref_tokens)}
    passes_change = logit_difference(logits["ops+passes"], logits["ops"])
    times = step_times(llms, buckets((1, 8, 32), 128), repeats, target_seconds=0.05)
    model = eager.engine.runner.model
    print("CASE_RESULT " + json.dumps({
        "architecture": (getattr(eager.engine.runner.hf_config, "architectures", None) or ["?"])[0],
        "layers": model.num_layers, "parameters": sum(p.numel() for p in model.parameters()),
        "quantization": eager.engine.config.model.quantization or ("fp8" if "Fp8" in repr(model) else None),
        "configs": out, "passes_vs_no_passes_logits": passes_change, "step_times": times,
        "torch_num_threads": torch.get_num_threads()}), flush=True)


def run_case(root: Path, family: str, precision: str, device: str, repeats: int, tokens: int) -> dict[str, Any]:
    path, extra = build_checkpoint(root, family, precision)
    env = dict(os.environ, VGRAPH_CACHE_DIR=str(root / "vgraph-cache"), PYTHONUNBUFFERED="1",
               OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               TORCHINDUCTOR_CACHE_DIR=str(root / f"inductor-{family}-{precision}"))
    code = (f"from perf.suites.fusion_study import case_main; "
            f"case_main({path!r}, {extra!r}, {device!r}, {repeats}, {tokens})")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=CASE_TIMEOUT_S)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CASE_RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"family": family, "precision": precision, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    row = json.loads(lines[-1].removeprefix("CASE_RESULT "))
    row.update(family=family, precision=precision, wall_s=time.perf_counter() - start)
    return row


# ----------------------------------------------------------------------------- the suite


def run(device: str, quick: bool = False) -> dict:
    families = ("llama", "perf") if quick else FAMILIES
    repeats, tokens = (3, 4) if quick else (21, GREEDY_TOKENS)
    load_before, git = os.getloadavg(), git_state()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-fusion-") as tmp:
        for family in families:
            for precision in PRECISIONS:
                row = run_case(Path(tmp), family, precision, device, repeats, tokens)
                rows.append(row)
                print(f"  {family} {precision}: " + (row.get("error", "")[:300] or _line(row)), flush=True)
    return {"suite": "fusion-study",
            "config": {"configs": CONFIGS, "families": list(families), "precisions": list(PRECISIONS),
                       "repeats": repeats, "greedy_tokens": tokens, "decode_context": 64,
                       "buckets": ["decode-1", "decode-8", "decode-32", "prefill-128"], "dtype": "float32",
                       "reference": "eager engine (custom ops, no compilation)", "git": git,
                       "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                       "loadavg_before_after": [load_before, os.getloadavg()]},
            "rows": rows, "summary": summary_table(rows)}


def _line(row: dict) -> str:
    t = row["step_times"]
    return ", ".join(f"{b} " + "/".join(f"{t[b]['variants'][c]['median_ms']:.2f}" for c in CONFIGS) + " ms"
                     for b in t) + f" ({'/'.join(CONFIGS)})"


def summary_table(rows: list[dict]) -> dict[str, Any]:
    """Per precision and configuration, across families: the median of each bucket's step time
    relative to ops+passes (> 1: slower than ops+passes), kernels per forward, worst logit
    difference and greedy agreement against eager."""
    out: dict[str, Any] = {}
    for precision in PRECISIONS:
        cases = [r for r in rows if r.get("precision") == precision and "configs" in r]
        if not cases:
            continue
        per_config = {}
        for name in CONFIGS:
            per_config[name] = {
                "time_vs_ops_passes_median": _relative(cases, name, "median_ms"),
                "time_vs_ops_passes_min": _relative(cases, name, "min_ms"),
                "generated_kernels_per_forward": {c["family"]: c["configs"][name]["kernels"]["generated_per_forward"]
                                                  for c in cases},
                "custom_op_calls_per_forward": {c["family"]: c["configs"][name]["kernels"]["custom_op_calls_per_forward"]
                                                for c in cases},
                "max_logit_abs_vs_eager": max(c["configs"][name]["vs_eager"]["logits"]["max_abs"] for c in cases),
                "min_greedy_agreement_vs_eager": min(c["configs"][name]["vs_eager"]["greedy"]["agreement"]
                                                     for c in cases),
                "pass_matches": {c["family"]: c["configs"][name]["pass_matches"] for c in cases}}
        out[precision] = per_config
    return out


def _relative(cases: list[dict], name: str, stat: str) -> dict[str, float]:
    """Per bucket, the median over cases of t(name) / t(ops+passes) by one timing statistic."""
    return {b: statistics.median(c["step_times"][b]["variants"][name][stat]
                                 / c["step_times"][b]["variants"]["ops+passes"][stat] for c in cases)
            for b in cases[0]["step_times"]}


def summarize(result: dict) -> str:
    lines = [f"fusion study: step time per bucket, ms (median of {result['config']['repeats']} interleaved rounds); "
             f"kernels per forward: generated/custom-op calls; logits max |diff| vs eager; greedy agreement vs eager"]
    head = f"{'case':<22}{'config':<12}" + "".join(f"{b:>13}" for b in result["config"]["buckets"]) \
        + f"{'kernels':>10}{'max|dl|':>10}{'greedy':>8}  matches"
    lines.append(head)
    for row in result["rows"]:
        case = f"{row['family']} {row['precision']}"
        if "configs" not in row:
            lines.append(f"{case:<22}FAILED {row.get('error', '')[:200]}")
            continue
        for name, c in row["configs"].items():
            k, v = c["kernels"], c["vs_eager"]
            times = "".join(f"{row['step_times'][b]['variants'][name]['median_ms']:>13.3f}" for b in row["step_times"])
            matches = ", ".join(f"{p.replace('FusionPass', '')}={n}" for p, n in c["pass_matches"].items()) or "-"
            lines.append(f"{case:<22}{name:<12}{times}{k['generated_per_forward']:>5}/{k['custom_op_calls_per_forward']:<4}"
                         f"{v['logits']['max_abs']:>10.2g}{v['greedy']['agreement']:>8.0%}  {matches}")
    lines.append("median over families of t(config) / t(ops+passes), per bucket:")
    for precision, per_config in result["summary"].items():
        for name, s in per_config.items():
            rel = ", ".join(f"{b} {x:.2f}" for b, x in s["time_vs_ops_passes_median"].items())
            low = ", ".join(f"{x:.2f}" for x in s["time_vs_ops_passes_min"].values())
            lines.append(f"  {precision:<12}{name:<12}{rel}  (by minima: {low})")
    return "\n".join(lines)


def plot(result: dict) -> Any:
    """Per precision: each configuration's step time relative to ops+passes, per family, for
    decode-1, decode-32 and the prefill (bars; below 1 = faster than ops+passes)."""
    import matplotlib.pyplot as plt

    precisions = [p for p in result["config"]["precisions"] if p in result["summary"]]
    shown = ["decode-1", "decode-32", "prefill-128"]
    fig, axes = plt.subplots(1, len(precisions), figsize=(4.2 * len(precisions), 3.6), squeeze=False)
    for ax, precision in zip(axes[0], precisions):
        cases = [r for r in result["rows"] if r.get("precision") == precision and "configs" in r]
        labels, width = [], 0.8 / (len(CONFIGS) - 1)
        for k, name in enumerate([c for c in CONFIGS if c != "ops+passes"]):
            xs, ys = [], []
            for i, (case, bucket) in enumerate((c, b) for c in cases for b in shown):
                v = case["step_times"][bucket]["variants"]
                xs.append(i + (k - 0.5) * width)
                ys.append(v[name]["median_ms"] / v["ops+passes"]["median_ms"])
                if k == 0:
                    labels.append(f"{case['family']}\n{bucket}")
            ax.bar(xs, ys, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=5, rotation=90)
        ax.set_title(f"{precision}: t / t(ops+passes)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
