"""``python -m perf.report_docs [OUT.md]``: the committed results in ``perf/results/*.json`` as
one Markdown page, the documentation site's "Measured results" (the docs build calls
``results_page`` at build time, so the page is never older than the results files).

Each results file gets its suite's own text summary (the ``summarize`` that ``python -m perf
run`` prints), the suite's headline figures side by side with the ``--threads 1`` run where
the file has one, the machine and date it was measured on, the command that reproduces it,
and its plot. Nothing here re-measures or edits a figure: the page is the files, rendered.
"""
from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from .__main__ import SUITES
from .timing import RESULTS_DIR

# Results written by a stand-alone A/B script rather than a suite: name prefix -> its command.
_SCRIPTS = {"prefill-attention": "python -m perf.prefill_attention_ab",
            "decode-kernels": "python -m perf.decode_kernels_ab",
            "generate-ab": "python -m perf.generate_ab",
            "client-ab": "python -m perf.client_ab",
            "env-ab": "python -m perf.env_ab"}


def _script_args(result: dict) -> str:
    """The options a stand-alone script's file records, as its command line gave them."""
    if result.get("tool") == "env_ab":
        compared = f" --env {result['env']}" if "env" in result else f" --base {result['base']}"
        return f"{compared} --batch {result['batch']}"
    if "base" in result and "batch" in result:  # generate_ab
        args = f" --base {result['base']} --batch {result['batch']} --tokens {result['tokens']}"
        return args + (" --mean" if result.get("per_child") == "mean call" else "")
    config = result.get("config", {})
    if "emulated_device_ms_per_step" in config:  # client_ab
        return (f" --rounds {config['rounds']} --streams {config['streams']} --tokens {config['new_tokens']}"
                f" --device-ms {config['emulated_device_ms_per_step']:g}")
    threads = result.get("threads")
    return f" --threads {threads}" if threads else ""


def suite_of(name: str) -> Optional[str]:
    """The suite a results file belongs to, from its name (``<suite>-<device>[-suffix]``);
    None for a stand-alone script's file (``_SCRIPTS``)."""
    if any(name.startswith(prefix) for prefix in _SCRIPTS):
        return None
    for suite in sorted(SUITES, key=len, reverse=True):  # "serving-dp-cpu" is serving-dp's, not serving's
        if name.startswith(suite + "-"):
            return suite
    return None


def command_for(name: str, result: dict) -> str:
    """The command that writes this results file, as its machine ran it."""
    machine = result.get("machine", {})
    for prefix, script in _SCRIPTS.items():
        if name.startswith(prefix):
            return script + _script_args(result)
    suite = suite_of(name) or name
    device = machine.get("device", "cpu")
    cmd = f"python -m perf run {suite} --device {device}"
    threads = machine.get("torch_num_threads")
    if device == "cpu" and threads == 1 and (machine.get("cpu_count") or 1) > 1:
        cmd += " --threads 1"
    if name.endswith("-quick"):
        cmd += " --quick"
    return cmd


def _machine_line(machine: dict) -> str:
    parts = [f"measured {machine['date'][:10]}" if machine.get("date") else "date not recorded"]
    if machine.get("gpu"):
        parts.append(machine["gpu"])
    elif machine.get("cpu_count"):
        parts.append(f"{machine['cpu_count']}-core CPU")
    if machine.get("torch_num_threads"):
        threads = machine["torch_num_threads"]
        parts.append(f"{threads} torch thread{'s' if threads != 1 else ''}")
    for key in ("torch", "triton", "python"):
        if machine.get(key):
            parts.append(f"{key} {machine[key]}")
    return ", ".join(parts)


def _number(value: Any) -> str:
    if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.3f}".rstrip("0").rstrip(".") if isinstance(value, float) else f"{value:,}"


