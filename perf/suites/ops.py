"""Op benchmark: each vgraph op (``torch.ops.vgraph.<op>``: the Triton kernel on CUDA, the
plain-torch CPU implementation on CPU) vs its plain-torch reference in eager mode and vs
``torch.compile`` of that reference (Inductor's own code: custom ops off), per shape; every
fused op also vs the unfused sequence it replaces. Attention rows come from ops_attention;
on CPU, ``linear_*`` rows time the packed float32 GEMM (``vgraph::packed_linear``) against
``F.linear``, and the attention rows also time the gather+SDPA path the C++ kernel replaced.

Variants per op and shape:

- **vgraph**: the custom op;
- **unfused** (fused ops only, ``UNFUSED``): the sequence the fused op replaces, as the model
  would run it without the fusion (vgraph ops, or aten kernels where vgraph has no op);
- **torch_eager**: the plain-torch reference (``*_reference`` in vgraph.ops), eager;
- **torch_compiled**: ``torch.compile(reference, dynamic=False, fullgraph=True)``.

Target from the issue (CUDA): each fused op faster than the unfused sequence it replaces, at
every shape (``target``: met / measured per op). On CPU the custom op *is* the reference
composition behind one dispatcher call, so fused vs unfused there is reported, not targeted.
"""
from __future__ import annotations

import os
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from vgraph.ops import activation, fp8, fused_quant, norm

EPS = 1e-6
Variant = Callable[[], object]

# Fused op -> the sequence it replaces (what "unfused" runs).
UNFUSED_DESCRIPTION = {
    "fused_add_rms_norm": "x + residual (aten add), then vgraph rms_norm",
    "silu_and_mul": "silu(gate), then gate * up (two aten kernels)",
    "rms_norm_static_fp8_quant": "vgraph rms_norm, then vgraph static_scaled_fp8_quant",
    "fused_add_rms_norm_static_fp8_quant": "vgraph fused_add_rms_norm, then vgraph static_scaled_fp8_quant",
    "rms_norm_dynamic_per_token_fp8_quant": "vgraph rms_norm, then vgraph dynamic_per_token_scaled_fp8_quant",
    "silu_and_mul_static_fp8_quant": "vgraph silu_and_mul, then vgraph static_scaled_fp8_quant",
}

COLUMN_ORDER = ["vgraph", "vgraph_split_kv", "vgraph_gather_sdpa", "unfused", "torch_eager", "torch_compiled", "sdpa_contiguous"]


def _shapes(device: str) -> tuple[list[int], int, int]:
    """Token counts, hidden size, intermediate size: Llama-3-8B widths on GPU, smaller on CPU."""
    if device == "cuda":
        return [1, 32, 256, 2048], 4096, 14336
    return [1, 32, 256], 2048, 5632


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _families(tokens: int, hidden: int, inter: int, dtype: torch.dtype, device: str) -> dict[str, dict[str, Variant]]:
    """For each op: {variant name: zero-argument callable}."""
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    r = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    gu = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
    s = torch.tensor([0.01], device=device)
    refs: dict[str, tuple[Callable, tuple]] = {
        "rms_norm": (norm.rms_norm_reference, (x, w, EPS)),
        "fused_add_rms_norm": (norm.fused_add_rms_norm_reference, (x, r, w, EPS)),
        "silu_and_mul": (activation.silu_and_mul_reference, (gu,)),
        "static_scaled_fp8_quant": (fp8.static_scaled_fp8_quant_reference, (x, s)),
        "dynamic_per_token_scaled_fp8_quant": (fp8.dynamic_per_token_scaled_fp8_quant_reference, (x,)),
        "rms_norm_static_fp8_quant": (fused_quant.rms_norm_static_fp8_quant_reference, (x, w, s, EPS)),
        "fused_add_rms_norm_static_fp8_quant": (fused_quant.fused_add_rms_norm_static_fp8_quant_reference, (x, r, w, s, EPS)),
        "rms_norm_dynamic_per_token_fp8_quant": (fused_quant.rms_norm_dynamic_per_token_fp8_quant_reference, (x, w, EPS)),
        "silu_and_mul_static_fp8_quant": (fused_quant.silu_and_mul_static_fp8_quant_reference, (gu, s)),
    }
    unfused = _unfused(x, r, w, gu, s, inter)
    families = _linear_families(x, hidden, inter) if device == "cpu" else {}
    for name, (ref, args) in refs.items():
        op = getattr(torch.ops.vgraph, name)
        compiled = _compiled(ref)
        families[name] = {"vgraph": lambda op=op, args=args: op(*args)}
        if name in unfused:
            families[name]["unfused"] = unfused[name]
        families[name]["torch_eager"] = lambda ref=ref, args=args: ref(*args)
        families[name]["torch_compiled"] = lambda c=compiled, args=args: c(*args)
    return families


