"""``vgraph.passes.report``: compile a model without and with the passes under study, and
write down what the passes did and what it bought.

Both variants are the same engine configuration except for the passes: "without" runs no
pass that changes the graph (an observer records the post-grad graph Inductor received),
"with" runs the passes under study: vgraph's own (unless ``default_passes=False``) and the
given ones, each before or after vgraph's by its position. Both compile cold: vgraph's compile
cache is off (a cached artifact would run no pass), Inductor's FX-graph cache misses because
each engine's pass manager keys it with a fresh nonce, and one small compile beforehand pays
the process's one-time Inductor start-up, so neither variant is charged for it.

Everything measured side by side in one process: matches (per pass, pattern, piece and
compile size), the graph diff per pass (op counts, nodes added and removed, dumps and unified
diffs), Inductor's kernels per piece, logits on a fixed batch and greedy tokens (in float32
and in the model's dtype), compile time, and step time per bucket (interleaved medians).
"""
from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..config import default_block_size, resolve_device
from .analysis import engine_records, graph_rows, kernel_rows, kernel_totals, match_totals, write_diffs
from .kernels import KernelCapture
from .markdown import render
from .measure import (Bucket, buckets, fixed_prompts, greedy_tokens, logit_difference, prompt_logits,
                      step_times, token_agreement, warm_inductor)

logger = logging.getLogger("vgraph.lab")

WITHOUT, WITH = "without", "with"
OBSERVER = "observe_post_grad_graph"
# Settings the report decides itself: each variant's passes, and a cold compile.
_REPORT_OWNED = ("passes", "enable_fusion", "use_cache", "level", "enforce_eager", "dump_graphs_dir",
                 "compile_config")


def observe_post_grad_graph(graph: torch.fx.Graph) -> int:
    """The "without" variant's only pass: changes nothing, matches nothing. Its presence gives
    that engine a pass manager, whose history records the graph Inductor received and whose
    uuid makes Inductor's FX-graph cache miss, as the "with" engine's does."""
    return 0


observe_post_grad_graph.uuid = lambda: "vgraph.lab.observe_post_grad_graph/1"  # type: ignore[attr-defined]


@dataclass
class PassReport:
    """What ``report`` wrote: the data (as in report.json) and where it lies."""

    data: dict[str, Any]
    out_dir: Path
    llms: dict[str, Any] = field(default_factory=dict)  # only with keep_engines=True

    @property
    def json_path(self) -> Path:
        return self.out_dir / "report.json"

    @property
    def markdown_path(self) -> Path:
        return self.out_dir / "report.md"


def report(model: str, passes: Sequence[Any] = (), *, default_passes: bool = True, tokens: int = 16,
           out: Optional[str | Path] = None, repeats: int = 5, decode_sizes: Sequence[int] = (1, 8, 32),
           prefill_tokens: Optional[int] = 128, keep_engines: bool = False, **engine_kwargs: Any) -> PassReport:
    """Compiles ``model`` without and with the passes under study and writes report.md and
    report.json (plus graph dumps and diffs under graphs/) into ``out`` (default
    ``./pass-report``).

    ``passes``: pass objects, ``PlacedPass``es or specs ("[before:]module:Name",
    "[before:]path/to/file.py:Name"); ``default_passes``: whether vgraph's own passes are
    among those studied. ``tokens``: greedy tokens generated per prompt for the agreement
    check. ``repeats``: timed rounds per bucket. Other keywords are ``LLM`` keywords (dtype,
    quantization, custom_ops, device, compile_sizes, ...) applied to both variants.
    ``keep_engines``: keep the two engines of the model's dtype in ``PassReport.llms``.
    """
    clashes = sorted(set(engine_kwargs) & set(_REPORT_OWNED))
    if clashes:
        raise ValueError(f"report() sets {', '.join(clashes)} itself (passes via passes= and default_passes=)")
    if tokens < 1 or repeats < 1:
        raise ValueError(f"tokens and repeats must be at least 1, got {tokens} and {repeats}")
    if engine_kwargs.get("tensor_parallel_size", 1) != 1:
        raise ValueError("tensor_parallel_size: the pass report times and inspects a model in this process; "
                         "run it at tensor_parallel_size=1")
    out_dir = Path(out if out is not None else "pass-report").expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = buckets(tuple(decode_sizes), prefill_tokens)
    settings = _engine_settings(plan, engine_kwargs)
    studied = list(passes)
    warm_inductor(str(settings.get("device", "auto")))

    captures = {WITHOUT: KernelCapture(), WITH: KernelCapture()}
    llms, build = {}, {}
    for name in (WITHOUT, WITH):
        with captures[name]:
            llms[name], build[name] = _build(model, name, studied, default_passes, settings,
                                             out_dir / "graphs" / name)
    dtype = llms[WITH].engine.runner.model.dtype
    numerics = {_dtype_name(dtype): _numerics(llms, tokens)}
    times = step_times(llms, plan, repeats)
    data = _assemble(model, llms, build, captures, studied, default_passes, settings, plan, repeats,
                     tokens, out_dir)
    kept = dict(llms) if keep_engines else {}
    _free(llms)
    if dtype != torch.float32:  # the same comparison in float32, numerics only
        fp32 = {name: _build(model, name, studied, default_passes, {**settings, "dtype": "float32"}, None)[0]
                for name in (WITHOUT, WITH)}
        numerics["float32"] = _numerics(fp32, tokens)
        _free(fp32)
    data["numerics"] = numerics
    data["step_times"] = _with_speedups(times)
    result = PassReport(data, out_dir, kept)
    result.json_path.write_text(json.dumps(data, indent=1, default=str))
    result.markdown_path.write_text(render(data))
    return result


