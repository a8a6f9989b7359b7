"""vgraph next to the CPU engines users pick today: OpenVINO GenAI, ONNX Runtime GenAI,
CTranslate2 and transformers (eager ``generate``; static cache + ``torch.compile``), on the same
checkpoint, fp32, greedy, EOS ignored, the same prompts fed as token ids.

Workload: 64 prompts, lengths uniform in 16..256 from a fixed seed (9,569 prompt tokens), 64 new
tokens each; two models: the ~24M perf Llama (``build_perf_checkpoint``) and a
Qwen2.5-0.5B-shaped random-weight Qwen2 (hidden 896, 24 layers, 14 heads / 2 KV heads, vocab
32k; 1.5 GB). ``--quick``: the 24M model, 16 prompts, 16 new tokens, one round.

How it is measured. Every engine runs in a process of its own (perf/peers/runner.py; the peers
in their own virtual environments, perf/peers/envs.py), one at a time, in interleaved rounds
(vgraph, vgraph eager, transformers, ..., then again) and medians are reported, so drift and
other processes' load spread over all. In each process: load (untimed, recorded), a short
untimed warm-up, a **prefill run** (``max_new_tokens=1``: every prompt processed, one token
sampled; prefill tok/s = prompt tokens / its seconds) and the **full run** (generated tok/s =
prompts x 64 / its seconds). **Decode** = full run minus prefill run, per round (the engines'
own timers are not comparable across engines); decode tok/s = prompts x 63 / that. Threads: the
headline is the default thread count (all cores; every engine told so explicitly where it has a
setting); ``python -m perf run cpu-peers --threads 1`` adds a 1-thread run to the same results
file (``OMP_NUM_THREADS`` for torch, ``INFERENCE_NUM_THREADS`` for OpenVINO, intra-op threads
for ONNX Runtime, ``intra_threads`` for CTranslate2); the previous run at the other thread count
is kept beside it.

Precision: every headline row computes in fp32. OpenVINO's CPU plugin defaults to bf16 compute
on CPUs with native bf16 (this one has avx512_bf16) and to a u8 KV cache
(``cpu_plugin_defaults`` in the results, read from the plugin); the headline row forces
``INFERENCE_PRECISION_HINT=f32``, ``KV_CACHE_PRECISION=f32`` and
``DYNAMIC_QUANTIZATION_GROUP_SIZE=0``, and ``openvino_genai_defaults`` runs the defaults as an
extra row that is *not* fp32 (its agreement shows it).

Agreement: each engine's tokens against transformers eager, position by position (tokens
equal / all generated), prompts fully equal, and the first token of the prefill run. What was
found where an engine fell short (details in perf/peers/):
- ONNX Runtime GenAI's builder takes any Linear with out_features == vocab size for the LM head;
  the 24M model has vocab == hidden == 512, so the stock export computes logits from inside the
  layer stack (1/256 tokens equal). The suite builds with that check corrected
  (perf/peers/ort_build.py); the logits then equal transformers to 1e-6. Its CPU attention also
  needs right-padded batches (left padding: 22/256 equal; right: 256/256), and its generator
  takes at most 32 sequences, so 64 prompts run as two batches, longest first.
- CTranslate2 4.8.5 does not apply Llama-3.1 ("llama3") RoPE scaling the way transformers does:
  its logits equal transformers *with the scaling removed* (0.0 difference over 12 positions), so
  on the 24M Llama (llama3 scaling, original context 64) every token after the first can drift.
  Nothing in the converted model fixes it (setting ``original_max_position_embeddings`` in the
  spec changed nothing); its rows on that model compute a slightly different model, said so in
  the results. The Qwen2 model uses plain RoPE. Its OpenMP threads also stall when another
  process shares the cores (a 2-core quick run: 130 prefill tok/s vs ONNX Runtime's 942).
- transformers itself, batched with left padding, is the reference; vgraph equals it on the
  offline suite's prompts. Random-weight models have near-tied logits, so one flipped argmax
  changes the rest of that prompt: the prefix agreement (mean fraction before the first
  difference) says how early engines part.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from ..peers import envs
from ..timing import RESULTS_DIR

Tokens = list[list[int]]

PROMPT_SEED = 0
FIRST_REGULAR_ID = 6  # ids 0..5: <s>, </s>, <pad> and the role tokens of the demo tokenizer
TOKENIZER_VOCAB = 512  # the demo tokenizer's size: prompts stay inside it for every model
PAD_ID = 2
RUN_TIMEOUT_S = 1800.0  # one engine process, seconds (VGRAPH_PERF_PEERS_TIMEOUT overrides)
REFERENCE = "transformers"
THREADS_1_BUILT_IN = True  # `--threads 1` is its own run, kept beside this one (perf/__main__.py)


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    min_len: int
    max_len: int
    max_new_tokens: int
    seed: int = PROMPT_SEED


def workload(quick: bool) -> Workload:
    return Workload(16, 16, 256, 16) if quick else Workload(64, 16, 256, 64)


def make_prompts(w: Workload) -> Tokens:
    """Token ids of regular (non-special) demo-tokenizer tokens; lengths uniform in
    [min_len, max_len]; fixed by the seed (Python's own generator, the same on every machine)."""
    rng = random.Random(w.seed)
    lengths = [rng.randint(w.min_len, w.max_len) for _ in range(w.num_prompts)]
    return [[rng.randrange(FIRST_REGULAR_ID, TOKENIZER_VOCAB) for _ in range(n)] for n in lengths]


@dataclass(frozen=True)
class System:
    """One row: which runner engine, in which environment (None: vgraph's own), with what."""
    name: str
    engine: str
    peer: Optional[str]
    options: dict = field(default_factory=dict)
    warmup: str = "short"
    fp32: bool = True
    note: str = ""


SYSTEMS: tuple[System, ...] = (
    System("vgraph", "vgraph", None, {"compiled": True}, note="offline LLM, compiled (the default)"),
    System("vgraph_eager", "vgraph", None, {"compiled": False}, note="offline LLM, enforce_eager"),
    System(REFERENCE, "hf", None, {}, note="generate, one left-padded batch"),
    System("transformers_static_compile", "hf", None, {"static": True}, warmup="full",
           note="generate, static cache + torch.compile'd decode step"),
    System("openvino_genai", "openvino", "openvino", {"precision": "f32"}, note="fp32 forced"),
    System("openvino_genai_defaults", "openvino", "openvino", {"precision": "default"}, fp32=False,
           note="CPU plugin defaults: bf16 compute, u8 KV cache (NOT fp32)"),
    System("onnxruntime_genai", "ortgenai", "ortgenai", {"pad_id": PAD_ID}, note="model builder -p fp32 -e cpu"),
    System("ctranslate2", "ctranslate2", "ctranslate2", {}, note="compute_type float32"),
)


@dataclass(frozen=True)
class Model:
    name: str
    description: str
    build: Callable[[str], str]
    rounds: int
    skip: dict = field(default_factory=dict)  # system name -> why it does not run on this model
    max_rounds: dict = field(default_factory=dict)  # system name -> fewer rounds than ``rounds``


def _build_llama(path: str) -> str:
    from vgraph.testing.checkpoints import build_perf_checkpoint
    return build_perf_checkpoint(path, seed=0)


def _build_qwen(path: str) -> str:
    from vgraph.models.demo import build_tiny_checkpoint
    return build_tiny_checkpoint(path, "qwen2", 0, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, intermediate_size=4864, vocab_size=32000,
                                 max_position_embeddings=4096, initializer_range=0.02)


MODELS: tuple[Model, ...] = (
    Model("llama-24m", "build_perf_checkpoint(seed=0): Llama, hidden 512, 8 layers, vocab 512, llama3 RoPE",
          _build_llama, rounds=3,
          # Its warm-up compiles both timed shapes (two untimed full runs): one round keeps the
          # suite's time in bounds; it is an extra row, not a contender.
          max_rounds={"transformers_static_compile": 1}),
    # Two rounds: one round of every engine takes ~13 min on the 2-core machine.
    Model("qwen2-0.5b-shape", "Qwen2, hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab 32000, "
          "random weights", _build_qwen, rounds=2,
          skip={"transformers_static_compile": "not run on this model (time: its compiled decode step "
                "recompiles per batch shape and it was slower than eager transformers on the 24M model)",
                "vgraph_eager": "not run on this model (time; the compiled default is the row that matters)"}),
)


# ----------------------------------------------------------------------------- pure parts


def agreement(tokens: Tokens, reference: Tokens, first_tokens: Optional[list[int]] = None) -> dict:
    """How far an engine's greedy tokens equal the reference's, prompt by prompt."""
    positions = sum(len(r) for r in reference)
    equal = sum(a == b for t, r in zip(tokens, reference) for a, b in zip(t, r))
    prefix = [_prefix_len(t, r) / len(r) for t, r in zip(tokens, reference) if r]
    out = {"token_agreement": equal / positions if positions else 1.0,
           "prompts_equal": sum(t == r for t, r in zip(tokens, reference)), "prompts": len(reference),
           "prefix_agreement": statistics.fmean(prefix) if prefix else 1.0}
    if first_tokens is not None:
        out["prefill_first_token_equal"] = sum(f == r[0] for f, r in zip(first_tokens, reference) if r)
    return out


def _prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def timing_summary(samples: list[dict], prompt_tokens: int, num_prompts: int, max_new_tokens: int) -> dict:
    """Medians over rounds and the tok/s they give (see the module docstring for the split)."""
    prefill = statistics.median(s["prefill_s"] for s in samples)
    total = statistics.median(s["total_s"] for s in samples)
    decode = statistics.median(s["total_s"] - s["prefill_s"] for s in samples)
    decode_tokens = num_prompts * (max_new_tokens - 1)
    return {"prefill_s": prefill, "total_s": total, "decode_s": decode,
            "tok_s": {"generated": num_prompts * max_new_tokens / total, "prefill": prompt_tokens / prefill,
                      "decode": decode_tokens / decode if decode > 0 else float("nan")}}


# ----------------------------------------------------------------------------- running


def run_timeout(system: str) -> float:
    """``VGRAPH_PERF_PEERS_TIMEOUT``: "600" (every engine process) or "600,ctranslate2=300"."""
    timeout = RUN_TIMEOUT_S
    for item in filter(None, os.environ.get("VGRAPH_PERF_PEERS_TIMEOUT", "").split(",")):
        name, _, value = item.rpartition("=")
        if name in ("", system):
            timeout = float(value)
    return timeout


def run_engine(system: System, python: str, model_dir: str, prompts: Tokens, w: Workload,
               threads: Optional[int], info: bool) -> dict:
    """One process of the runner for this system; raises RuntimeError with its stderr tail."""
    spec = {"engine": system.engine, "model_dir": model_dir, "options": system.options, "prompts": prompts,
            "max_new_tokens": w.max_new_tokens, "threads": threads, "warmup": system.warmup, "info": info}
    with tempfile.TemporaryDirectory(prefix="vgraph-peer-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        proc = subprocess.run([python, "-m", "perf.peers.runner", spec_path, out_path], cwd=envs.REPO,
                              capture_output=True, text=True, timeout=run_timeout(system.name))
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            raise RuntimeError(f"exit {proc.returncode}: " + " | ".join(lines[-4:])[-800:])
        with open(out_path) as f:
            return json.load(f)


def prepare(model: Model, systems: tuple[System, ...], peers: dict) -> tuple[str, dict[str, tuple[str, str]], dict]:
    """The checkpoint, and for each runnable system its (python, model dir); the others with why."""
    checkpoint = envs.ensure_checkpoint(model.name, model.build)
    ckpt_hash = envs.checkpoint_hash(checkpoint)
    ready: dict[str, tuple[str, str]] = {}
    skipped = dict(model.skip)
    for system in systems:
        if system.name in skipped:
            continue
        if system.peer is None:
            ready[system.name] = (sys.executable, checkpoint)
            continue
        state = peers.setdefault(system.peer, {})
        try:
            if "python" not in state and "unavailable" not in state:
                state["python"] = str(envs.ensure_venv(envs.PEERS[system.peer]))
                state["packages"] = list(envs.PEERS[system.peer].packages)
            if "unavailable" in state:
                raise envs.PeerUnavailable(state["unavailable"])
            converted, command = envs.ensure_converted(envs.PEERS[system.peer], checkpoint, ckpt_hash)
            state.setdefault("conversion", {})[model.name] = command
            ready[system.name] = (state["python"], converted)
        except envs.PeerUnavailable as exc:
            if "python" not in state:
                state["unavailable"] = str(exc)
            skipped[system.name] = str(exc)
            print(f"  {system.name}: skipped ({exc})", flush=True)
    return checkpoint, ready, skipped


def rounds_override(model: str) -> Optional[int]:
    """``VGRAPH_PERF_PEERS_ROUNDS``: "2" (every model) or "llama-24m=3,qwen2-0.5b-shape=1"."""
    spec = os.environ.get("VGRAPH_PERF_PEERS_ROUNDS", "").strip()
    if not spec:
        return None
    if "=" not in spec:
        return int(spec)
    pairs = dict(item.split("=", 1) for item in spec.split(","))
    return int(pairs[model]) if model in pairs else None


def saved_model_path(key: str, model: str, w: Workload) -> Any:
    """Where a finished model's result is kept, so a stopped run resumes after it
    (``VGRAPH_PERF_PEERS_RESUME=1``)."""
    tag = f"{key}-{model}-{w.num_prompts}x{w.min_len}-{w.max_len}+{w.max_new_tokens}-s{w.seed}"
    return envs.cache_root() / "runs" / f"{tag}.json"


def selected_systems() -> Optional[set[str]]:
    """``VGRAPH_PERF_PEERS_SYSTEMS=a,b``: measure only these rows (with ``VGRAPH_PERF_PEERS_RESUME=1``
    they replace the same rows of the kept result, e.g. after fixing one engine's run)."""
    names = os.environ.get("VGRAPH_PERF_PEERS_SYSTEMS", "").strip()
    if not names:
        return None
    wanted = set(names.split(","))
    unknown = wanted - {s.name for s in SYSTEMS}
    if unknown:
        raise ValueError(f"VGRAPH_PERF_PEERS_SYSTEMS: unknown systems {sorted(unknown)}")
    return wanted


def kept_result(key: str, model: str, w: Workload) -> Optional[dict]:
    saved = saved_model_path(key, model, w)
    if os.environ.get("VGRAPH_PERF_PEERS_RESUME") != "1" or not saved.is_file():
        return None
    kept = json.loads(saved.read_text())
    return kept["result"] if "result" in kept else kept


def measure_model(model: Model, w: Workload, threads: Optional[int], peers: dict, quick: bool) -> dict:
    """One model's result; kept in the cache (with transformers' tokens, the agreement reference)
    so that a stopped run resumes after it, and single rows can be re-measured into it."""
    saved = saved_model_path(run_key(threads), model.name, w)
    only = selected_systems()
    prior = json.loads(saved.read_text()) if os.environ.get("VGRAPH_PERF_PEERS_RESUME") == "1" and saved.is_file() else None
    if prior is not None and "result" not in prior:  # kept without its reference tokens
        prior = {"result": prior}
    if prior is not None and only is None:
        print(f"  {model.name}: reusing the finished result in {saved}", flush=True)
        return prior["result"]
    reference = prior.get("reference") if prior else None
    run_names = set(only or {s.name for s in SYSTEMS}) | ({REFERENCE} if reference is None else set())
    result, new_reference = _measure_model(model, w, threads, peers, quick,
                                           tuple(s for s in SYSTEMS if s.name in run_names), reference)
    if prior is not None:
        result = merge_rows(prior["result"], result, only or set())
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"result": result, "reference": reference or new_reference}))
    return result