def _linear_families(x: torch.Tensor, hidden: int, inter: int) -> dict[str, dict[str, Variant]]:
    """CPU float32 projections: vgraph's packed GEMM (``vgraph::packed_linear``, what CPU
    float32 models run) vs ``F.linear`` eager and compiled, on the gate_up and down shapes."""
    from vgraph.ops.linear import pack_weight
    families = {}
    for name, out_features, in_features in (("linear_gate_up", 2 * inter, hidden),
                                            ("linear_down", hidden, inter)):
        weight = torch.randn(out_features, in_features) * 0.02
        rows = torch.randn(x.shape[0], in_features)
        packed = pack_weight(weight)
        compiled = _compiled(F.linear)
        families[name] = {
            "vgraph": lambda rows=rows, p=packed, n=out_features: torch.ops.vgraph.packed_linear(rows, p, None, n),
            "torch_eager": lambda rows=rows, w=weight: F.linear(rows, w),
            "torch_compiled": lambda c=compiled, rows=rows, w=weight: c(rows, w),
        }
    return families


def _unfused(x, r, w, gu, s, inter: int) -> dict[str, Variant]:
    """The sequences each fused op replaces (see UNFUSED_DESCRIPTION)."""
    vg = torch.ops.vgraph

    def add_then_norm():
        residual = x + r
        return vg.rms_norm(residual, w, EPS), residual

    return {
        "fused_add_rms_norm": add_then_norm,
        "silu_and_mul": lambda: F.silu(gu[..., :inter]) * gu[..., inter:],
        "rms_norm_static_fp8_quant": lambda: vg.static_scaled_fp8_quant(vg.rms_norm(x, w, EPS), s),
        "fused_add_rms_norm_static_fp8_quant":
            lambda: vg.static_scaled_fp8_quant(vg.fused_add_rms_norm(x, r, w, EPS)[0], s),
        "rms_norm_dynamic_per_token_fp8_quant": lambda: vg.dynamic_per_token_scaled_fp8_quant(vg.rms_norm(x, w, EPS)),
        "silu_and_mul_static_fp8_quant": lambda: vg.static_scaled_fp8_quant(vg.silu_and_mul(gu), s),
    }


def _ratios(timings: dict[str, dict]) -> dict[str, float]:
    """For a fused op: > 1 means the fused op is that much faster than the other variant."""
    fused = timings["vgraph"]["median_s"]
    return {"fused_vs_unfused": timings["unfused"]["median_s"] / fused,
            "fused_vs_inductor": timings["torch_compiled"]["median_s"] / fused}


def run(device: str, quick: bool = False) -> dict:
    from ..timing import time_variants
    from . import ops_attention, ops_linear_threads
    from .compile import git_state

    token_counts, hidden, inter = _shapes(device)
    if quick:
        token_counts = token_counts[:1]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    reps = 5 if quick else 15
    rows = []
    for tokens in token_counts:
        families = _families(tokens, hidden, inter, dtype, device)
        families.update(ops_attention.families(tokens, dtype, device))
        for op, variants in families.items():
            timings = time_variants(variants, device, reps=reps)
            base = timings["torch_eager"]["median_s"]
            row = {"op": op, "tokens": tokens, "hidden": hidden, "intermediate": inter,
                   "dtype": str(dtype), "timings": timings,
                   "speedup_vs_eager": {k: base / v["median_s"] for k, v in timings.items()}}
            if "unfused" in timings:
                row["fused"] = _ratios(timings)
            rows.append(row)
        print(f"  tokens {tokens}: {len(families)} ops timed", flush=True)
    threads = ops_linear_threads.sweep(quick) if device == "cpu" and torch.get_num_threads() > 1 else None
    return {"suite": "ops", "linear_threads": threads,
            "config": {"device": device, "dtype": str(dtype), "tokens": token_counts, "hidden": hidden,
                       "intermediate": inter, "reps": reps, "attention": ops_attention.describe(device),
                       "unfused": UNFUSED_DESCRIPTION, "git": git_state(), "loadavg": os.getloadavg()},
            "rows": rows, "target": targets(device, rows)}


def targets(device: str, rows: list[dict]) -> dict:
    """Per fused op: fused/unfused (and fused/Inductor) per token count; on CUDA whether the
    fused op beat the unfused sequence at every shape."""
    out: dict[str, dict] = {}
    for row in rows:
        if "fused" not in row:
            continue
        entry = out.setdefault(row["op"], {"fused_vs_unfused": {}, "fused_vs_inductor": {}})
        entry["fused_vs_unfused"][str(row["tokens"])] = row["fused"]["fused_vs_unfused"]
        entry["fused_vs_inductor"][str(row["tokens"])] = row["fused"]["fused_vs_inductor"]
    for entry in out.values():
        entry["met"] = all(v > 1.0 for v in entry["fused_vs_unfused"].values()) if device == "cuda" else None
    note = ("target: each fused op faster than the unfused sequence it replaces at every shape (ratio > 1)"
            if device == "cuda" else "CPU: report only (the CPU ops are the reference compositions)")
    return {"note": note, "ops": out}


