"""From a compiled engine's records to the report's matches, graph diffs and kernels.

Two ways of counting matches, both reported, because they answer different questions:

- per **distinct graph** (what the pass manager counts): the pass runs once per graph Inductor
  compiles, i.e. per distinct piece graph and compile size. Identical decoder layers compile
  once, so their matches count once. This is the work the pass did.
- per **piece instance** (what the engine's ``compile_counters.pass_matches`` counts): each
  compiled piece of the model counts the matches of its graph's dynamic-shape compile, so
  identical layers count once each. This is how many sites in the model run fused code.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Optional

from ..compiler.backend import piece_index
from .kernels import KernelSummary


def engine_records(llm: Any) -> tuple[Any, dict[int, str]]:
    """(the engine's pass manager or None, compiled piece index -> structural hash)."""
    backend = llm.engine.runner.graphs.forward_fn.backend
    pieces = {piece_index(target): h for target, h in backend.piece_hashes.items()}
    return backend.post_grad_pass, dict(sorted(pieces.items()))


def instances_by_hash(pieces: dict[int, str]) -> dict[str, list[int]]:
    """Structural hash -> the pieces that share that graph (in order)."""
    out: dict[str, list[int]] = {}
    for index, piece_hash in pieces.items():
        out.setdefault(piece_hash, []).append(index)
    return out


def graph_rows(manager: Any, pieces: dict[int, str], skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One row per graph the manager ran on: its piece and size, the pieces sharing the graph,
    and per pass (``skip`` left out) the matches per pattern, changed op counts, nodes added
    and removed, and the dump files."""
    shared = instances_by_hash(pieces)
    rows = []
    for record in manager.history:
        piece = int(record.labels.get("piece", -1))
        piece_hash = pieces.get(piece, "")
        steps = []
        for step in record.steps:
            if step.name in skip:
                continue
            steps.append({"pass": step.name, "matches": step.matches, "patterns": dict(step.patterns),
                          "ops_changed": changed_ops(step.ops_before, step.ops_after),
                          "added": dict(step.added), "removed": dict(step.removed),
                          "nodes_before": sum(step.ops_before.values()),
                          "nodes_after": sum(step.ops_after.values()),
                          "seconds": step.seconds, "dumps": list(step.dumps)})
        rows.append({"graph": record.index, "piece": piece, "size": record.labels.get("size", ""),
                     "piece_hash": piece_hash, "instances": shared.get(piece_hash, [piece]),
                     "ops": dict(record.steps[0].ops_before) if record.steps else {}, "steps": steps})
    return rows


def changed_ops(before: dict[str, int], after: dict[str, int]) -> dict[str, list[int]]:
    """Targets whose call count changed: target -> [before, after]."""
    return {t: [before.get(t, 0), after.get(t, 0)] for t in sorted(set(before) | set(after))
            if before.get(t, 0) != after.get(t, 0)}


def match_totals(rows: list[dict[str, Any]], pass_names: list[str]) -> dict[str, Any]:
    """Matches per pass and per pattern, per distinct graph (every size) and per piece
    instance (the dynamic compile of each piece sharing the graph), and per size."""
    per_pass = {name: {"distinct_graphs": 0, "piece_instances": 0, "by_size": {}} for name in pass_names}
    per_pattern: dict[str, dict[str, dict[str, int]]] = {name: {} for name in pass_names}
    for row in rows:
        for step in row["steps"]:
            totals = per_pass.setdefault(step["pass"], {"distinct_graphs": 0, "piece_instances": 0, "by_size": {}})
            totals["distinct_graphs"] += step["matches"]
            totals["by_size"][row["size"]] = totals["by_size"].get(row["size"], 0) + step["matches"]
            weight = len(row["instances"]) if row["size"] == "dynamic" else 0
            totals["piece_instances"] += step["matches"] * weight
            patterns = per_pattern.setdefault(step["pass"], {})
            for pattern, n in step["patterns"].items():
                entry = patterns.setdefault(pattern, {"distinct_graphs": 0, "piece_instances": 0})
                entry["distinct_graphs"] += n
                entry["piece_instances"] += n * weight
    return {"per_pass": per_pass, "per_pattern": per_pattern}


def write_diffs(rows: list[dict[str, Any]], dump_dir: Path) -> None:
    """Next to the dumps, a unified diff per pass that changed its graph; its name goes into
    the step's ``diff``."""
    for row in rows:
        for step in row["steps"]:
            if len(step["dumps"]) != 2 or not (step["added"] or step["removed"]):
                step["diff"] = None
                continue
            before, after = (dump_dir / name for name in step["dumps"])
            lines = difflib.unified_diff(_body(before), _body(after), before.name, after.name, n=2)
            target = before.with_name(before.name.replace("_before.py", ".diff"))
            target.write_text("".join(lines))
            step["diff"] = target.name


def _body(path: Path) -> list[str]:
    """The dumped graph without its comment header (which names before/after)."""
    return [line for line in path.read_text().splitlines(keepends=True) if not line.startswith("#")]


def kernel_rows(pieces: dict[int, str],
                by_variant: dict[str, dict[tuple[int, str], KernelSummary]]) -> list[dict[str, Any]]:
    """Per (piece, size) compiled in any variant: each variant's kernels (None where it
    compiled no such graph), side by side."""
    keys = sorted({k for summaries in by_variant.values() for k in summaries},
                  key=lambda k: (k[0], k[1] != "dynamic", k[1]))
    shared = instances_by_hash(pieces)
    rows = []
    for piece, size in keys:
        if piece < 0:
            continue
        row: dict[str, Any] = {"piece": piece, "size": size,
                               "instances": shared.get(pieces.get(piece, ""), [piece])}
        for variant, summaries in by_variant.items():
            row[variant] = _summary(summaries.get((piece, size)))
        rows.append(row)
    return rows


def _summary(summary: Optional[KernelSummary]) -> Optional[dict[str, Any]]:
    return summary.as_dict() if summary is not None else None


def kernel_totals(rows: list[dict[str, Any]], variant: str) -> dict[str, int]:
    """What one forward launches in the compiled pieces (dynamic compiles, each graph weighted
    by its instances): Inductor's generated kernels (and how many of them fuse several ops),
    custom-op calls (opaque to Inductor: one kernel each, or more) and library calls."""
    totals = {"generated_per_forward": 0, "fused_per_forward": 0, "custom_op_calls_per_forward": 0,
              "extern_calls_per_forward": 0}
    for row in rows:
        summary = row[variant]
        if row["size"] != "dynamic" or summary is None:
            continue
        weight = len(row["instances"])
        totals["generated_per_forward"] += summary["generated_count"] * weight
        totals["fused_per_forward"] += summary["fused_count"] * weight
        totals["custom_op_calls_per_forward"] += sum(summary["custom_ops"].values()) * weight
        totals["extern_calls_per_forward"] += sum(summary["extern"].values()) * weight
    return totals