def merge_rows(old: dict, new: dict, names: set[str]) -> dict:
    """``old`` with the rows ``names`` taken from ``new`` (re-measured separately: marked so)."""
    merged = {**old, "systems": dict(old["systems"]), "skipped": dict(old["skipped"]),
              "failures": dict(old.get("failures", {}))}
    for name in names:
        for part in ("skipped", "failures"):
            merged[part].pop(name, None)
            if name in new[part]:
                merged[part][name] = new[part][name]
        merged["systems"].pop(name, None)
        if name in new["systems"]:
            merged["systems"][name] = {**new["systems"][name], "measured_separately": True}
    order = [s.name for s in SYSTEMS]
    merged["systems"] = dict(sorted(merged["systems"].items(), key=lambda kv: order.index(kv[0])))
    merged["ratios"] = ratios(merged["systems"])
    return merged


def _measure_model(model: Model, w: Workload, threads: Optional[int], peers: dict, quick: bool,
                   systems: tuple[System, ...], reference: Optional[Tokens]) -> tuple[dict, Optional[Tokens]]:
    prompts = make_prompts(w)
    checkpoint, ready, skipped = prepare(model, systems, peers)
    rounds = 1 if quick else (rounds_override(model.name) or model.rounds)
    samples: dict[str, list[dict]] = {name: [] for name in ready}
    last: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for r in range(rounds):
        for system in systems:
            if system.name not in ready or system.name in failed or r >= model.max_rounds.get(system.name, rounds):
                continue
            python, model_dir = ready[system.name]
            try:
                out = run_engine(system, python, model_dir, prompts, w, threads, info=(r == 0))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failed[system.name] = f"failed in round {r + 1}: {exc}"
                print(f"  {model.name} {system.name}: FAILED ({exc})", flush=True)
                continue
            samples[system.name].append({k: out[k] for k in ("prefill_s", "total_s", "load_s")})
            if r == 0:
                last[system.name] = {"info": out["info"]}
            last[system.name].update(tokens=out["tokens"], first=out["prefill_first_tokens"])
            print(f"  {model.name} round {r + 1}/{rounds} {system.name}: prefill {out['prefill_s']:.2f} s, "
                  f"total {out['total_s']:.2f} s (load {out['load_s']:.1f} s)", flush=True)
    skipped.update({name: why for name, why in failed.items() if not samples[name]})
    failures = {name: why for name, why in failed.items() if samples[name]}
    reference = reference or last.get(REFERENCE, {}).get("tokens")
    return (model_result(model, checkpoint, prompts, w, rounds, samples, last, skipped, failures, reference),
            reference)


