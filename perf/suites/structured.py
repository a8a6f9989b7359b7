"""Structured outputs: what constrained decoding costs per engine step, next to an unconstrained
step, and what compiling a grammar costs.

Model: a ~58M-parameter Llama shape (hidden 512, 8 layers, GQA) with a 32,000-token byte-level
BPE vocabulary trained here on the Python standard library's sources, so the token masks are
as wide as a real model's (mask work scales with the vocabulary; the tests' 512-token
tokenizer would flatter it). Random weights, fp32, eager, on the device asked for.

Per batch size (1, 8, 32) and mode (``free``: no row constrained; ``half``; ``all``), one
``LLMEngine`` run: every row decodes greedily; constrained rows follow a JSON schema (an array
of exactly ``ITEMS`` small objects: a bounded integer and an enum each), free rows ignore EOS
for ``FREE_TOKENS`` tokens. The step time is the wall time of ``LLMEngine.step()`` (schedule,
mask fill, forward, mask apply + sample, matcher advance, detokenize) over the decode steps in
which all rows run, median per run, then median over the rounds (modes interleaved). Beside it:
the mask fill (llguidance, all constrained rows) and the mask apply (one batched op) timed
alone on the same states, and the grammar compile times (cold: a fresh compiler; cached).

Validity: every constrained request of the suite must finish with "stop" and validate against
the schema (``jsonschema``); the rate is reported and must be 100%.
"""
from __future__ import annotations

import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

VOCAB = 32000
ITEMS = 6
FREE_TOKENS = 48
SIZES = (1, 8, 32)
MODES = ("free", "half", "all")
ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "tag": {"enum": ["alpha", "beta", "gamma", "delta"]}},
        "required": ["id", "tag"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": ITEMS, "maxItems": ITEMS}
PROMPT_LEN = 16


def _train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE over the standard library's .py files (sorted, first ~4 MB)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        files.append(str(path))
        size += path.stat().st_size
        if size > 4 * 2**20:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_checkpoint(path: str) -> str:
    from vgraph.models.demo import random_model, save_tokenizer_files

    tokenizer = _train_tokenizer(VOCAB)
    model = random_model("llama", tokenizer, 0, dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1408, max_position_embeddings=4096, initializer_range=0.02))
    model.save_pretrained(path)
    save_tokenizer_files(Path(path), tokenizer)
    return path


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def run_batch(engine: Any, size: int, mode: str, seed: int) -> tuple[float, list[str]]:
    """One engine run; (median ms of the steps with every row decoding, constrained outputs)."""
    from vgraph import SamplingParams
    from vgraph.engine.output_processor import OutputProcessor
    from vgraph.structured import StructuredOutputsParams

    outputs = OutputProcessor(engine.tokenizer)  # the text, as every caller of the engine builds it
    constrained = {"free": 0, "half": size // 2, "all": size}[mode]
    spec = StructuredOutputsParams(json=SCHEMA)
    for i, prompt in enumerate(_prompts(size, engine.vocab_size, seed)):
        if i < constrained:
            params = SamplingParams(temperature=0.0, max_tokens=400, structured_outputs=spec)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=FREE_TOKENS, ignore_eos=True)
        engine.add_request(f"{mode}-{size}-{i}", {"prompt_token_ids": prompt}, params)
        outputs.add(f"{mode}-{size}-{i}", None, prompt, params)
    times, texts, first = [], [], True
    while engine.has_unfinished_requests():
        full = engine.scheduler.num_running == size and not engine.scheduler.num_waiting
        start = time.perf_counter()
        done, finishes = outputs.process(engine.step().deltas)  # the step and its outputs' share
        elapsed = time.perf_counter() - start
        engine.finish_sequences(finishes)
        if full and not first:
            times.append(elapsed * 1e3)
        first = False
        for out in done:
            index = int(out.request_id.rsplit("-", 1)[1])
            if out.finished and index < constrained:
                texts.append((out.outputs[0].text, out.outputs[0].finish_reason))
    return statistics.median(times), texts


def mask_costs(engine: Any, size: int, reps: int) -> dict[str, float]:
    """Fill (llguidance) and apply (one batched op) for ``size`` constrained rows, along a real
    output: at each of its positions the masks are filled for fresh states, as in decoding (a
    mask asked twice in one state would be cached)."""
    from vgraph.structured import StructuredOutputsParams
    from vgraph.structured.bitmask import apply_masks, fill_masks
    from vgraph.structured.matcher import GrammarState

    grammar = engine.grammar_compiler.compile(StructuredOutputsParams(json=SCHEMA))
    items = ",".join(f'{{"id":{i * 7},"tag":"{["alpha", "beta", "gamma", "delta"][i % 4]}"}}' for i in range(ITEMS))
    tokens = engine.tokenizer.encode(f"[{items}]", add_special_tokens=False)
    logits = torch.randn(size, engine.vocab_size)
    rows = torch.arange(size)
    fill, apply = [], []
    for _ in range(reps):
        states = [GrammarState(grammar.matcher(), engine.eos_token_ids) for _ in range(size)]
        for j in range(len(tokens)):
            t0 = time.perf_counter()
            masks = fill_masks(states, engine.vocab_size)
            t1 = time.perf_counter()
            apply_masks(logits, rows, masks.bitmask)
            t2 = time.perf_counter()
            fill.append((t1 - t0) * 1e3)
            apply.append((t2 - t1) * 1e3)
            for state in states:
                state.advance(tokens[:j + 1])
        assert all(s.usable for s in states), "the sample output must be valid for the schema"
    return {"fill_ms": statistics.median(fill), "apply_ms": statistics.median(apply),
            "fill_max_ms": max(fill)}


def compile_costs(engine: Any) -> dict[str, float]:
    """A fresh compiler: its tokenizer build, each kind's cold compile, a cached lookup (ms)."""
    from vgraph.structured import StructuredOutputsParams as S
    from vgraph.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    t0 = time.perf_counter()
    compiler.ll_tokenizer()
    out = {"tokenizer_build_ms": (time.perf_counter() - t0) * 1e3}
    specs = {"json_schema": S(json=SCHEMA), "json_object": S(json_object=True), "regex": S(regex=r"[a-z]{2,5}-\d{3}"),
             "choice": S(choice=["yes", "no", "maybe"]), "grammar": S(grammar='start: "(" /[0-9]+/ ")"')}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        compiler.compile(spec)
        out[f"{name}_cold_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    for _ in range(100):
        compiler.compile(specs["json_schema"])
    out["cached_lookup_ms"] = (time.perf_counter() - t0) * 10
    return out


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run(device: str, quick: bool = False) -> dict:
    from vgraph import LLMEngine
    from vgraph.config import EngineConfig

    rounds = 1 if quick else 3
    sizes = (1, 8) if quick else SIZES
    with tempfile.TemporaryDirectory(prefix="vgraph-perf-structured-") as tmp:
        t0 = time.perf_counter()
        path = build_checkpoint(tmp)
        build_s = time.perf_counter() - t0
        engine = LLMEngine(EngineConfig.from_kwargs(path, device=device, enforce_eager=True, dtype="float32",
                                                    max_num_seqs=max(sizes), max_model_len=1024,
                                                    num_gpu_blocks=max(sizes) * 40))
        compile_ms = compile_costs(engine)
        steps: dict[str, dict[str, list[float]]] = {str(b): {m: [] for m in MODES} for b in sizes}
        outputs: list[tuple[str, str]] = []
        for r in range(rounds):
            for b in sizes:
                for mode in MODES:
                    if b == 1 and mode == "half":
                        continue
                    ms, texts = run_batch(engine, b, mode, seed=r)
                    steps[str(b)][mode].append(ms)
                    outputs.extend(texts)
        masks = {str(b): mask_costs(engine, b, 2 if quick else 5) for b in sizes}
    valid = sum(1 for text, reason in outputs if reason == "stop" and _valid(text))
    rows = []
    for b in sizes:
        med = {m: statistics.median(v) for m, v in steps[str(b)].items() if v}
        rows.append({"batch": b, **{f"{m}_step_ms": med[m] for m in med},
                     "all_minus_free_ms": med["all"] - med["free"],
                     "all_over_free": med["all"] / med["free"], **masks[str(b)]})
    return {"suite": "structured",
            "config": {"device": device, "vocab": VOCAB, "model": "llama hidden 512, 8 layers, fp32, eager",
                       "schema": SCHEMA, "rounds": rounds, "free_tokens": FREE_TOKENS, "checkpoint_build_s": build_s,
                       "python": sys.version.split()[0]},
            "rows": rows, "raw_step_ms": steps, "compile_ms": compile_ms,
            "validity": {"constrained_requests": len(outputs), "valid": valid,
                         "rate": valid / len(outputs) if outputs else None}}


def summarize(result: dict) -> str:
    lines = ["batch  free ms/step  half  all   all-free  mask fill  mask apply"]
    for r in result["rows"]:
        half = f"{r['half_step_ms']:.2f}" if "half_step_ms" in r else "-"
        lines.append(f"{r['batch']:>5}  {r['free_step_ms']:12.2f}  {half:>5}  {r['all_step_ms']:.2f}  "
                     f"{r['all_minus_free_ms']:+8.2f}  {r['fill_ms']:9.3f}  {r['apply_ms']:10.3f}")
    c = result["compile_ms"]
    lines.append("compile (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))
    v = result["validity"]
    lines.append(f"validity: {v['valid']}/{v['constrained_requests']} constrained requests valid ({v['rate']:.0%})")
    return "\n".join(lines)