def _headline_table(module: Any, result: dict) -> list[str]:
    if not hasattr(module, "headline_figures"):
        return []
    try:
        many = module.headline_figures(result)
        one = module.headline_figures(result["threads_1"]) if "threads_1" in result else None
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return []  # an older file without a figure the current suite reads: the summary still shows
    threads = result.get("machine", {}).get("torch_num_threads", "default")
    if one is None:
        lines = ["| figure | value |", "| --- | --- |"]
        lines += [f"| {name} | {_number(value)} |" for name, value in many.items()]
    else:
        lines = [f"| figure | {threads} threads | 1 thread |", "| --- | --- | --- |"]
        lines += [f"| {name} | {_number(value)} | {_number(one.get(name))} |" for name, value in many.items()]
    return ["Headline figures:", ""] + lines + [""]


def _script_table(result: dict) -> list[str]:
    """A stand-alone A/B file (no suite module): its rows' (or rounds', or per-variant medians')
    scalar fields as a table."""
    rows = result.get("rows") or result.get("rounds") or []
    if isinstance(result.get("medians"), dict):
        rows = [{"variant": name, **values} for name, values in result["medians"].items()]
    if result.get("tool") == "env_ab":
        rows = [{"shape": shape, **{f"{side}_ms": ms for side, ms in r["median_ms"].items()},
                 "speedup": r["speedup"]} for shape, r in result["shapes"].items()]
    if not isinstance(rows, list) or not rows:
        return []
    flat = [_flatten(row) for row in rows]
    keys = list(dict.fromkeys(k for row in flat for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    for row in flat:
        lines.append("| " + " | ".join(_cell(row.get(k)) for k in keys) + " |")
    return lines + [""]


def _flatten(row: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return _number(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def section(path: Path, plot_link: Optional[str]) -> list[str]:
    """One results file as Markdown: heading, command, machine, summary, headline figures, plot."""
    name = path.stem
    result = json.loads(path.read_text(encoding="utf-8"))
    lines = [f"## {name}", "", f"Command: `{command_for(name, result)}`; file: `perf/results/{path.name}`; "
             f"{_machine_line(result.get('machine', {}))}.", ""]
    suite = suite_of(name)
    if suite is None:
        return lines + _script_table(result)
    module = importlib.import_module(f"perf.suites.{suite.replace('-', '_')}")
    lines += ["```text", _summary(module, result).rstrip(), "```", ""]
    if "threads_1" in result:
        lines += ["The same suite at `--threads 1`:", "", "```text",
                  _summary(module, result["threads_1"]).rstrip(), "```", ""]
    lines += _headline_table(module, result)
    if plot_link is not None:
        lines += [f"![{name}]({plot_link})", ""]
    return lines



def _summary(module, result: dict) -> str:
    """The suite's own summary of a result; a file older than that summary says so, not fail."""
    try:
        return module.summarize(result)
    except Exception as exc:  # noqa: BLE001
        return f"(this file predates the suite's summary: {type(exc).__name__}: {exc})"

def results_page(results_dir: Path = RESULTS_DIR, plot_prefix: Optional[str] = "plots/") -> str:
    """The whole page. ``plot_prefix`` is where the page finds ``<name>.png`` (the docs build
    copies the plots there); None leaves the plots out."""
    files = sorted(results_dir.glob("*.json"))
    lines = ["# Measured results", "",
             "Generated from `perf/results/*.json` when the documentation is built "
             "(`perf/report_docs.py`); each section names the command that wrote its file. "
             "Read [Performance](index.md) first for what each suite measures and how to read it.", "",
             "| results file | command | measured |", "| --- | --- | --- |"]
    for path in files:
        result = json.loads(path.read_text(encoding="utf-8"))
        date = (result.get("machine") or {}).get("date", "")[:10] or "-"
        anchor = path.stem.lower()
        lines.append(f"| [{path.stem}](#{anchor}) | `{command_for(path.stem, result)}` | {date} |")
    lines.append("")
    for path in files:
        png = path.with_suffix(".png")
        link = f"{plot_prefix}{png.name}" if plot_prefix is not None and png.exists() else None
        lines += section(path, link)
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = results_page(plot_prefix=None)
    if argv:
        Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