def model_result(model: Model, checkpoint: str, prompts: Tokens, w: Workload, rounds: int,
                 samples: dict[str, list[dict]], last: dict[str, dict], skipped: dict,
                 failures: Optional[dict] = None, reference: Optional[Tokens] = None) -> dict:
    """One model's rows: medians, tok/s, agreement with transformers; ``skipped``: systems that
    never ran (why); ``failures``: systems that failed after some rounds (their medians are over
    the rounds they finished)."""
    prompt_tokens = sum(len(p) for p in prompts)
    reference = reference or last.get(REFERENCE, {}).get("tokens")
    systems = {}
    for system in SYSTEMS:
        if not samples.get(system.name):
            continue
        row = {"note": system.note, "fp32": system.fp32, "samples": samples[system.name],
               **timing_summary(samples[system.name], prompt_tokens, len(prompts), w.max_new_tokens),
               "info": last[system.name]["info"]}
        if reference is not None:
            row["agreement_vs_transformers"] = agreement(last[system.name]["tokens"], reference,
                                                         last[system.name]["first"])
        systems[system.name] = row
    return {"model": model.name, "description": model.description, "checkpoint": checkpoint,
            "rounds": rounds, "prompt_tokens": prompt_tokens, "num_prompts": len(prompts),
            "generated_tokens": len(prompts) * w.max_new_tokens, "systems": systems,
            "ratios": ratios(systems), "skipped": skipped, "failures": failures or {}}


