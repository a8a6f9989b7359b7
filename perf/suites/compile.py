"""Compile: what ``torch.compile`` buys at run time, and what vgraph's passes do per model family.

(a) Decode throughput on the ~24M perf checkpoint (``build_perf_checkpoint(seed=0)``): N
concurrent requests (16 and 64; ``--quick``: 16), each a 16-token random prompt, 64 new tokens,
greedy, EOS ignored. Three engines in one process, run alternately (rotating order per round) so
load drift hits all alike:

- **eager**: ``enforce_eager=True`` (vgraph's custom ops, no compilation);
- **compiled**: ``CompileConfig(level="compiled", custom_ops=True)`` (vgraph's fused ops stay
  opaque to Inductor; the fusion passes run): the default for fp8 models and on CUDA;
- **compiled_no_custom_ops**: ``custom_ops=False``: norms and activations in plain torch, so
  Inductor generates (and fuses) those kernels itself: the default (``custom_ops`` unset) for
  this unquantized model on CPU.

Reported per engine: generated tokens/s of the whole ``generate`` (prefill + 64 decode steps),
and decode-only tokens/s = ``N * (64 - 1) / (t(64 tokens) - t(1 token))`` from a second,
one-token call per round (prefill plus the first token). Each engine's greedy tokens are
compared with eager's. Compilation happens before timing, in ``LLM(...)``, into a temporary
``VGRAPH_CACHE_DIR``; its time is recorded separately.

(b) Pass match counts per model family: tiny llama, qwen2, qwen3 (``build_tiny_checkpoint``),
a static fp8 checkpoint (``build_tiny_fp8_static_checkpoint(num_layers=2)``) and dynamic fp8
(``LLM(tiny llama, quantization="fp8")``), each compiled cold in its own subprocess (fresh
vgraph and Inductor caches, and no Dynamo state shared between models), recording
``engine.runner.compile_counters.pass_matches`` and the piece counts. Expected for static fp8 with L
layers: RMSNormQuantFusionPass = 2L (input and post-attention norms feeding the static quant),
SiluMulFusionPass = L (silu_and_mul feeding the static quant of down_proj's input).
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
from typing import Any, Optional

import torch

PROMPT_LEN = 16
MAX_NEW_TOKENS = 64
FIRST_REGULAR_ID = 6  # ids 0..5 are the demo tokenizer's special tokens
BLOCK_SIZE = 16
FAMILY_TIMEOUT_S = 300
REPO_ROOT = Path(__file__).resolve().parents[2]

VARIANTS = {
    "eager": {"enforce_eager": True},
    "compiled": {"custom_ops": True},
    "compiled_no_custom_ops": {"custom_ops": False},
}
FAMILIES = ("llama", "qwen2", "qwen3", "fp8_static", "fp8_dynamic")


def git_state() -> dict:
    """The commit measured and the runtime files that differed from it (others may be editing
    the working tree while a suite runs, so a number belongs to this state, not just a commit)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = git("status", "--porcelain", "--", "vgraph", "ops", "passes").splitlines()
    return {"commit": git("rev-parse", "HEAD"), "dirty_runtime_files": dirty}


