"""Decode: one decode step's latency per batch size (bucket) for each execution path, and the
memory bandwidth it achieves.

A decode step reads every weight once and each sequence's KV cache, and computes little, so
at small batches it is bound by memory bandwidth, or, when the GPU waits on the host, by
kernel launches: that gap is what CUDA graphs close. The step measured is the model part of
``ModelRunner.execute`` on a prepared pure-decode batch: dispatch, padding or the copy into
the persistent buffers, the forward, and the logits of every sequence (no sampling, no
scheduler), for batch sizes on and off the buckets. Every sequence has ``CONTEXT`` tokens.

Models (``SHAPES``): on CUDA a Qwen2.5-0.5B-shaped and a Llama-3-8B-shaped model in bf16 with
random weights (``load_format="dummy"``: config.json and a tokenizer only, no weight files;
weights' values do not change speed); on CPU the ~26M perf checkpoint
(``vgraph.testing.checkpoints.build_perf_checkpoint``) in fp32.

Systems, each an ``LLM``, timed interleaved (``perf.timing.time_variants``):

- **eager**: ``enforce_eager=True``;
- **compiled**: compiled, ``cudagraph_mode="none"``: the batch runs at its own size;
- CUDA only: **piecewise** (``cudagraph_mode="piecewise"``: the decode batch is padded to a
  token bucket and each compiled piece replays its graph, attention eager between them) and
  **full** (``cudagraph_mode="full"``: one graph of the whole forward per decode bucket);
- CPU only: **bucketed** (the default mode without CUDA: the batch is padded to its FULL
  bucket and the compiled forward runs at that size), which prices the padding.

Memory: all systems of a shape are built in one process and timed together when their
estimated footprint (weights + KV blocks for the largest batch + a reserve) fits in 85% of the
free device memory; otherwise eager stays resident and every other system is built, timed
interleaved with eager (one pair at a time) and freed. On an H200 (139 GiB) the 8B shape's four
systems need about 4 x (15 GiB weights + 8.5 GiB KV + 3 GiB reserve) = 106 GiB: together.

Bandwidth: bytes a step must move (weights read once, the embedding rows gathered when the
embedding is not tied to the lm_head, the sequences' KV read, the new KV written, the fp32
logits written) over its latency, against the device's nominal peak (a table by GPU name;
CUDA only) and a measured copy bandwidth.
"""
from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..timing import time_variants

CONTEXT = 256
BLOCK_SIZE = 16
# Bounds the persistent decode buffers. FULL graphs bake a split-KV count for max_model_len:
# small decode buckets (fewer programs than SMs) take the split kernel at this context, the
# others the unified kernel (vgraph/worker/batch.py, kv_splits).
MAX_MODEL_LEN = 1024
FIT_FRACTION = 0.85  # of free device memory, for building every system of a shape at once
RESERVE_BYTES = 3 << 30  # per LLM: activations, CUDA graph pools, workspaces, allocator slack

# The targets (CUDA): the 8B shape's FULL graph at batch 1 moves >= 80% of 4.8 TB/s
# (an H200's nominal bandwidth), and on the 0.5B shape FULL is >= 3x eager at batch 1.
TARGET_GBS, TARGET_FRACTION = 4800.0, 0.8
TARGET_FULL_OVER_EAGER = 3.0

# Nominal DRAM bandwidth by GPU name (first match wins: specific names before generic ones).
NOMINAL_PEAK_GBS: list[tuple[tuple[str, ...], str, float]] = [
    (("GH200",), "GH200 (96 GB HBM3)", 4000.0),
    (("H200",), "H200", 4800.0),
    (("H100", "NVL"), "H100 NVL", 3900.0),
    (("H100", "PCIE"), "H100 PCIe", 2000.0),
    (("H100",), "H100 SXM", 3350.0),
    (("A100", "80GB", "PCIE"), "A100 80GB PCIe", 1935.0),
    (("A100", "80GB"), "A100 80GB SXM", 2039.0),
    (("A100",), "A100 40GB", 1555.0),
    (("L40",), "L40/L40S", 864.0),
    (("L4",), "L4", 300.0),
]

# Model shapes: the transformers class and the config fields that set the work per step.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"class": "Qwen2ForCausalLM", "rope_theta": 1e6, "config": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False)},
    "llama3-8b": {"class": "LlamaForCausalLM", "rope_theta": 500000.0, "config": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=8192, rms_norm_eps=1e-5)},
}
CPU_SHAPE = "perf-26m"  # vgraph.testing.checkpoints.build_perf_checkpoint(seed=0), real random weights


def batch_sizes(device: str, quick: bool) -> list[int]:
    """Buckets and sizes between them (5 -> 8, 12 -> 16, 25 -> 32, 33 -> 40, 100 -> 104)."""
    if quick:
        return [1, 5, 8, 33] if device == "cpu" else [1, 8, 33, 64]
    if device == "cpu":
        return [1, 2, 4, 5, 8, 12, 16, 25, 32, 33, 64]
    return [1, 2, 4, 5, 8, 12, 16, 25, 32, 33, 64, 100, 128, 256]


def shapes_for(device: str) -> tuple[list[str], Optional[int]]:
    """The shapes to run and a layer-count override (None: the real one).

    ``PERF_DECODE_SHAPES`` (comma-separated names) and ``PERF_DECODE_LAYERS`` override them,
    e.g. to smoke-test the GPU shapes on CPU at 2 layers; both are recorded in the config.
    """
    names = os.environ.get("PERF_DECODE_SHAPES")
    layers = os.environ.get("PERF_DECODE_LAYERS")
    chosen = names.split(",") if names else (list(SHAPES) if device == "cuda" else [CPU_SHAPE])
    for name in chosen:
        if name not in SHAPES and name != CPU_SHAPE:
            raise ValueError(f"unknown decode shape {name!r}; choose from {', '.join([*SHAPES, CPU_SHAPE])}")
    return chosen, int(layers) if layers else None


def systems_for(device: str) -> dict[str, dict]:
    common = {"eager": {"enforce_eager": True}, "compiled": {"cudagraph_mode": "none"}}
    if device == "cuda":
        return {**common, "piecewise": {"cudagraph_mode": "piecewise"}, "full": {"cudagraph_mode": "full"}}
    return {**common, "bucketed": {"cudagraph_mode": "full_and_piecewise"}}


def shape_config(name: str, num_layers: Optional[int] = None) -> dict[str, Any]:
    cfg = dict(SHAPES[name]["config"])
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    return cfg


