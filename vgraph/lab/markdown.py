"""The pass report as Markdown, drawn from report.json's data alone (so it can be redrawn)."""
from __future__ import annotations

from typing import Any

WITHOUT, WITH = "without", "with"


def render(data: dict[str, Any]) -> str:
    parts = [_header(data), _summary(data), _matches(data), _numerics(data), _times(data),
             _kernels(data), _graphs(data)]
    return "\n\n".join(p for p in parts if p) + "\n"


def _table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def _header(data: dict[str, Any]) -> str:
    cfg = data["config"]
    order = " → ".join(cfg["run_order"]) or "none"
    return (f"# Pass report: {data['model']}\n\n"
            f"{data['architecture']}, {data['dtype']}, {data['device']}, torch {cfg['torch']}, "
            f"{cfg['torch_num_threads']} threads, custom ops {'on' if cfg['custom_ops'] else 'off'} "
            f"(norms and activations {'as vgraph ops' if cfg['custom_ops'] else 'in plain torch'}), "
            f"quantization {cfg['quantization'] or 'none'}. Passes under study, in run order: **{order}** "
            f"(vgraph's own passes {'included' if cfg['default_passes'] else 'excluded'}). "
            f"\"without\" compiles the same model with no pass that changes the graph; both compile "
            f"cold in this process, \"without\" first.")


def _summary(data: dict[str, Any]) -> str:
    c, k = data["compile"], data["kernels"]["totals"]
    numerics = data.get("numerics", {})
    rows = [["engine build (load, compile, warm-up), s", c[WITHOUT]["engine_build_s"], c[WITH]["engine_build_s"]],
            ["Dynamo + Inductor, s", c[WITHOUT]["dynamo_s"] + c[WITHOUT]["inductor_s"],
             c[WITH]["dynamo_s"] + c[WITH]["inductor_s"]],
            ["Inductor compilations", c[WITHOUT]["inductor_compilations"], c[WITH]["inductor_compilations"]]]
    for key, label in (("generated_per_forward", "generated kernels per forward"),
                       ("fused_per_forward", "of which fuse several ops"),
                       ("custom_op_calls_per_forward", "custom-op calls per forward"),
                       ("extern_calls_per_forward", "library (extern) calls per forward")):
        rows.append([label, k[WITHOUT][key], k[WITH][key]])
    text = "## Summary\n\n" + _table(["", WITHOUT, WITH], rows)
    for dtype, n in numerics.items():
        g = n["greedy"]
        text += (f"\n\n{dtype}: logits max |Δ| {n['logits']['max_abs']:.3g} (relative {n['logits']['max_rel']:.3g}); "
                 f"greedy tokens agree on {g['agreement']:.0%} ({g['identical']}/{g['sequences']} sequences identical "
                 f"over {g['tokens']} tokens)")
    times = data.get("step_times", {})
    if times:
        text += "\n\nStep time with/without passes: " + ", ".join(
            f"{name} {row['speedup']:.2f}x" for name, row in times.items()) + " (> 1: the passes made it faster)"
    return text