def make_prompts(n: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_REGULAR_ID, vocab_size, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def build_llm(path: str, device: str, variant: str, max_seqs: int, **extra: Any) -> tuple[Any, float]:
    from vgraph import LLM
    from vgraph.config import CompileConfig

    spec = VARIANTS[variant]
    eager = spec.get("enforce_eager", False)
    compile_config = CompileConfig(level="none" if eager else "compiled",
                                   custom_ops=spec.get("custom_ops", True))
    blocks = max_seqs * -(-(PROMPT_LEN + MAX_NEW_TOKENS) // BLOCK_SIZE) + 16
    start = time.perf_counter()
    llm = LLM(path, dtype="float32", device=device, enable_prefix_caching=False, block_size=BLOCK_SIZE,
              max_num_seqs=max_seqs, max_num_batched_tokens=8192, num_gpu_blocks=blocks,
              compile_config=compile_config, enforce_eager=eager, **extra)
    return llm, time.perf_counter() - start


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from vgraph import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if any(len(t) != max_tokens for t in tokens):
        raise RuntimeError(f"a request did not generate {max_tokens} tokens")
    return seconds, tokens


def throughput(path: str, device: str, concurrencies: tuple[int, ...], rounds: int) -> dict:
    max_seqs = max(concurrencies)
    engines, build_s, counters = {}, {}, {}
    for name in VARIANTS:
        engines[name], build_s[name] = build_llm(path, device, name, max_seqs)
        c = engines[name].engine.runner.compile_counters
        counters[name] = c.as_dict() if c is not None else None
        print(f"  built {name} in {build_s[name]:.1f} s", flush=True)
    vocab = engines["eager"].engine.vocab_size
    out: dict[str, Any] = {"build_s": build_s, "compile_counters": counters, "by_concurrency": {}}
    names = list(VARIANTS)
    for n in concurrencies:
        prompts = make_prompts(n, vocab)
        for llm in engines.values():  # untimed: first-call allocations at this batch size
            generate(llm, prompts[:n], 4)
        full: dict[str, list[float]] = {k: [] for k in names}
        first: dict[str, list[float]] = {k: [] for k in names}
        tokens: dict[str, list[list[int]]] = {}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                seconds, tokens[name] = generate(engines[name], prompts, MAX_NEW_TOKENS)
                full[name].append(seconds)
                first[name].append(generate(engines[name], prompts, 1)[0])
                print(f"  N={n} round {r} {name:<24} {seconds:6.2f} s "
                      f"({n * MAX_NEW_TOKENS / seconds:7.1f} tok/s)", flush=True)
        rows = {}
        for name in names:
            t_full, t_first = statistics.median(full[name]), statistics.median(first[name])
            rows[name] = {"samples_s": full[name], "one_token_samples_s": first[name], "median_s": t_full,
                          "one_token_median_s": t_first, "tokens_per_s": n * MAX_NEW_TOKENS / t_full,
                          "decode_tokens_per_s": n * (MAX_NEW_TOKENS - 1) / (t_full - t_first),
                          "requests_matching_eager": sum(a == b for a, b in zip(tokens[name], tokens["eager"]))}
        ratios = {}
        for name in names[1:]:
            ratios[f"{name}/eager tokens/s"] = rows[name]["tokens_per_s"] / rows["eager"]["tokens_per_s"]
            ratios[f"{name}/eager decode tokens/s"] = (rows[name]["decode_tokens_per_s"]
                                                       / rows["eager"]["decode_tokens_per_s"])
        ratios["compiled/compiled_no_custom_ops tokens/s"] = (rows["compiled"]["tokens_per_s"]
                                                              / rows["compiled_no_custom_ops"]["tokens_per_s"])
        out["by_concurrency"][str(n)] = {"requests": n, "systems": rows, "ratio": ratios}
    return out


# ----------------------------------------------------------------------------- pass matches


def family_main(family: str, workdir: str, device: str) -> None:
    """Child process: builds one family's tiny checkpoint, compiles it cold, prints JSON."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    from vgraph import LLM
    from vgraph.config import CompileConfig
    from vgraph.models import demo
    from vgraph.testing import checkpoints

    path = os.path.join(workdir, "ckpt")
    extra: dict[str, Any] = {}
    if family == "fp8_static":
        checkpoints.build_tiny_fp8_static_checkpoint(path, seed=0, num_layers=2)
    elif family == "fp8_dynamic":
        demo.build_tiny_checkpoint(path, "llama", seed=0)
        extra["quantization"] = "fp8"
    else:
        demo.build_tiny_checkpoint(path, family, seed=0)
    config = json.loads(Path(path, "config.json").read_text())
    start = time.perf_counter()
    llm = LLM(path, device=device, max_num_seqs=4, max_num_batched_tokens=512, num_gpu_blocks=64,
              compile_config=CompileConfig(level="compiled"), **extra)
    build_s = time.perf_counter() - start
    from vgraph import SamplingParams
    out = llm.generate([{"prompt_token_ids": [7, 8, 9, 10]}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                                ignore_eos=True), use_tqdm=False)
    c = llm.engine.runner.compile_counters.as_dict()
    print("FAMILY_RESULT " + json.dumps({
        "family": family, "architecture": config.get("architectures", ["?"])[0],
        "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "quantization": extra.get("quantization") or config.get("quantization_config"),
        "dtype": str(llm.engine.runner.model.dtype), "build_s": build_s, "generated_tokens": len(out[0].outputs[0].token_ids),
        "counters": c}), flush=True)


def expected_matches(family: str, layers: int) -> dict[str, int]:
    if family == "fp8_static":
        return {"RMSNormQuantFusionPass": 2 * layers, "SiluMulFusionPass": layers}
    if family == "fp8_dynamic":
        # By the op library's design: the only dynamic fused op is rms_norm + dynamic quant
        # (no fused_add_rms_norm + dynamic, no silu_and_mul + dynamic), and the only plain
        # rms_norm feeding a quantized projection is layer 0's input norm (the others take the
        # residual). So 1 site for any L, and no SiLU+mul site.
        return {"RMSNormQuantFusionPass": 1, "SiluMulFusionPass": 0}
    return {"RMSNormQuantFusionPass": 0, "SiluMulFusionPass": 0}  # no quant op: nothing to fuse


def fp8_static_available() -> Optional[str]:
    try:
        from vgraph.testing.checkpoints import build_tiny_fp8_static_checkpoint  # noqa: F401
        return None
    except ImportError as exc:
        return f"build_tiny_fp8_static_checkpoint not importable: {exc}"


def pass_matches(device: str, families: tuple[str, ...]) -> dict:
    rows = {}
    for family in families:
        if family == "fp8_static" and (why := fp8_static_available()):
            rows[family] = {"skipped": why}
            continue
        with tempfile.TemporaryDirectory(prefix=f"vgraph-perf-compile-{family}-") as tmp:
            env = dict(os.environ, VGRAPH_CACHE_DIR=os.path.join(tmp, "vgraph"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"), PYTHONUNBUFFERED="1")
            code = f"from perf.suites.compile import family_main; family_main({family!r}, {tmp!r}, {device!r})"
            proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                                  text=True, timeout=FAMILY_TIMEOUT_S)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAMILY_RESULT ")]
        if proc.returncode != 0 or not lines:
            rows[family] = {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
            print(f"  {family}: FAILED (exit {proc.returncode})", flush=True)
            continue
        row = json.loads(lines[-1].removeprefix("FAMILY_RESULT "))
        expected = expected_matches(family, row["num_layers"])
        row["expected_pass_matches"] = expected
        measured = row["counters"]["pass_matches"]
        row["matches_expected"] = all(measured.get(k, 0) == v for k, v in expected.items())
        rows[family] = row
        print(f"  {family}: {measured} (pieces {row['counters']['pieces']}, built in {row['build_s']:.1f} s)",
              flush=True)
    return rows


def run(device: str, quick: bool = False) -> dict:
    from vgraph.testing.checkpoints import build_perf_checkpoint

    concurrencies = (16,) if quick else (16, 64)
    rounds = 1 if quick else 3
    load_before, git = os.getloadavg(), git_state()
    old_cache = os.environ.get("VGRAPH_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-compile-") as tmp:
        os.environ["VGRAPH_CACHE_DIR"] = os.path.join(tmp, "cache")  # cold, and the user's stays clean
        try:
            path = build_perf_checkpoint(os.path.join(tmp, "ckpt"), seed=0)
            tput = throughput(path, device, concurrencies, rounds)
        finally:
            if old_cache is None:
                os.environ.pop("VGRAPH_CACHE_DIR", None)
            else:
                os.environ["VGRAPH_CACHE_DIR"] = old_cache
    load_mid = os.getloadavg()
    families = ("llama", "fp8_static") if quick else FAMILIES
    matches = pass_matches(device, families)
    return {
        "suite": "compile",
        "config": {"checkpoint": "build_perf_checkpoint(seed=0)", "prompt_len": PROMPT_LEN,
                   "max_new_tokens": MAX_NEW_TOKENS, "concurrencies": list(concurrencies), "rounds": rounds,
                   "dtype": "float32", "greedy": True, "ignore_eos": True, "variants": VARIANTS,
                   "torch_num_threads": torch.get_num_threads(), "git": git,
                   "decode_tokens_per_s": "N*(64-1) / (median t(64 new) - median t(1 new))",
                   "loadavg_before_mid_after": [load_before, load_mid, os.getloadavg()]},
        "throughput": tput, "pass_matches": matches,
    }


def summarize(result: dict) -> str:
    cfg = result["config"]
    lines = [f"compile (a): {cfg['prompt_len']}-token prompts, {cfg['max_new_tokens']} new tokens, greedy fp32, "
             f"median of {cfg['rounds']} (load avg before {cfg['loadavg_before_mid_after'][0][0]:.2f})",
             f"{'N':>4} {'variant':<24}{'wall s':>8}{'tok/s':>9}{'decode':>9}{'x eager':>9}{'match':>8}"]
    for n, block in result["throughput"]["by_concurrency"].items():
        base = block["systems"]["eager"]["tokens_per_s"]
        for name, s in block["systems"].items():
            lines.append(f"{n:>4} {name:<24}{s['median_s']:>8.2f}{s['tokens_per_s']:>9.1f}"
                         f"{s['decode_tokens_per_s']:>9.1f}{s['tokens_per_s'] / base:>9.2f}"
                         f"{s['requests_matching_eager']:>5}/{n}")
    lines.append("build (incl. cold compile) s: " + ", ".join(
        f"{k} {v:.1f}" for k, v in result["throughput"]["build_s"].items()))
    lines.append("compile (b): pass matches per family (cold compile, own process)")
    for family, row in result["pass_matches"].items():
        if "counters" not in row:
            lines.append(f"  {family:<12} {row.get('skipped') or row.get('error', '')[:200]}")
            continue
        c = row["counters"]
        ok = "as expected" if row["matches_expected"] else f"EXPECTED {row['expected_pass_matches']}"
        lines.append(f"  {family:<12} L={row['num_layers']} {c['pass_matches']} pieces {c['pieces']} "
                     f"({c['compiled_pieces']} compiled, {c['unique_piece_graphs']} distinct) {ok}")
    return "\n".join(lines)


def plot(result: dict) -> Any:
    """Left: tokens/s per engine and concurrency. Right: pass matches found vs expected per family."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    levels = result["throughput"]["by_concurrency"]
    names = list(next(iter(levels.values()))["systems"])
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(levels))]
        left.bar(xs, [lv["systems"][name]["tokens_per_s"] for lv in levels.values()], width, label=name)
    left.set_xticks(range(len(levels)), [f"{n} requests" for n in levels])
    left.set_ylabel("generated tokens/s")
    left.set_title("compiled vs eager (perf checkpoint)", fontsize=9)
    left.legend(fontsize=7)
    families = result["pass_matches"]
    rows = [(fam, p, r["counters"]["pass_matches"].get(p, 0), (r.get("expected_pass_matches") or {}).get(p))
            for fam, r in families.items() for p in sorted(r["counters"]["pass_matches"])]
    labels = [f"{fam}\n{p.replace('FusionPass', '')}" for fam, p, _, _ in rows]
    right.bar(range(len(rows)), [found for _, _, found, _ in rows], label="found")
    right.scatter(range(len(rows)), [exp if exp is not None else float("nan") for *_, exp in rows],
                  color="black", marker="_", s=300, label="expected", zorder=3)
    right.set_xticks(range(len(rows)), labels, fontsize=6, rotation=60)
    right.set_ylabel("pass matches")
    right.set_title("fusion-pass matches per model family (2 layers)", fontsize=9)
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig
