"""Offline throughput: generated tokens/s of vgraph (eager, and compiled with torch.compile)
vs Hugging Face transformers ``generate`` on the same prompts and the same checkpoint, in one
process, on two workloads: decode-heavy (8 and 32 requests, prompts 16-512 tokens, 64-256 new
tokens each) and prefill-heavy (64 prompts of 16-256 tokens, 64 new tokens each, where the
prompt tokens outnumber the generated ones two to one).

Why this shape: the question users ask first is "is it faster than plain transformers?", and
that is only answerable when both systems see identical work (same weights, same prompts, same
number of generated tokens, EOS ignored) on the same machine at the same time. So the systems
run alternately (vgraph, HF, vgraph, HF, ...) and medians are reported, which spreads slow
drift and other processes' load over all of them alike. Greedy fp32 tokens are compared too: a
throughput number for a runtime that computes something else would mean nothing.

HF is run the way a careful user would: one left-padded batch with an attention mask
(``pad_token_id`` set), greedy, under ``torch.inference_mode``; smaller length-sorted batches are
reported as a sweep. EOS is disabled by clearing ``eos_token_id`` (not with ``min_new_tokens``,
which masks the EOS logit and so changes which token greedy picks; vgraph's ``ignore_eos`` does
not mask it).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

Tokens = list[list[int]]

PROMPT_SEED = 0
FIRST_REGULAR_ID = 6  # ids 0..5 are <s>, </s>, <pad> and the role tokens of the demo tokenizer
PAD_ID = 2
ROUNDS = 2
STATIC_COMPILE_BUDGET_S = 240.0  # "works on CPU within a few minutes", else recorded as skipped
TARGET_COMPILED_OVER_HF = 3.0  # compiled vgraph >= 3x transformers eager generate, every workload


@dataclass(frozen=True)
class Workload:
    """For each request count N, N prompts with lengths uniform in [min_len, max_len] and output
    lengths uniform in [min_out, max_out], from a fixed seed."""
    name: str
    request_counts: tuple[int, ...]
    min_len: int
    max_len: int
    min_out: int
    max_out: int
    seed: int = PROMPT_SEED
    hf_batch_sweep: tuple[int, ...] = ()


@dataclass(frozen=True)
class Requests:
    """One request count's prompts and the number of tokens each must generate."""
    prompts: Tokens
    output_lens: list[int]

    @property
    def generated_tokens(self) -> int:
        return sum(self.output_lens)


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [Workload("decode-heavy", request_counts=(8,), min_len=16, max_len=256, min_out=8, max_out=24),
                Workload("prefill-heavy", request_counts=(16,), min_len=16, max_len=256, min_out=8, max_out=8,
                         seed=1)]
    return [Workload("decode-heavy", request_counts=(8, 32), min_len=16, max_len=512, min_out=64, max_out=256,
                     hf_batch_sweep=(16, 8)),
            Workload("prefill-heavy", request_counts=(64,), min_len=16, max_len=256, min_out=64, max_out=64,
                     seed=1)]


def make_requests(w: Workload, n: int, vocab_size: int) -> Requests:
    """Random token ids (no special ids), prompt and output lengths drawn uniformly; the seed
    depends on the workload and n, so each level is its own fixed draw."""
    g = torch.Generator().manual_seed(w.seed * 1000 + n)
    lengths = torch.randint(w.min_len, w.max_len + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(FIRST_REGULAR_ID, vocab_size, (k,), generator=g).tolist() for k in lengths]
    return Requests(prompts, torch.randint(w.min_out, w.max_out + 1, (n,), generator=g).tolist())


# ----------------------------------------------------------------------------- vgraph