def summarize(result: dict) -> str:
    """Median microseconds per call, one row per (op, tokens), one column per variant; then
    the fused ops' ratios and the target."""
    names: list[str] = []
    for row in result["rows"]:
        names += [v for v in row["timings"] if v not in names]
    names.sort(key=lambda v: COLUMN_ORDER.index(v) if v in COLUMN_ORDER else len(COLUMN_ORDER))
    lines = [f"{'op':40s} {'tokens':>6s}  " + "  ".join(f"{v:>16s}" for v in names)]
    for row in result["rows"]:
        cells = [f"{row['timings'][v]['median_s'] * 1e6:14.1f}us" if v in row["timings"]
                 else f"{'-':>16s}" for v in names]
        lines.append(f"{row['op']:40s} {row['tokens']:6d}  " + "  ".join(cells))
    target = result.get("target")
    if target:
        lines.append(f"fused ops, time ratio (>1: fused faster) per token count; {target['note']}")
        for op, entry in target["ops"].items():
            status = "" if entry["met"] is None else ("  MET" if entry["met"] else "  not met")
            unf = ", ".join(f"{t}: {v:.2f}x" for t, v in entry["fused_vs_unfused"].items())
            ind = ", ".join(f"{t}: {v:.2f}x" for t, v in entry["fused_vs_inductor"].items())
            lines.append(f"  {op:38s} vs unfused {unf}; vs Inductor {ind}{status}")
        meds = [v for e in target["ops"].values() for v in e["fused_vs_inductor"].values()]
        if meds:
            lines.append(f"  median fused vs Inductor over ops and shapes: {statistics.median(meds):.2f}x")
    from . import ops_linear_threads
    lines += ops_linear_threads.summarize(result.get("linear_threads"))
    return "\n".join(lines)


def headline_figures(result: dict) -> dict[str, float]:
    """Median microseconds of the packed GEMM and the C++ decode attention per token count."""
    figures = {}
    for row in result["rows"]:
        if row["op"].startswith(("linear_", "paged_attention")) and "vgraph" in row["timings"]:
            figures[f"{row['op']} x{row['tokens']}: vgraph us"] = row["timings"]["vgraph"]["median_s"] * 1e6
            figures[f"{row['op']} x{row['tokens']}: vs eager"] = row["speedup_vs_eager"]["vgraph"]
    return figures


def plot(result: dict):
    """Per op: speedup vs torch eager (log scale; bars grow up from 1 when faster, down when
    slower) of every other variant, grouped by token count."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ops = list(dict.fromkeys(row["op"] for row in result["rows"]))
    present = {v for row in result["rows"] for v in row["timings"]} - {"torch_eager"}
    order = [v for v in COLUMN_ORDER if v in present] + sorted(present - set(COLUMN_ORDER))
    colors = {v: f"C{i}" for i, v in enumerate(order)}
    cols = 4
    nrows = -(-len(ops) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        rows = [row for row in result["rows"] if row["op"] == op]
        variants = [v for v in order if v in rows[0]["timings"]]
        x = np.arange(len(rows))
        width = 0.8 / max(1, len(variants))
        values = []
        for i, v in enumerate(variants):
            speedups = [row["speedup_vs_eager"][v] for row in rows]
            values += speedups
            ax.bar(x + (i - (len(variants) - 1) / 2) * width, [s - 1 for s in speedups], width, bottom=1,
                   color=colors[v], label=v)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylim(min(values + [1]) / 1.4, max(values + [1]) * 1.4)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(x, [str(row["tokens"]) for row in rows])
        ax.set_xlabel("tokens", fontsize=8)
        ax.set_title(op, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(True, axis="y", which="major", alpha=0.3)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("speedup vs torch eager", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[v]) for v in order]
    fig.legend(handles, order, loc="lower right", fontsize=9, bbox_to_anchor=(0.98, 0.04))
    cfg, machine = result.get("config", {}), result.get("machine", {})
    fig.suptitle(f"ops suite: speedup vs the plain-torch reference run eagerly (>1: faster); "
                 f"{cfg.get('dtype', '')}, {machine.get('gpu') or machine.get('platform', '')}, "
                 f"{machine.get('torch_num_threads', '?')} thread(s) ({machine.get('date', '')[:10]})", fontsize=10)
    fig.tight_layout()
    return fig