def ratios(systems: dict) -> dict:
    """vgraph's tok/s over each other row's, for generated / prefill / decode (> 1: vgraph faster)."""
    if "vgraph" not in systems:
        return {}
    base = systems["vgraph"]["tok_s"]
    return {name: {k: base[k] / s["tok_s"][k] for k in base} for name, s in systems.items() if name != "vgraph"}


def run_key(threads: Optional[int]) -> str:
    return "all_cores" if threads is None else f"{threads}_threads"


def previous_runs(quick: bool, current: str) -> dict:
    """The other thread counts' runs from the results file this run replaces (kept beside it)."""
    path = RESULTS_DIR / f"cpu-peers-cpu{'-quick' if quick else ''}.json"
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    return {k: {"machine": old.get("machine"), **v} if "machine" not in v else v
            for k, v in old.get("runs", {}).items() if k != current}


def run(device: str, quick: bool = False) -> dict:
    if device != "cpu":
        raise ValueError("cpu-peers compares CPU engines: run it with --device cpu")
    from .compile import git_state

    threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS") else None
    w = workload(quick)
    load_before, git = os.getloadavg(), git_state()
    peers: dict = {}
    models = [m for m in MODELS if not quick or m.name == "llama-24m"]
    wanted = os.environ.get("VGRAPH_PERF_PEERS_MODELS")
    start = time.perf_counter()
    results = {}
    for m in models:
        if not wanted or m.name in wanted.split(","):
            results[m.name] = measure_model(m, w, threads, peers, quick)
        elif (kept := kept_result(run_key(threads), m.name, w)) is not None:
            results[m.name] = kept  # not selected: the kept result stays in the file (RESUME=1)
    key = run_key(threads)
    runs = previous_runs(quick, key)
    runs[key] = {"threads": threads or os.cpu_count(), "threads_setting": "default (all cores)" if threads is None
                 else f"--threads {threads}", "models": results, "wall_s": time.perf_counter() - start,
                 "loadavg_before_after": [load_before, os.getloadavg()], "git": git}
    return {"suite": "cpu-peers", "headline": "all_cores",
            "config": {**asdict(w), "prompt_seed": PROMPT_SEED, "prompt_ids": f"uniform in [{FIRST_REGULAR_ID}, {TOKENIZER_VOCAB})",
                       "greedy": True, "ignore_eos": True, "dtype": "float32", "reference": REFERENCE,
                       "systems": {s.name: {"engine": s.engine, "options": s.options, "fp32": s.fp32, "note": s.note}
                                   for s in SYSTEMS},
                       "peers": {name: {k: v for k, v in st.items() if k != "python"} for name, st in peers.items()}},
            "runs": runs}