def kv_blocks_needed(r: Requests, block_size: int) -> int:
    """Blocks for every request at full length at once, so the run never preempts."""
    return sum(-(-(len(p) + n) // block_size) for p, n in zip(r.prompts, r.output_lens))


class VgraphSystem:
    """vgraph's runtime (fp32, CPU), eager (``enforce_eager=True``) or compiled (the default
    ``CompileConfig``: piecewise torch.compile and the fusion passes; for this unquantized model
    on CPU, norms and activations in plain torch for Inductor, ``custom_ops`` being unset). Prefix
    caching is off: the timed rounds repeat the same prompts, and cache hits on the second round
    would measure the cache, not the engine (transformers has no cross-call cache)."""

    def __init__(self, path: str, device: str, levels: list[Requests], compiled: bool = False) -> None:
        from vgraph import LLM, SamplingParams
        from vgraph.config import default_block_size

        # The KV block size and step token budget are the engine's defaults for the device, as
        # a user gets them (recorded below); the pool is sized for them.
        block_size = default_block_size(torch.device(device).type)
        self.config = {"dtype": "float32", "device": device, "enable_prefix_caching": False,
                       "max_num_seqs": max(len(r.prompts) for r in levels),
                       "num_gpu_blocks": max(kv_blocks_needed(r, block_size) for r in levels) + 16,
                       "enforce_eager": not compiled}
        start = time.perf_counter()
        self.llm = LLM(path, **self.config)
        self.build_s = time.perf_counter() - start  # includes the cold compile when compiled
        resolved = self.llm.engine.config
        self.config["block_size"] = resolved.cache.block_size
        self.config["max_num_batched_tokens"] = resolved.scheduler.max_num_batched_tokens
        counters = self.llm.engine.runner.compile_counters
        self.compile_counters = counters.as_dict() if counters is not None else None
        self._sampling = SamplingParams

    def generate(self, r: Requests) -> Tokens:
        params = [self._sampling(temperature=0.0, max_tokens=n, ignore_eos=True) for n in r.output_lens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in r.prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    @property
    def num_preemptions(self) -> int:
        return int(self.llm.engine.scheduler.num_preemptions)


# ----------------------------------------------------------------------------- transformers


def left_pad(prompts: Tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` for a left-padded batch (decoder-only generation
    continues from the last column, so padding must be on the left)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


class HFSystem:
    """transformers ``AutoModelForCausalLM.generate``: fp32 (or ``dtype``), greedy, EOS disabled.

    ``generate`` has one ``max_new_tokens`` per call, so a batch runs until its longest request
    is done and each row is cut to its own length afterwards: the steps spent past a row's
    length are the price of static batching, and they count as time, not as tokens."""

    def __init__(self, path: str, device: str, dtype: torch.dtype = torch.float32, random_weights: bool = False,
                 compile_mode: Optional[str] = "default") -> None:
        """``random_weights``: ``path`` holds a config.json only (a ``load_format="dummy"`` folder,
        perf/suites/decode.py), so the model is built from it with transformers' own random
        init, on the device (drawing an 8B model's weights on the host would take minutes).
        ``compile_mode``: the static-cache variant's ``torch.compile`` mode; None takes
        transformers' own CompileConfig, what a user gets on a GPU by asking for the static cache."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep the run's output to the timings
        if random_weights:
            with torch.device(device):  # .to() below: a no-op unless from_config built it elsewhere
                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
            self.model = self.model.to(device).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.compile_mode = compile_mode
        # generate() fills unset fields from model.generation_config (eos_token_id=1 here), so
        # EOS must be cleared there too, or passing eos_token_id=None would change nothing.
        self.model.generation_config.eos_token_id = None
        self.device = device
        self.static_compile = False

    def generation_config(self, max_new_tokens: int) -> Any:
        from transformers import GenerationConfig

        kw: dict[str, Any] = {}
        if self.static_compile:
            from transformers.generation.configuration_utils import CompileConfig

            if self.compile_mode is None:
                compile_config = CompileConfig()
            else:
                compile_config = CompileConfig(fullgraph=True, dynamic=False, mode=self.compile_mode)
            compile_config._compile_all_devices = True  # transformers auto-compiles on GPU only
            kw = {"cache_implementation": "static", "compile_config": compile_config}
        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=PAD_ID, bos_token_id=0, **kw)

    def resolved_eos(self) -> Any:
        """The eos_token_id generate() actually uses (private API; None if it moved)."""
        try:
            config, _ = self.model._prepare_generation_config(self.generation_config(1))
            return config.eos_token_id
        except Exception as exc:  # noqa: BLE001 - diagnostic only
            return f"unknown ({type(exc).__name__})"

    @torch.inference_mode()
    def generate_batch(self, prompts: Tokens, max_new_tokens: int) -> Tokens:
        ids, mask = left_pad(prompts)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  generation_config=self.generation_config(max_new_tokens))
        new = out[:, ids.shape[1]:]
        if new.shape[1] != max_new_tokens:
            raise RuntimeError(f"HF generated {new.shape[1]} tokens, expected {max_new_tokens}")
        return new.tolist()

    def generate(self, r: Requests, batch_size: Optional[int] = None) -> Tokens:
        """All requests in batches of ``batch_size`` (default: one batch), grouped by output
        length, then prompt length, so each batch wastes few steps and pads little; each row cut
        to its requested length; results in the original order."""
        batch_size = batch_size or len(r.prompts)
        order = sorted(range(len(r.prompts)), key=lambda i: (-r.output_lens[i], -len(r.prompts[i])))
        result: dict[int, list[int]] = {}
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            longest = max(r.output_lens[i] for i in chunk)
            for i, toks in zip(chunk, self.generate_batch([r.prompts[i] for i in chunk], longest)):
                result[i] = toks[:r.output_lens[i]]
        return [result[i] for i in range(len(r.prompts))]

    def generate_static(self, r: Requests) -> Tokens:
        """``generate`` with the static cache and transformers' compiled decode forward."""
        self.static_compile = True
        try:
            return self.generate(r)
        finally:
            self.static_compile = False


# ----------------------------------------------------------------------------- measurement


def timed(fn: Callable[[], Tokens]) -> tuple[float, Tokens]:
    t0 = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - t0, tokens


def check_lengths(tokens: Tokens, r: Requests, who: str) -> None:
    """Every request must yield exactly its output length, or tokens/s would not be comparable."""
    bad = [i for i, (t, n) in enumerate(zip(tokens, r.output_lens)) if len(t) != n]
    if bad:
        raise RuntimeError(f"{who}: requests {bad[:5]} did not generate their requested lengths")


def summary_of(samples: list[float], r: Requests) -> dict:
    median = statistics.median(samples)
    return {"samples_s": samples, "median_s": median, "tokens_per_s": r.generated_tokens / median}


def matching(a: Tokens, b: Tokens) -> int:
    return sum(x == y for x, y in zip(a, b))


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def try_static_compile(hf: HFSystem, r: Requests) -> dict:
    """Turns on HF's static cache + compiled decode forward and does the first (compiling) call.

    Returns {"enabled": True, ...} or {"enabled": False, "skipped": reason}; never raises, since
    a failing optional baseline must not lose the main comparison.
    """
    try:
        seconds, tokens = timed(lambda: hf.generate_static(r))
        check_lengths(tokens, r, "hf_static_compile")
    except Exception as exc:  # noqa: BLE001 - recorded, not hidden
        return {"enabled": False, "skipped": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}
    if not hasattr(hf.model, "_compiled_call"):
        return {"enabled": False, "skipped": "generate() did not compile the forward (no _compiled_call)"}
    if seconds > STATIC_COMPILE_BUDGET_S:
        return {"enabled": False, "skipped": f"first call took {seconds:.0f} s (> {STATIC_COMPILE_BUDGET_S:.0f} s budget)"}
    return {"enabled": True, "first_call_s": seconds}


def unpadded_oracle(hf: HFSystem, r: Requests, vg: Tokens, hf_tokens: Tokens) -> dict:
    """HF one prompt at a time (no padding at all) for the shortest and longest prompt and for
    up to 4 prompts where batched HF and vgraph disagree: the exact reference vgraph must equal."""
    prompts = r.prompts
    mismatched = [i for i in range(len(prompts)) if vg[i] != hf_tokens[i]]
    by_len = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    picked = sorted(set([by_len[0], by_len[-1]] + mismatched[:4]))
    rows = []
    for i in picked:
        ref = hf.generate_batch([prompts[i]], r.output_lens[i])[0]
        rows.append({"prompt": i, "prompt_len": len(prompts[i]), "vgraph_equals_unpadded_hf": vg[i] == ref,
                     "batched_hf_equals_unpadded_hf": hf_tokens[i] == ref,
                     "vgraph_first_divergence": first_divergence(vg[i], ref)})
    return {"checked": rows, "vgraph_matches": sum(row["vgraph_equals_unpadded_hf"] for row in rows)}


def warm_up(vgraphs: list[VgraphSystem], hf: HFSystem, r: Requests) -> None:
    """One short untimed call each, so one-time costs (allocator, thread pool) hit none."""
    short = Requests(r.prompts[:2], [4, 4])
    for vgraph in vgraphs:
        vgraph.generate(short)
    hf.generate(short)


def timed_rounds(systems: dict[str, Callable[[], Tokens]], r: Requests) -> tuple[dict[str, list[float]], dict[str, Tokens]]:
    """ROUNDS rounds, each running every system once in the same order (vgraph, vgraph_compiled,
    HF, ...)."""
    samples: dict[str, list[float]] = {name: [] for name in systems}
    tokens: dict[str, Tokens] = {}
    for _ in range(ROUNDS):
        for name, fn in systems.items():
            seconds, toks = timed(fn)
            check_lengths(toks, r, name)
            samples[name].append(seconds)
            tokens[name] = toks
            print(f"  {len(r.prompts)} requests, {name}: {seconds:.2f} s", flush=True)
    return samples, tokens


def hf_sweep(hf: HFSystem, r: Requests, vg: Tokens, sizes: tuple[int, ...]) -> list[dict]:
    """HF at smaller sorted batch sizes, one run each (less waste and padding, less parallelism)."""
    rows = []
    for bs in (b for b in sizes if b < len(r.prompts)):
        seconds, toks = timed(lambda: hf.generate(r, batch_size=bs))
        check_lengths(toks, r, f"hf_batch_{bs}")
        rows.append({"batch_size": bs, "seconds": seconds, "tokens_per_s": r.generated_tokens / seconds,
                     "prompts_matching_vgraph": matching(vg, toks)})
        print(f"  {len(r.prompts)} requests, hf batch {bs}: {seconds:.2f} s", flush=True)
    return rows


class Bench:
    """The systems under test, built once (vgraph sized for the largest level of any workload)."""

    def __init__(self, path: str, device: str, ws: list[Workload], quick: bool) -> None:
        self.hf = HFSystem(path, device)
        vocab = self.hf.model.config.vocab_size
        self.requests = {(w.name, n): make_requests(w, n, vocab) for w in ws for n in w.request_counts}
        levels = list(self.requests.values())
        self.vgraph = VgraphSystem(path, device, levels)
        self.compiled = VgraphSystem(path, device, levels, compiled=True)
        print(f"  vgraph_compiled built in {self.compiled.build_s:.1f} s (fresh vgraph cache)", flush=True)
        warm_up([self.vgraph, self.compiled], self.hf, levels[0])
        smallest = min(levels, key=lambda r: len(r.prompts))
        self.static = ({"enabled": False, "skipped": "--quick run (compile alone takes ~30-60 s on CPU)"}
                       if quick else try_static_compile(self.hf, smallest))

    def measure(self, r: Requests, w: Workload) -> dict:
        systems: dict[str, Callable[[], Tokens]] = {"vgraph": lambda: self.vgraph.generate(r),
                                                   "vgraph_compiled": lambda: self.compiled.generate(r),
                                                   "hf": lambda: self.hf.generate(r)}
        if self.static["enabled"]:
            systems["hf_static_compile"] = lambda: self.hf.generate_static(r)
        samples, tokens = timed_rounds(systems, r)
        sweep = hf_sweep(self.hf, r, tokens["vgraph"], w.hf_batch_sweep)
        oracle = unpadded_oracle(self.hf, r, tokens["vgraph"], tokens["hf"])
        return {"workload": w.name, **_level_result(r, samples, tokens, sweep, oracle)}


def run(device: str, quick: bool = False) -> dict:
    from vgraph.testing.checkpoints import build_perf_checkpoint

    from .compile import git_state
    ws = workloads(quick)
    load_before = os.getloadavg()  # other processes' load skews a 2-core machine: record it
    git = git_state()
    old_cache = os.environ.get("VGRAPH_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-offline-") as tmp:
        # A fresh compile cache: the compiled build is a cold compile, and the user's cache stays clean.
        os.environ["VGRAPH_CACHE_DIR"] = os.path.join(tmp, "vgraph-cache")
        try:
            bench = Bench(build_perf_checkpoint(os.path.join(tmp, "ckpt"), seed=0), device, ws, quick)
            levels = [bench.measure(bench.requests[(w.name, n)], w) for w in ws for n in w.request_counts]
        finally:
            if old_cache is None:
                os.environ.pop("VGRAPH_CACHE_DIR", None)
            else:
                os.environ["VGRAPH_CACHE_DIR"] = old_cache
    result = _result(ws, bench, levels)
    result["config"]["loadavg_before_after"] = [load_before, os.getloadavg()]
    result["config"]["git"] = git
    return result


def _level_result(r: Requests, samples: dict[str, list[float]], tokens: dict[str, Tokens],
                  sweep: list[dict], oracle: dict) -> dict:
    systems = {name: summary_of(s, r) for name, s in samples.items()}
    for name in systems:
        systems[name]["prompts_matching_vgraph"] = matching(tokens["vgraph"], tokens[name])
    base = systems["vgraph"]["tokens_per_s"]
    comp = systems["vgraph_compiled"]["tokens_per_s"]
    ratios = {f"vgraph/{name}": base / s["tokens_per_s"] for name, s in systems.items() if name != "vgraph"}
    ratios.update({f"vgraph_compiled/{name}": comp / s["tokens_per_s"]
                   for name, s in systems.items() if name not in ("vgraph", "vgraph_compiled")})
    if sweep:
        best = max(sweep + [{"batch_size": len(r.prompts), **systems["hf"]}], key=lambda x: x["tokens_per_s"])
        ratios["vgraph/hf_best_batch"] = base / best["tokens_per_s"]
        ratios["vgraph_compiled/hf_best_batch"] = comp / best["tokens_per_s"]
    return {"num_requests": len(r.prompts), "prompt_lengths": [len(p) for p in r.prompts],
            "output_lengths": r.output_lens, "total_prompt_tokens": sum(len(p) for p in r.prompts),
            "generated_tokens": r.generated_tokens,
            "hf_steps_run": _hf_steps(r), "systems": systems, "ratio": ratios, "hf_batch_sweep": sweep,
            "unpadded_hf_oracle": oracle}


def _hf_steps(r: Requests) -> int:
    """Tokens HF computes in one batch (every row runs to the longest output), for the record."""
    return len(r.prompts) * max(r.output_lens)


def _result(ws: list[Workload], bench: Bench, levels: list[dict]) -> dict:
    ratios = [lv["ratio"]["vgraph_compiled/hf"] for lv in levels]
    return {
        "suite": "offline",
        "config": {"workloads": [asdict(w) for w in ws], "rounds": ROUNDS, "torch_num_threads": torch.get_num_threads(),
                   "checkpoint": "build_perf_checkpoint(seed=0)",
                   "params": sum(p.numel() for p in bench.hf.model.parameters()),
                   "vgraph": bench.vgraph.config, "vgraph_preemptions": bench.vgraph.num_preemptions,
                   "vgraph_compiled": {**bench.compiled.config, "build_s_incl_compile": bench.compiled.build_s,
                                       "compile_counters": bench.compiled.compile_counters,
                                       "preemptions": bench.compiled.num_preemptions},
                   "hf": {"dtype": "float32", "do_sample": False, "padding": "left, attention_mask",
                          "eos_token_id_used": bench.hf.resolved_eos(),
                          "batching": "one batch of all requests, sorted by output then prompt length"},
                   "hf_static_compile": bench.static},
        "levels": levels,
        "target": {"vgraph_compiled/hf": TARGET_COMPILED_OVER_HF, "measured_per_level": ratios,
                   "measured": min(ratios), "met": min(ratios) >= TARGET_COMPILED_OVER_HF},
    }


def level_label(lv: dict) -> str:
    return f"{lv.get('workload', 'decode-heavy')}, {lv['num_requests']} requests"


def summarize(result: dict) -> str:
    cfg = result["config"]
    lines = [f"offline: {cfg['torch_num_threads']} threads, median of {cfg['rounds']}"]
    for w in cfg["workloads"]:
        lines.append(f"  {w['name']}: prompts {w['min_len']}-{w['max_len']} tokens, outputs {w['min_out']}-"
                     f"{w['max_out']} tokens, request counts {w['request_counts']}")
    for lv in result["levels"]:
        n = lv["num_requests"]
        lines += [f"{level_label(lv)} ({lv['total_prompt_tokens']} prompt tokens, {lv['generated_tokens']} to generate)",
                  f"  {'system':<22}{'wall s':>9}{'tok/s':>9}{'vgraph/x':>10}{'compiled/x':>12}{'match':>8}"]
        base = lv["systems"]["vgraph"]["tokens_per_s"]
        comp = lv["systems"]["vgraph_compiled"]["tokens_per_s"]
        rows = [(name, s["median_s"], s["tokens_per_s"], s["prompts_matching_vgraph"]) for name, s in lv["systems"].items()]
        rows += [(f"hf batch {x['batch_size']} (1 run)", x["seconds"], x["tokens_per_s"], x["prompts_matching_vgraph"])
                 for x in lv["hf_batch_sweep"]]
        for name, secs, tps, match in rows:
            lines.append(f"  {name:<22}{secs:>9.2f}{tps:>9.1f}{base / tps:>10.2f}{comp / tps:>12.2f}{match:>5}/{n}")
        oracle = lv["unpadded_hf_oracle"]
        lines.append(f"  unpadded HF oracle: vgraph equals it on {oracle['vgraph_matches']}/{len(oracle['checked'])} checked prompts")
    lines.append(f"vgraph_compiled built in {cfg['vgraph_compiled']['build_s_incl_compile']:.1f} s (fresh vgraph cache)")
    static = cfg["hf_static_compile"]
    lines.append(f"hf_static_compile: skipped ({static['skipped']})" if not static["enabled"]
                 else f"hf_static_compile: first call (compiling) {static['first_call_s']:.1f} s")
    t = result["target"]
    lines.append(f"target: vgraph compiled >= {t['vgraph_compiled/hf']:.0f}x hf generate at every level: "
                 f"{'met' if t['met'] else 'NOT met'} (" + ", ".join(f"{x:.2f}x" for x in t["measured_per_level"]) + ")")
    return "\n".join(lines)


def headline_figures(result: dict) -> dict[str, float]:
    """Per level: compiled vgraph's tokens/s and its ratio over transformers eager."""
    figures = {}
    for lv in result["levels"]:
        label = level_label(lv)
        figures[f"{label}: compiled tok/s"] = lv["systems"]["vgraph_compiled"]["tokens_per_s"]
        figures[f"{label}: hf tok/s"] = lv["systems"]["hf"]["tokens_per_s"]
        figures[f"{label}: compiled/hf"] = lv["ratio"]["vgraph_compiled/hf"]
    return figures


def plot(result: dict) -> Any:
    """Tokens/s per system at each level, with compiled vgraph's ratio over HF."""
    import matplotlib.pyplot as plt

    levels = result["levels"]
    names = list(levels[0]["systems"])
    fig, ax = plt.subplots(figsize=(8.5, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(levels))]
        ax.bar(xs, [lv["systems"][name]["tokens_per_s"] for lv in levels], width, label=name)
    for i, lv in enumerate(levels):
        top = max(s["tokens_per_s"] for s in lv["systems"].values())
        ax.annotate(f"compiled/hf {lv['ratio']['vgraph_compiled/hf']:.2f}x", (i, top), ha="center",
                    xytext=(0, 4), textcoords="offset points", fontsize=8)
    cfg, machine = result["config"], result.get("machine", {})
    ax.set_xticks(range(len(levels)), [level_label(lv) for lv in levels], fontsize=8)
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"offline throughput, {cfg['torch_num_threads']} threads ({machine.get('device', '?')}, "
                 f"{machine.get('date', '')[:10]})", fontsize=9)
    ax.legend(fontsize=8)
    return fig
