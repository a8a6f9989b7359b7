"""One engine's timed generation, run in that engine's own process and virtual environment.

``python -m perf.peers.runner SPEC.json OUT.json`` (from the repository root, so ``perf`` is
importable; the peer environments do not have vgraph installed, and only the ``vgraph`` and
``hf`` engines import it). SPEC: ``{"engine", "model_dir", "options", "prompts" (token ids),
"max_new_tokens", "threads" (null: the engine's default, all cores), "warmup"}``. OUT: the
generated ids per prompt of the full run, the first token of the prefill run, the seconds of
each, the load time and what the engine reports about itself (versions, resolved precision).

Why a process per engine and per round: each engine keeps its own thread pool, allocator and
(for the peers) its own native libraries, which must not run beside each other on 2 cores; and
only one model sits in memory at a time (the 0.5B-shaped model is 2 GB per engine).

Every engine gets the prompts as token ids, greedy, with EOS ignored, and returns exactly
``max_new_tokens`` ids per prompt. Prefill is timed as a ``max_new_tokens=1`` run over all
prompts (prompt processing plus one sampled token), the full run right after it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

Tokens = list[list[int]]

OV_FP32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
ORT_MAX_BATCH = 32
OV_PROPERTIES = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE",
                 "INFERENCE_NUM_THREADS", "NUM_STREAMS", "PERFORMANCE_HINT")


def all_cores(threads: int | None) -> int:
    return threads or os.cpu_count() or 1


class VgraphEngine:
    """vgraph's offline ``LLM`` (perf/suites/offline.py's setup: fp32, prefix caching off, KV
    blocks for every prompt at full length), compiled unless ``options.compiled`` is false."""

    def __init__(self, spec: dict) -> None:
        from perf.suites.offline import Requests, VgraphSystem

        self._requests = Requests
        largest = Requests(spec["prompts"], [spec["max_new_tokens"]] * len(spec["prompts"]))
        self.system = VgraphSystem(spec["model_dir"], "cpu", [largest], compiled=spec["options"]["compiled"])

    def generate(self, prompts: Tokens, n: int) -> Tokens:
        return self.system.generate(self._requests(prompts, [n] * len(prompts)))

    def info(self) -> dict:
        import torch
        import vgraph
        return {"vgraph": getattr(vgraph, "__version__", "?"), "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(), "config": self.system.config}


class HFEngine:
    """transformers ``generate``: one left-padded batch with an attention mask (offline.py's
    HFSystem); with ``options.static`` the static cache and transformers' compiled decode step."""

    def __init__(self, spec: dict) -> None:
        from perf.suites.offline import HFSystem

        self.system = HFSystem(spec["model_dir"], "cpu")
        self.static = bool(spec["options"].get("static"))

    def generate(self, prompts: Tokens, n: int) -> Tokens:
        self.system.static_compile = self.static
        return self.system.generate_batch(prompts, n)

    def info(self) -> dict:
        import torch
        import transformers
        return {"transformers": transformers.__version__, "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(), "static_cache_compile": self.static}


class OpenVINOEngine:
    """OpenVINO GenAI's continuous-batching pipeline (what ``LLMPipeline`` runs on CPU for a
    batch of prompts) fed ``ov.Tensor`` ids. ``options.precision``: "f32" forces fp32 compute,
    an fp32 KV cache and no dynamic activation quantization; "default" leaves the CPU plugin's
    defaults (bf16 compute on CPUs with native bf16, u8 KV cache)."""

    def __init__(self, spec: dict) -> None:
        import openvino_genai as og

        self.properties: dict[str, Any] = dict(OV_FP32) if spec["options"]["precision"] == "f32" else {}
        if spec["threads"]:
            self.properties["INFERENCE_NUM_THREADS"] = spec["threads"]
        scheduler = og.SchedulerConfig()
        scheduler.cache_size = 2  # GB of KV cache: every prompt at full length, both models
        scheduler.max_num_seqs = max(len(spec["prompts"]), 1)
        scheduler.max_num_batched_tokens = 8192
        scheduler.enable_prefix_caching = False  # rounds repeat prompts; vgraph runs without it too
        self.model_dir = spec["model_dir"]
        self.pipe = og.ContinuousBatchingPipeline(self.model_dir, scheduler, "CPU", self.properties)

    def generate(self, prompts: Tokens, n: int) -> Tokens:
        import numpy as np
        import openvino as ov
        import openvino_genai as og

        config = og.GenerationConfig()
        config.max_new_tokens, config.ignore_eos, config.do_sample = n, True, False
        ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        results = self.pipe.generate(ids, [config] * len(prompts))
        return [[int(t) for t in r.m_generation_ids[0]] for r in results]

    def info(self) -> dict:
        """The plugin's defaults, and what a model compiled with this run's properties resolves to
        (the pipeline compiles its own, paged-attention version of the same model)."""
        import openvino as ov
        import openvino_genai as og

        core = ov.Core()
        compiled = core.compile_model(os.path.join(self.model_dir, "openvino_model.xml"), "CPU", self.properties)
        return {"openvino": ov.__version__, "openvino_genai": og.__version__,
                "properties_passed": {k: str(v) for k, v in self.properties.items()},
                "cpu_plugin_defaults": _ov_properties(lambda k: core.get_property("CPU", k)),
                "compiled_model": _ov_properties(compiled.get_property)}


def _ov_properties(get: Callable[[str], Any]) -> dict:
    out = {}
    for key in OV_PROPERTIES:
        try:
            out[key] = str(get(key))
        except Exception as exc:  # noqa: BLE001 - a property this version lacks is recorded as such
            out[key] = f"unavailable ({type(exc).__name__})"
    return out


class OrtGenAIEngine:
    """ONNX Runtime GenAI on the model its builder wrote: one generator over a *right*-padded
    batch (the pad id marks padding), greedy, run to ``prompt width + n`` tokens; each row's new
    tokens start at the batch width. Right, because its CPU GroupQueryAttention takes a row's
    length from the mask and assumes the pads at the end: a left-padded batch gave tokens equal
    to transformers on 22 of 256 positions, right-padded on 256 of 256 (single prompts 64/64).
    EOS is ignored by an empty ``eos_token_id`` list overlaid on the config (no logit masked)."""

    def __init__(self, spec: dict) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(spec["model_dir"])
        overlay: dict[str, Any] = {"model": {"eos_token_id": []}}
        if spec["threads"]:
            overlay["model"]["decoder"] = {"session_options": {"intra_op_num_threads": spec["threads"]}}
        config.overlay(json.dumps(overlay))
        self.model = og.Model(config)
        self.pad_id = spec["options"]["pad_id"]
        self.threads = spec["threads"]

    def generate(self, prompts: Tokens, n: int) -> Tokens:
        """Batches of at most ORT_MAX_BATCH prompts (its generator refuses more: "batch_size
        (64) must be in [1, 32]"), longest first so each batch pads little."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: dict[int, list[int]] = {}
        for start in range(0, len(order), ORT_MAX_BATCH):
            chunk = order[start:start + ORT_MAX_BATCH]
            out.update(zip(chunk, self._generate_batch([prompts[i] for i in chunk], n)))
        return [out[i] for i in range(len(prompts))]

    def _generate_batch(self, prompts: Tokens, n: int) -> Tokens:
        import numpy as np

        width = max(len(p) for p in prompts)
        batch = np.full((len(prompts), width), self.pad_id, dtype=np.int32)
        for row, p in enumerate(prompts):
            batch[row, :len(p)] = p
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=width + n, batch_size=len(prompts))
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(batch)
        while not generator.is_done():
            generator.generate_next_token()
        return [[int(t) for t in generator.get_sequence(i)[width:]] for i in range(len(prompts))]

    def info(self) -> dict:
        import onnxruntime
        return {"onnxruntime_genai": self.og.__version__, "onnxruntime": onnxruntime.__version__,
                "intra_op_num_threads": self.threads or "default (all cores)", "padding": "right, pad id", "max_batch": ORT_MAX_BATCH}


class CT2Engine:
    """CTranslate2's ``Generator`` (compute_type float32). It takes token strings, so ids go
    through the converted model's own vocabulary (index = id; the suite checks the round trip).
    EOS is ignored with ``end_token=[]`` and ``return_end_token``; no logit is masked."""

    def __init__(self, spec: dict) -> None:
        import ctranslate2

        self.threads = all_cores(spec["threads"])
        self.generator = ctranslate2.Generator(spec["model_dir"], device="cpu", compute_type="float32",
                                               intra_threads=self.threads, inter_threads=1)
        with open(os.path.join(spec["model_dir"], "vocabulary.json")) as f:
            self.vocab: list[str] = json.load(f)
        self.ids = {tok: i for i, tok in enumerate(self.vocab)}
        if len(self.ids) != len(self.vocab):
            raise RuntimeError("the converted vocabulary has duplicate tokens: ids do not round-trip")

    def generate(self, prompts: Tokens, n: int) -> Tokens:
        results = self.generator.generate_batch(
            [[self.vocab[i] for i in p] for p in prompts], max_length=n, sampling_topk=1,
            include_prompt_in_result=False, end_token=[], return_end_token=True, max_batch_size=0)
        return [list(r.sequences_ids[0]) for r in results]

    def info(self) -> dict:
        import ctranslate2
        return {"ctranslate2": ctranslate2.__version__, "compute_type": self.generator.compute_type,
                "intra_threads": self.threads, "vocabulary_size": len(self.vocab)}


ENGINES: dict[str, Callable[[dict], Any]] = {
    "vgraph": VgraphEngine, "hf": HFEngine, "openvino": OpenVINOEngine,
    "ortgenai": OrtGenAIEngine, "ctranslate2": CT2Engine,
}


def check(tokens: Tokens, count: int, n: int, what: str) -> None:
    if len(tokens) != count or any(len(t) != n for t in tokens):
        lengths = sorted({len(t) for t in tokens})
        raise RuntimeError(f"{what}: expected {count} x {n} tokens, got {len(tokens)} prompts of lengths {lengths}")


def measure(spec: dict) -> dict:
    """Load, warm up (untimed), then the prefill run and the full run, each timed."""
    t0 = time.perf_counter()
    engine = ENGINES[spec["engine"]](spec)
    load_s = time.perf_counter() - t0
    prompts, n = spec["prompts"], spec["max_new_tokens"]
    warm = spec.get("warmup", "short")
    if warm == "full":  # an engine that compiles per shape (static cache): both timed shapes here
        engine.generate(prompts, 1)
        engine.generate(prompts, n)
    elif warm == "short":
        engine.generate(prompts[:2], 4)
    t0 = time.perf_counter()
    first = engine.generate(prompts, 1)
    prefill_s = time.perf_counter() - t0
    check(first, len(prompts), 1, "prefill run")
    t0 = time.perf_counter()
    tokens = engine.generate(prompts, n)
    total_s = time.perf_counter() - t0
    check(tokens, len(prompts), n, "full run")
    return {"tokens": tokens, "prefill_first_tokens": [t[0] for t in first], "prefill_s": prefill_s,
            "total_s": total_s, "load_s": load_s, "info": engine.info() if spec.get("info") else None}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m perf.peers.runner SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = measure(spec)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