def write_model_dir(path: str | os.PathLike, name: str, num_layers: Optional[int] = None) -> str:
    """config.json (+ generation config and the demo tokenizer) of shape ``name``: what
    ``load_format="dummy"`` needs, and no weights."""
    import transformers

    from vgraph.models import demo

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    spec = SHAPES[name]
    tokenizer = demo.build_tokenizer()
    config_cls = getattr(transformers, spec["class"]).config_class
    config = config_cls(**shape_config(name, num_layers), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        **demo._rope_kwargs({"rope_type": "default", "rope_theta": spec["rope_theta"]}))
    config.architectures = [spec["class"]]
    config.save_pretrained(out)
    demo.save_tokenizer_files(out, tokenizer)
    return str(out)


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of a Llama/Qwen2 config (q/k/v biases for Qwen2), from the shape alone."""
    h, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    bias = (q + 2 * kv) if "use_sliding_window" in cfg else 0  # the Qwen2 shape has qkv biases
    layer = h * (q + 2 * kv) + bias + q * h + 3 * h * inter + 2 * h
    return vocab * h * (1 if cfg["tie_word_embeddings"] else 2) + layers * layer + h


def kv_bytes_per_token(cfg: dict[str, Any], elt: int) -> int:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * elt


def num_blocks(max_seqs: int) -> int:
    """KV blocks for max_seqs sequences of CONTEXT + 1 tokens on distinct blocks, plus slack."""
    return max_seqs * -(-(CONTEXT + 1) // BLOCK_SIZE) + 8


def estimate_llm_bytes(cfg: dict[str, Any], elt: int, max_seqs: int) -> int:
    """Device memory one LLM of this shape takes here: weights, KV pool, reserve."""
    return param_count(cfg) * elt + num_blocks(max_seqs) * BLOCK_SIZE * kv_bytes_per_token(cfg, elt) + RESERVE_BYTES


def plan_groups(systems: list[str], per_llm_bytes: int, free_bytes: Optional[int]) -> list[list[str]]:
    """Which systems live (and are timed) together: all at once when they fit in
    FIT_FRACTION of free memory (or memory is not tracked: CPU), else eager with each other
    system in turn (eager stays resident; the other is freed after its pair)."""
    if free_bytes is None or len(systems) * per_llm_bytes <= FIT_FRACTION * free_bytes:
        return [list(systems)]
    if 2 * per_llm_bytes > FIT_FRACTION * free_bytes:
        raise RuntimeError(f"two LLMs of {per_llm_bytes / 2**30:.1f} GiB each do not fit in "
                           f"{FIT_FRACTION:.0%} of {free_bytes / 2**30:.1f} GiB free")
    return [["eager", s] for s in systems if s != "eager"]


def build_llm(path: str, device: str, max_seqs: int, options: dict, dummy: bool) -> tuple[Any, float]:
    """An LLM sized for ``max_seqs`` sequences of CONTEXT + 1 tokens. ``options``: enforce_eager,
    cudagraph_mode, and for the e2e suite async_scheduling (None: the engine's default) and
    max_num_batched_tokens (default max(2048, max_seqs): a decode batch in one step)."""
    from vgraph import LLM
    from vgraph.config import CompileConfig
    eager = options.get("enforce_eager", False)
    config = CompileConfig(cudagraph_mode=options.get("cudagraph_mode"))
    start = time.perf_counter()
    llm = LLM(path, dtype="bfloat16" if device == "cuda" else "float32", device=device, max_num_seqs=max_seqs,
              max_num_batched_tokens=options.get("max_num_batched_tokens", max(2048, max_seqs)),
              block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks(max_seqs),
              max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, enforce_eager=eager,
              compile_config=config, load_format="dummy" if dummy else "auto",
              async_scheduling=options.get("async_scheduling"))
    if device == "cuda":
        torch.cuda.synchronize()
    return llm, time.perf_counter() - start


@torch.inference_mode()
def decode_batch(runner: Any, n: int, seed: int = 0) -> Any:
    """A pure-decode step of n sequences of CONTEXT tokens over distinct blocks, built by the
    runner's own batch builder on its dispatcher's path: (batch, decision)."""
    from vgraph.worker.dummy import dummy_decode
    first = int(torch.randint(6, runner.vocab_size - n, (1,), generator=torch.Generator().manual_seed(seed)))
    return runner.graphs.build(dummy_decode(n, CONTEXT, BLOCK_SIZE, runner.num_blocks, first))


def step_fn(runner: Any, built: Any) -> Callable[[], object]:
    batch, decision = built

    @torch.inference_mode()
    def step() -> object:
        return runner.model.compute_logits(runner.graphs.run(batch, decision))
    return step


def bytes_per_step(model: torch.nn.Module, n: int, context: int = CONTEXT) -> int:
    """Bytes a decode step of n sequences must move: every weight read once (the lm_head
    counted once when tied; an untied embedding table contributes only the n rows gathered),
    n sequences' KV read (context + the new token), n new KV rows written, fp32 logits written."""
    params = {id(p): p for p in model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        weights -= embed.numel() * embed.element_size()
        weights += n * embed.shape[1] * embed.element_size()
    elt = torch.empty((), dtype=model.dtype).element_size()
    kv_row = 2 * model.num_layers * model.num_kv_heads * model.head_dim * elt
    return int(weights + n * (context + 1) * kv_row + n * kv_row + n * model.vocab_size * 4)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied lm_head counted once): what a decode step
    must read at least once, the floor the issue's copy-bandwidth fractions are taken against."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def copy_bandwidth_gbs(device: str) -> float:
    """Device memory bandwidth as a large copy achieves it (read + write), GB/s."""
    mib = 1024 if device == "cuda" else 256  # far beyond any cache
    src = torch.empty(mib << 18, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    timed = time_variants({"copy": lambda: dst.copy_(src)}, device, reps=7, target_seconds=0.05)
    return 2 * src.numel() * 4 / timed["copy"]["median_s"] / 1e9


def nominal_peak(device: str) -> tuple[Optional[float], Optional[str]]:
    """(GB/s, table entry) for the GPU by name; (None, None) on CPU or an unknown GPU."""
    return lookup_nominal(torch.cuda.get_device_name()) if device == "cuda" else (None, None)


def lookup_nominal(gpu_name: str) -> tuple[Optional[float], Optional[str]]:
    name = gpu_name.upper()
    for keys, label, gbs in NOMINAL_PEAK_GBS:
        if all(k.upper() in name for k in keys):
            return gbs, label
    return None, None


def measure(llms: dict[str, Any], device: str, sizes: list[int], peaks: dict[str, Optional[float]],
            reps: int) -> list[dict]:
    """Rows per batch size: each system's median step latency and bandwidth, timed interleaved."""
    rows = []
    model = next(iter(llms.values())).engine.runner.model
    for n in sizes:
        runners = {name: llm.engine.runner for name, llm in llms.items()}
        batches = {name: decode_batch(r, n) for name, r in runners.items()}
        timed = time_variants({name: step_fn(runners[name], batches[name]) for name in llms}, device, reps=reps)
        moved = bytes_per_step(model, n)
        row = {"batch": n, "bytes_per_step": moved, "systems": {}}
        for name, r in runners.items():
            decision = batches[name][1]
            s = timed[name]["median_s"]
            gbs = moved / s / 1e9
            row["systems"][name] = {
                "path": decision.path.value, "bucket": decision.bucket, "latency_ms": s * 1e3,
                "achieved_gbs": gbs, "util_copy": gbs / peaks["copy"],
                "util_nominal": gbs / peaks["nominal"] if peaks["nominal"] else None,
                "samples_ms": [x * 1e3 for x in timed[name]["samples_s"]]}
        eager = row["systems"]["eager"]["latency_ms"]
        for s in row["systems"].values():
            s["speedup_vs_eager"] = eager / s["latency_ms"]
        rows.append(row)
        print(f"  batch {n}: " + ", ".join(f"{k} {v['latency_ms']:.3f} ms" for k, v in row["systems"].items()),
              flush=True)
    return rows


def _free(llms: dict[str, Any], device: str) -> None:
    """Drops the LLMs (the caller holds no other reference) and returns their memory."""
    llms.clear()
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _gib(num_bytes: float) -> float:
    return num_bytes / 2**30


def _merge(groups: list[list[dict]]) -> list[dict]:
    """One row per batch from several groups' rows: eager from the first group; every other
    system with its speedup against the eager it was timed with (``paired_eager_ms``)."""
    merged = []
    for parts in zip(*groups):
        row = {"batch": parts[0]["batch"], "bytes_per_step": parts[0]["bytes_per_step"],
               "systems": {"eager": parts[0]["systems"]["eager"]}}
        for part in parts:
            for name, s in part["systems"].items():
                if name != "eager":
                    row["systems"][name] = {**s, "paired_eager_ms": part["systems"]["eager"]["latency_ms"]}
        merged.append(row)
    return merged


def run_shape(name: str, device: str, sizes: list[int], reps: int, peaks: dict, tmp: str,
              layers: Optional[int] = None, systems: Optional[dict[str, dict]] = None,
              force_pairs: bool = False) -> dict:
    """Builds the shape's systems (together, or eager + one other at a time) and measures them."""
    from vgraph.testing.checkpoints import build_perf_checkpoint
    systems = systems or systems_for(device)
    dummy = name != CPU_SHAPE
    path = (write_model_dir(os.path.join(tmp, name), name, layers) if dummy
            else build_perf_checkpoint(os.path.join(tmp, name), seed=0))
    elt = 2 if device == "cuda" else 4
    info: dict[str, Any] = {"load_format": "dummy" if dummy else "auto", "path_kind": "config + tokenizer only"
                            if dummy else "safetensors checkpoint"}
    free = None
    if dummy:
        cfg = shape_config(name, layers)
        info.update(config=cfg, params_estimate=param_count(cfg),
                    estimate_per_llm_gib=_gib(estimate_llm_bytes(cfg, elt, max(sizes))))
        if device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            free, total = torch.cuda.mem_get_info()
            info.update(free_gib_before=_gib(free), total_gib=_gib(total))
    groups = plan_groups(list(systems), estimate_llm_bytes(cfg, elt, max(sizes)) if dummy else 0, free)
    if force_pairs:
        groups = [["eager", s] for s in systems if s != "eager"]
    info["groups"] = groups
    print(f"{name}: systems in groups {groups}", flush=True)
    built: dict[str, Any] = {}
    build_s: dict[str, float] = {}
    allocated: dict[str, float] = {}
    graphs: dict[str, dict] = {}
    group_rows: list[list[dict]] = []
    for group in groups:
        for sys_name in group:
            if sys_name in built:
                continue
            before = torch.cuda.memory_allocated() if device == "cuda" else 0
            built[sys_name], build_s[sys_name] = build_llm(path, device, max(sizes), systems[sys_name], dummy)
            if device == "cuda":
                allocated[sys_name] = _gib(torch.cuda.memory_allocated() - before)
            graphs[sys_name] = vars(built[sys_name].engine.runner.startup.capture)
            print(f"  built {sys_name} in {build_s[sys_name]:.1f} s", flush=True)
        model = built["eager"].engine.runner.model
        info.setdefault("params", sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))
        info.setdefault("weights_bytes", weights_bytes(model))
        del model
        group_rows.append(measure({s: built[s] for s in group}, device, sizes, peaks, reps))
        if len(groups) > 1:  # pairs: free the non-eager system before building the next
            done = {s: built.pop(s) for s in group if s != "eager"}
            _free(done, device)
            torch._dynamo.reset()  # only eager (never compiled) stays resident
    memory: dict[str, Any] = {}
    if device == "cuda":
        memory = {"allocated_by_build_gib": allocated, "peak_allocated_gib": _gib(torch.cuda.max_memory_allocated())}
    _free(built, device)
    torch._dynamo.reset()
    if device == "cuda":
        memory["allocated_after_free_gib"] = _gib(torch.cuda.memory_allocated())
    rows = group_rows[0] if len(group_rows) == 1 else _merge(group_rows)
    return {"model": info, "build_s": build_s, "graphs": graphs, "memory": memory, "rows": rows}


def targets(device: str, shapes: dict[str, dict], reduced: bool = False) -> dict:
    """The issue's targets on CUDA (met / measured; not measured when the layer count was
    overridden); on CPU the speedup over eager per batch (no target)."""
    if device != "cuda":
        out = {}
        for name, shape in shapes.items():
            out[name] = {"note": "CPU: no target; speedup vs eager (eager latency / system latency) per batch",
                         **{s: {str(r["batch"]): r["systems"][s]["speedup_vs_eager"] for r in shape["rows"]}
                            for s in shape["rows"][0]["systems"] if s != "eager"}}
        return out

    def batch1(shape: str) -> Optional[dict]:
        rows = shapes.get(shape, {}).get("rows", [])
        return next((r for r in rows if r["batch"] == 1), None)

    out: dict[str, Any] = {}
    row = batch1("llama3-8b")
    key = f"llama3-8b full graph, batch 1: >= {TARGET_FRACTION:.0%} of {TARGET_GBS / 1000:.1f} TB/s"
    if row and "full" in row["systems"] and not reduced:
        gbs = row["systems"]["full"]["achieved_gbs"]
        out[key] = {"achieved_gbs": gbs, "fraction_of_4.8_tbs": gbs / TARGET_GBS,
                    "required": TARGET_FRACTION, "met": gbs / TARGET_GBS >= TARGET_FRACTION}
    else:
        out[key] = {"met": None, "note": "not measured (shape or system not run, or layers overridden)"}
    row = batch1("qwen2.5-0.5b")
    key = f"qwen2.5-0.5b full / eager, batch 1: >= {TARGET_FULL_OVER_EAGER:.0f}x"
    if row and "full" in row["systems"] and not reduced:
        ratio = row["systems"]["full"]["speedup_vs_eager"]
        out[key] = {"measured": ratio, "required": TARGET_FULL_OVER_EAGER, "met": ratio >= TARGET_FULL_OVER_EAGER}
    else:
        out[key] = {"met": None, "note": "not measured (shape or system not run, or layers overridden)"}
    return out


def run(device: str, quick: bool = False) -> dict:
    from .compile import git_state
    sizes = batch_sizes(device, quick)
    names, layers = shapes_for(device)
    old_cache = os.environ.get("VGRAPH_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-decode-") as tmp:
        os.environ["VGRAPH_CACHE_DIR"] = os.path.join(tmp, "vgraph-cache")
        try:
            nominal, nominal_name = nominal_peak(device)
            peaks = {"copy": copy_bandwidth_gbs(device), "nominal": nominal}
            shapes = {name: run_shape(name, device, sizes, 5 if quick else 11, peaks, tmp, layers) for name in names}
        finally:
            if old_cache is None:
                os.environ.pop("VGRAPH_CACHE_DIR", None)
            else:
                os.environ["VGRAPH_CACHE_DIR"] = old_cache
    return {"suite": "decode",
            "config": {"device": device, "context": CONTEXT, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
                       "sizes": sizes, "dtype": "bfloat16" if device == "cuda" else "float32",
                       "shapes": names, "layers_override": layers, "systems": systems_for(device),
                       "git": git_state(), "loadavg": os.getloadavg()},
            "bandwidth": {"nominal_gbs": nominal, "nominal_entry": nominal_name, "copy_gbs": peaks["copy"]},
            "shapes": shapes, "target": targets(device, shapes, reduced=layers is not None)}


def _util(s: dict) -> float:
    return s["util_nominal"] if s.get("util_nominal") is not None else s["util_copy"]


def headline_figures(result: dict) -> dict[str, float]:
    """Step latency (ms) of every system at every batch size, per model shape."""
    return {f"{shape_name} batch {row['batch']} {name} ms": system["latency_ms"]
            for shape_name, shape in result["shapes"].items() for row in shape["rows"]
            for name, system in row["systems"].items()}


def summarize(result: dict) -> str:
    cfg, bw = result["config"], result["bandwidth"]
    peak = (f"nominal peak {bw['nominal_gbs']:.0f} GB/s ({bw['nominal_entry']}), " if bw["nominal_gbs"] else "")
    basis = "nominal peak" if bw["nominal_gbs"] else "copy bandwidth"
    lines = [f"decode step (forward + logits), context {cfg['context']}, {cfg['dtype']}, {cfg['device']}; "
             f"{peak}copy bandwidth {bw['copy_gbs']:.1f} GB/s; latency ms (bandwidth utilisation vs {basis})"]
    for shape_name, shape in result["shapes"].items():
        info, rows = shape["model"], shape["rows"]
        names = list(rows[0]["systems"])
        layers = f", {cfg['layers_override']} layers" if cfg.get("layers_override") else ""
        lines.append(f"== {shape_name}{layers}: {info['params'] / 1e6:.0f}M params, "
                     f"{info['weights_bytes'] / 2**30:.2f} GiB weights ({info['load_format']} load); "
                     f"groups {info['groups']}")
        lines.append(f"{'batch':>5} {'bucket':>6} " + "".join(f"{n:>20}" for n in names))
        for row in rows:
            buckets = {s["bucket"] for s in row["systems"].values() if s["path"] != "none"}
            bucket = str(max(buckets)) if buckets else "-"
            cells = "".join(f"{s['latency_ms']:>11.3f} ({_util(s) * 100:>5.1f}%)" for s in row["systems"].values())
            lines.append(f"{row['batch']:>5} {bucket:>6} {cells}")
        for name in names[1:]:
            speedups = [row["systems"][name]["speedup_vs_eager"] for row in rows]
            lines.append(f"{name}: speedup vs eager median {statistics.median(speedups):.2f}x "
                         f"(batch {rows[0]['batch']}: {speedups[0]:.2f}x, batch {rows[-1]['batch']}: {speedups[-1]:.2f}x)")
        first = rows[0]
        lines.append(f"batch {first['batch']}: {first['bytes_per_step'] / 1e9:.3f} GB per step; achieved "
                     + ", ".join(f"{k} {v['achieved_gbs']:.0f} GB/s ("
                                 + (f"{v['util_nominal'] * 100:.0f}% nominal, " if v.get("util_nominal") is not None else "")
                                 + f"{v['util_copy'] * 100:.0f}% copy)" for k, v in first["systems"].items()))
        for name, g in shape["graphs"].items():
            if g["full_graphs"] or g["piecewise_graphs"]:
                lines.append(f"{name}: {g['full_graphs']} FULL + {g['piecewise_graphs']} PIECEWISE graphs, "
                             f"captured in {g['seconds']:.2f} s, {g['memory_bytes'] / 2**20:.1f} MiB")
        mem = shape.get("memory") or {}
        if mem:
            lines.append(f"memory: peak allocated {mem['peak_allocated_gib']:.1f} GiB; per build "
                         + ", ".join(f"{k} {v:.1f}" for k, v in mem["allocated_by_build_gib"].items())
                         + f" GiB; after free {mem['allocated_after_free_gib']:.2f} GiB")
    for key, t in result["target"].items():
        if "met" in t:
            shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items() if k != "met"}
            lines.append(f"target {key}: {'MET' if t['met'] else 'not met' if t['met'] is False else 'n/a'} {shown}")
        else:
            for system, per_batch in t.items():
                if system != "note":
                    lines.append(f"{key} {system}/eager per batch: "
                                 + ", ".join(f"{b}: {v:.2f}x" for b, v in per_batch.items()))
    return "\n".join(lines)