# ----------------------------------------------------------------------------- report


def summarize(result: dict) -> str:
    cfg = result["config"]
    lines = [f"cpu-peers: {cfg['num_prompts']} prompts of {cfg['min_len']}-{cfg['max_len']} tokens, "
             f"{cfg['max_new_tokens']} new each, fp32 greedy, EOS ignored; medians over rounds"]
    for key, run_ in result["runs"].items():
        lines.append(f"[{key}: {run_['threads_setting']}, {run_['threads']} threads]")
        for m in run_["models"].values():
            lines += _model_lines(m)
    return "\n".join(lines)


def _model_lines(m: dict) -> list[str]:
    lines = [f" {m['model']}: {m['prompt_tokens']} prompt tokens, {m['generated_tokens']} generated, "
             f"{m['rounds']} round(s)",
             f"  {'system':<36}{'prefill':>9}{'decode':>9}{'total':>9}  {'vgraph/x':>8}  {'agree':>6} {'prompts':>8}",
             f"  {'':<36}{'tok/s':>9}{'tok/s':>9}{'tok/s':>9}  {'(total)':>8}"]
    base = m["systems"].get("vgraph", {}).get("tok_s", {}).get("generated")
    for name, s in m["systems"].items():
        t, a = s["tok_s"], s.get("agreement_vs_transformers")
        ratio = f"{base / t['generated']:8.2f}" if base else f"{'-':>8}"
        agree = f"{a['token_agreement'] * 100:5.1f}% {a['prompts_equal']:>3}/{a['prompts']:<4}" if a else "-"
        label = name + ("" if s["fp32"] else " (not fp32)")
        if s.get("measured_separately"):  # re-measured into a kept result: its own rounds
            label += f" ({len(s['samples'])} rounds, later)"
        lines.append(f"  {label:<36}{t['prefill']:9.0f}{t['decode']:9.0f}{t['generated']:9.1f}  {ratio}  {agree}")
    lines += [f"  skipped {name}: {why}" for name, why in m["skipped"].items()]
    lines += [f"  {name} stopped early: {why}" for name, why in m.get("failures", {}).items()]
    return lines