def _engine_settings(plan: list[Bucket], given: dict[str, Any]) -> dict[str, Any]:
    """LLM keywords for both variants: the caller's, plus room for the timed buckets (unless
    the caller sized these), and no prefix caching (measure.py writes KV outside the pool)."""
    settings = {k: v for k, v in given.items() if v is not None}  # None: the engine's default
    largest_decode = max((b.size for b in plan if b.kind == "decode"), default=1)
    largest_prefill = max((b.size for b in plan if b.kind == "prefill"), default=0)
    settings["max_num_seqs"] = max(settings.get("max_num_seqs", 0), largest_decode, 8)
    settings["max_num_batched_tokens"] = max(settings.get("max_num_batched_tokens", 0), 512, largest_prefill)
    block_size = settings.get("block_size") or default_block_size(resolve_device(settings.get("device", "auto")))
    needed = max([b.blocks(block_size) for b in plan] + [64]) + 16
    settings.setdefault("num_gpu_blocks", needed)
    settings["enable_prefix_caching"] = False
    return settings


def _build(model: str, name: str, studied: list[Any], default_passes: bool, settings: dict[str, Any],
           dump_dir: Optional[Path]) -> tuple[Any, dict[str, Any]]:
    """One variant's engine, compiled cold; (LLM, its compile figures)."""
    from vgraph import LLM
    passes = list(studied) if name == WITH else [observe_post_grad_graph]
    fusion = default_passes and name == WITH
    start = time.perf_counter()
    llm = LLM(model, passes=passes, enable_fusion=fusion, use_cache=False,
              dump_graphs_dir=str(dump_dir) if dump_dir is not None else None, **settings)
    seconds = time.perf_counter() - start
    runner = llm.engine.runner
    c = runner.compile_counters
    logger.info("pass report: built %s in %.1f s", name, seconds)
    return llm, {"engine_build_s": seconds, "compile_and_warm_up_s": runner.startup.compile_seconds,
                 "dynamo_s": c.dynamo_seconds, "inductor_s": c.inductor_seconds,
                 "inductor_compilations": c.inductor_compilations, "pieces": c.pieces,
                 "compiled_pieces": c.compiled_pieces, "distinct_piece_graphs": c.unique_piece_graphs,
                 "engine_pass_matches": {k: v for k, v in c.pass_matches.items() if k != OBSERVER}}


def _numerics(llms: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Logits of the fixed batch and greedy tokens, "with" against "without"."""
    vocab = llms[WITHOUT].engine.vocab_size
    prompts = fixed_prompts(vocab)
    logits = {name: prompt_logits(llm, prompts) for name, llm in llms.items()}
    greedy = {name: greedy_tokens(llm, prompts, tokens) for name, llm in llms.items()}
    return {"prompts": prompts, "logits": logit_difference(logits[WITH], logits[WITHOUT]),
            "greedy": {**token_agreement(greedy[WITH], greedy[WITHOUT]), "tokens": tokens,
                       WITHOUT: greedy[WITHOUT], WITH: greedy[WITH]}}


def _assemble(model: str, llms: dict[str, Any], build: dict[str, Any], captures: dict[str, KernelCapture],
              studied: list[Any], default_passes: bool, settings: dict[str, Any], plan: list[Bucket],
              repeats: int, tokens: int, out_dir: Path) -> dict[str, Any]:
    manager, pieces = engine_records(llms[WITH])
    base_manager, _ = engine_records(llms[WITHOUT])
    pass_names = list(manager.match_counts()) if manager is not None else []
    rows = graph_rows(manager, pieces) if manager is not None else []
    write_diffs(rows, out_dir / "graphs" / WITH)
    baseline = graph_rows(base_manager, pieces, skip=())
    kernels = kernel_rows(pieces, {name: capture.summaries() for name, capture in captures.items()})
    runner = llms[WITH].engine.runner
    return {
        "model": model, "architecture": (getattr(runner.hf_config, "architectures", None) or ["?"])[0],
        "dtype": _dtype_name(runner.model.dtype), "device": str(runner.device),
        "config": {"passes_studied": [repr(p) for p in studied], "default_passes": default_passes,
                   "custom_ops": runner.config.compile.custom_ops,
                   "quantization": llms[WITH].engine.config.model.quantization,
                   "run_order": pass_names, "engine": {k: repr(v) for k, v in settings.items()},
                   "tokens": tokens, "repeats": repeats, "buckets": [b.name for b in plan],
                   "torch_num_threads": torch.get_num_threads(), "torch": torch.__version__},
        "compile": build,
        "pieces": {str(i): h for i, h in pieces.items()},
        "matches": {**match_totals(rows, pass_names),
                    "manager_match_counts": manager.match_counts() if manager is not None else {},
                    "engine_pass_matches": build[WITH]["engine_pass_matches"]},
        "graphs": rows,
        "baseline_graphs": [{"piece": r["piece"], "size": r["size"], "ops": r["ops"]} for r in baseline],
        "kernels": {"pieces": kernels, "totals": {WITHOUT: kernel_totals(kernels, WITHOUT),
                                                   WITH: kernel_totals(kernels, WITH)}},
        "dumps": {name: str(out_dir / "graphs" / name) for name in (WITHOUT, WITH)},
    }


def _with_speedups(times: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    for row in times.values():
        v = row["variants"]
        row["speedup"] = v[WITHOUT]["median_ms"] / v[WITH]["median_ms"]
    return times


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _free(llms: dict[str, Any]) -> None:
    llms.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