def plot(result: dict):
    """Per shape: latency vs batch per system (log-log), and bandwidth utilisation vs the
    nominal peak (CUDA) or speedup vs eager (CPU)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    cuda = result["config"]["device"] == "cuda"
    shapes = result["shapes"]
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 4.2 * len(shapes)), squeeze=False)
    for i, (shape_name, shape) in enumerate(shapes.items()):
        rows = shape["rows"]
        batches = [r["batch"] for r in rows]
        names = list(rows[0]["systems"])
        color = {name: f"C{j}" for j, name in enumerate(names)}
        lat, right = axes[i]
        for name in names:
            lat.plot(batches, [r["systems"][name]["latency_ms"] for r in rows], marker="o", label=name,
                     color=color[name])
        lat.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="decode step latency (ms)",
                title=f"{shape_name}: step latency ({result['config']['dtype']}, context {result['config']['context']})")
        lat.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        lat.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "235" else ""))
        lat.tick_params(axis="y", which="minor", labelsize=7)
        lat.set_xticks(batches, [str(b) for b in batches], fontsize=7, rotation=60)
        lat.grid(True, which="both", alpha=0.3)
        lat.legend(fontsize=8)
        if cuda:
            for name in names:
                right.plot(batches, [_util(r["systems"][name]) * 100 for r in rows], marker="o", label=name,
                           color=color[name])
            bw = result["bandwidth"]
            basis = f"nominal {bw['nominal_gbs']:.0f} GB/s" if bw["nominal_gbs"] else f"copy {bw['copy_gbs']:.0f} GB/s"
            right.set(ylabel=f"bandwidth utilisation (% of {basis})", title=f"{shape_name}: memory bandwidth")
            if bw["nominal_gbs"]:  # the same numbers against the measured copy bandwidth
                k = bw["nominal_gbs"] / bw["copy_gbs"]
                right.secondary_yaxis("right", functions=(lambda p, k=k: p * k, lambda p, k=k: p / k)).set_ylabel(
                    f"% of measured copy bandwidth ({bw['copy_gbs']:.0f} GB/s)")
            if shape_name == "llama3-8b":
                right.axhline(TARGET_FRACTION * TARGET_GBS / (bw["nominal_gbs"] or bw["copy_gbs"]) * 100,
                              color="gray", ls="--", lw=1, label="target (80% of 4.8 TB/s)")
        else:
            for name in names[1:]:
                right.plot(batches, [r["systems"][name]["speedup_vs_eager"] for r in rows], marker="o", label=name,
                           color=color[name])
            right.axhline(1.0, color=color["eager"], ls="--", lw=1, label="eager")
            right.set(ylabel="speedup vs eager (x)", title=f"{shape_name}: speedup vs eager")
        right.set(xscale="log", xlabel="batch (sequences)")
        right.set_xticks(batches, [str(b) for b in batches], fontsize=7, rotation=60)
        right.grid(True, which="both", alpha=0.3)
        right.legend(fontsize=8)
    machine = result.get("machine", {})
    fig.suptitle(f"decode suite, {machine.get('gpu') or machine.get('platform', '')} "
                 f"({machine.get('date', '')[:10]})", fontsize=10)
    fig.tight_layout()
    return fig