def _matches(data: dict[str, Any]) -> str:
    m = data["matches"]
    sizes = sorted({s for t in m["per_pass"].values() for s in t["by_size"]}, key=lambda s: (s != "dynamic", s))
    rows = [[name, t["piece_instances"], t["distinct_graphs"], *[t["by_size"].get(s, 0) for s in sizes]]
            for name, t in m["per_pass"].items()]
    text = ("## Matches\n\nPer **piece instance**: sites in the model (each compiled piece counts its graph's "
            "matches, identical layers once each; dynamic-shape compile) — the engine's "
            "`compile_counters.pass_matches`. Per **distinct graph**: the pass's own calls, once per graph "
            "Inductor compiled (identical layers compile once) and per compile size — the pass manager's "
            "`match_counts()`.\n\n")
    text += _table(["pass", "per piece instance", "per distinct graph", *[f"size {s}" for s in sizes]], rows)
    pattern_rows = [[name, pattern, e["piece_instances"], e["distinct_graphs"]]
                    for name, patterns in m["per_pattern"].items() for pattern, e in patterns.items()]
    if pattern_rows:
        text += "\n\n" + _table(["pass", "pattern", "per piece instance", "per distinct graph"], pattern_rows)
    per_piece = [[r["piece"], r["size"], ", ".join(map(str, r["instances"])),
                  "; ".join(f"{s['pass']} {s['matches']}" + (f" ({_kv(s['patterns'])})" if s["patterns"] else "")
                            for s in r["steps"])] for r in data["graphs"]]
    if per_piece:
        text += "\n\nPer compiled graph:\n\n" + _table(["piece", "size", "pieces sharing it", "matches"], per_piece)
    return text


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def _numerics(data: dict[str, Any]) -> str:
    rows = []
    for dtype, n in data.get("numerics", {}).items():
        lg, g = n["logits"], n["greedy"]
        rows.append([dtype, lg["max_abs"], lg["max_rel"], lg["mean_abs"], f"{lg['argmax_agreement']:.0%}",
                     f"{g['agreement']:.0%}", f"{g['identical']}/{g['sequences']}", ", ".join(map(str, g["prefix_lengths"]))])
    if not rows:
        return ""
    first = next(iter(data["numerics"].values()))
    lengths = ", ".join(str(len(p)) for p in first["prompts"])
    return ("## Numerics\n\nLogits of every position of a fixed batch (prompts of " + lengths + " tokens, one "
            "prefill step), with vs without; relative = max |Δ| / max |logit without|. Greedy tokens: "
            "the fraction before the first divergence.\n\n"
            + _table(["dtype", "max abs", "max rel", "mean abs", "same argmax", "greedy agreement",
                      "identical sequences", "agreeing prefix per prompt"], rows))


def _times(data: dict[str, Any]) -> str:
    times = data.get("step_times", {})
    if not times:
        return ""
    rows = [[name, row["variants"][WITHOUT]["median_ms"], row["variants"][WITH]["median_ms"], f"{row['speedup']:.2f}x"]
            for name, row in times.items()]
    return ("## Step time\n\nOne step on the runner's path (build once; forward + logits of the sampled rows), "
            f"median of {data['config']['repeats']} interleaved rounds, ms. decode-N: N sequences of 64 cached "
            "tokens; prefill-N: one prompt of N tokens.\n\n"
            + _table(["bucket", WITHOUT, WITH, "speedup"], rows))


def _kernels(data: dict[str, Any]) -> str:
    rows = []
    for r in data["kernels"]["pieces"]:
        cells = [r["piece"], r["size"]]
        for variant in (WITHOUT, WITH):
            s = r[variant]
            cells.append("—" if s is None else
                         f"{s['generated_count']} generated, {s['fused_count']} fused: "
                         + (", ".join(f"`{name}`" for name in s["fused"]) or "none")
                         + (f"; custom ops {_kv(s['custom_ops'])}" if s["custom_ops"] else ""))
        rows.append(cells)
    if not rows:
        return ""
    return ("## Inductor kernels per piece\n\nWhat Inductor generated (its descriptive kernel names list the "
            "aten ops it fused) and the custom ops it called as opaque kernels.\n\n"
            + _table(["piece", "size", WITHOUT, WITH], rows))


def _graphs(data: dict[str, Any]) -> str:
    out = ["## Graph diff per piece\n\nOp counts that each pass changed (before → after), nodes it added and "
           f"removed. Dumps of every graph before and after each pass: `{data['dumps'][WITH]}` (with) and "
           f"`{data['dumps'][WITHOUT]}` (without); a `.diff` beside the dumps for each pass that changed its graph."]
    for r in data["graphs"]:
        out.append(f"### piece {r['piece']}, size {r['size']} (pieces sharing this graph: "
                   f"{', '.join(map(str, r['instances']))})")
        for s in r["steps"]:
            line = (f"- **{s['pass']}**: {s['matches']} matches, nodes {s['nodes_before']} → {s['nodes_after']}"
                    + (f", diff `{s['diff']}`" if s.get("diff") else ""))
            if s["ops_changed"]:
                line += "; " + ", ".join(f"`{t}` {a} → {b}" for t, (a, b) in s["ops_changed"].items())
            out.append(line)
    return "\n\n".join(out) if data["graphs"] else ""
