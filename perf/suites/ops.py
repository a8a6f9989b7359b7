"""Op benchmark: each op family's Triton kernel vs its plain-torch reference and vs
``torch.compile`` of that reference (Inductor's own code), per shape; fused ops also vs the
unfused pair of kernels they replace. On CPU only the reference and the compiled reference
run (Triton has no CPU backend outside the interpreter)."""
from __future__ import annotations

from typing import Callable

import torch

from vgraph.ops import activation, fp8, fused_quant, norm

EPS = 1e-6
Variant = Callable[[], object]


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
    families = {}
    for name, (ref, args) in refs.items():
        compiled = _compiled(ref)
        families[name] = {"torch_eager": lambda ref=ref, args=args: ref(*args),
                          "torch_compiled": lambda c=compiled, args=args: c(*args)}
        if device == "cuda":
            op = getattr(torch.ops.vgraph, name)
            families[name]["triton"] = lambda op=op, args=args: op(*args)
    if device == "cuda":
        _add_unfused_pairs(families, x, r, w, gu, s)
    return families


def _add_unfused_pairs(families, x, r, w, gu, s) -> None:
    """The two-kernel sequences that each fused op replaces, on the Triton kernels."""
    vg = torch.ops.vgraph
    families["rms_norm_static_fp8_quant"]["unfused_triton"] = \
        lambda: vg.static_scaled_fp8_quant(vg.rms_norm(x, w, EPS), s)
    families["fused_add_rms_norm_static_fp8_quant"]["unfused_triton"] = \
        lambda: vg.static_scaled_fp8_quant(vg.fused_add_rms_norm(x, r, w, EPS)[0], s)
    families["rms_norm_dynamic_per_token_fp8_quant"]["unfused_triton"] = \
        lambda: vg.dynamic_per_token_scaled_fp8_quant(vg.rms_norm(x, w, EPS))
    families["silu_and_mul_static_fp8_quant"]["unfused_triton"] = \
        lambda: vg.static_scaled_fp8_quant(vg.silu_and_mul(gu), s)


def run(device: str, quick: bool = False) -> dict:
    from ..timing import time_variants
    from . import ops_attention

    token_counts, hidden, inter = _shapes(device)
    if quick:
        token_counts = token_counts[:1]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for tokens in token_counts:
        families = _families(tokens, hidden, inter, dtype, device)
        families.update(ops_attention.families(tokens, dtype, device))
        for op, variants in families.items():
            timings = time_variants(variants, device, reps=5 if quick else 15)
            base = timings["torch_eager"]["median_s"]
            rows.append({"op": op, "tokens": tokens, "hidden": hidden, "intermediate": inter,
                         "dtype": str(dtype), "timings": timings,
                         "speedup_vs_eager": {k: base / v["median_s"] for k, v in timings.items()}})
    return {"suite": "ops", "rows": rows}


def summarize(result: dict) -> str:
    """Median microseconds per call, one row per (op, tokens), one column per variant."""
    names: list[str] = []
    for row in result["rows"]:
        names += [v for v in row["timings"] if v not in names]
    lines = [f"{'op':40s} {'tokens':>6s}  " + "  ".join(f"{v:>16s}" for v in names)]
    for row in result["rows"]:
        cells = [f"{row['timings'][v]['median_s'] * 1e6:14.1f}us" if v in row["timings"]
                 else f"{'-':>16s}" for v in names]
        lines.append(f"{row['op']:40s} {row['tokens']:6d}  " + "  ".join(cells))
    return "\n".join(lines)