def plot(result: dict) -> Any:
    """Generated, prefill and decode tok/s per engine, one group of bars per model, for the
    headline run (all cores); the non-fp32 row hatched."""
    import matplotlib.pyplot as plt

    run_ = result["runs"].get(result.get("headline", "all_cores")) or next(iter(result["runs"].values()))
    models = list(run_["models"].values())
    names = [s.name for s in SYSTEMS if any(s.name in m["systems"] for m in models)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    width = 0.8 / max(len(names), 1)
    for ax, metric in zip(axes, ("generated", "prefill", "decode")):
        for k, name in enumerate(names):
            xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(models))]
            ys = [m["systems"][name]["tok_s"][metric] if name in m["systems"] else 0 for m in models]
            fp32 = all(m["systems"].get(name, {}).get("fp32", True) for m in models)
            ax.bar(xs, ys, width, label=name if fp32 else name + " (not fp32)", hatch=None if fp32 else "//")
        ax.set_xticks(range(len(models)), [m["model"] for m in models])
        ax.set_yscale("log")
        ax.set_title(f"{metric} tok/s", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.subplots_adjust(bottom=0.25)
    machine = result.get("machine", {})
    fig.suptitle(f"cpu-peers, {run_['threads_setting']} ({run_['threads']} threads), fp32 greedy "
                 f"({machine.get('date', '')[:10]})", fontsize=10)
    return fig
