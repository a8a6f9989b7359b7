"""``kv_cache_dtype="fp8"`` end to end, on the demo model (CPU, float32 weights).

Two comparisons, for two different claims:

1. The fp8 engine computes exactly what it should: against an engine of the same mode whose
   cache is float32 but holds K/V rounded through e4m3 and back (``_fake_quantized``), greedy
   tokens are equal and top-5 logprobs agree within ``EXACT_TOL`` (1e-4 nats; measured 0,
   eager and compiled). This is what catches a wrong scale, a missed dequantization or a prefix-cache block
   read back wrongly. Both run the same mode and attention kernels (the C++ ones, which read
   an fp8 row as exactly the float the twin stores), because a 1e-7 difference in a K element
   sitting on an e4m3 rounding boundary moves it a whole e4m3 step (measured: up to 0.02 nats
   against an eager reference, or against another attention route): with the same code, the
   two runs see the same numbers, and no near-tie can flip a token.
2. What fp8 costs against the float32 cache: e4m3 keeps 3 mantissa bits, so each cached
   element is off by up to 6.25%, and with the default scales of 1.0 (the demo checkpoint
   has no k_scale/v_scale) the demo model's top-5 logprobs moved by at most 0.60 nats over
   24 generated tokens (measured; 0.28 within the first few); ``FP32_TOL`` is 0.75. Greedy tokens may then differ only where the float32 run's
   top two candidates were within 2 x FP32_TOL: a token differs only at a near-tie, and from
   there on the two runs have different contexts, so nothing after it is compared.
Prefix caching is on (the default) and the prompts share a prefix that hits the cache.
"""
from __future__ import annotations

import importlib
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.config import CompileConfig
from vgraph.models.demo import DEMO_MODEL_DIR
from vgraph.ops.kv_cache import dequantize_kv, quantize_kv
from vgraph.worker.dispatch import Path

unified = importlib.import_module("vgraph.ops.unified_attention")  # the op object shadows the module name

EXACT_TOL = 1e-4
FP32_TOL = 0.75
SHARED = "import os\nimport sys\nimport json\n\n\nclass Config:\n    def __init__(self, path):\n        self."
PROMPTS = [SHARED + t for t in ("path = path\n", "data = ", "items = []\n        for")] + [
    "def fibonacci(n):\n    ", "    for i in range(len(items)):\n        if items[i] =="]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
# "graphs": FULL and PIECEWISE CUDA graphs' dispatch, buckets and padding (slot -1 rows)
# emulated on CPU, as tests/compiler/test_cudagraph_emulated.py runs them.
MODES = {"eager": CompileConfig(level="none"), "compiled": CompileConfig(),
         "graphs": CompileConfig(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=[2, 4, 8, 64, 256])}


def _llm(kv_cache_dtype: str, mode: str = "eager") -> LLM:
    return LLM(str(DEMO_MODEL_DIR), device="cpu", compile_config=MODES[mode], kv_cache_dtype=kv_cache_dtype,
               block_size=16, num_gpu_blocks=64)


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    return dequantize_kv(quantize_kv(x, None), None, x.dtype)


def _round_kv_through_e4m3(monkeypatch) -> None:
    """From now on, attention over an unquantized cache sees K/V rounded through e4m3 at
    scale 1.0, as an fp8 cache holds them (where they are cached and where a fresh prefill
    reads them)."""
    write, attend = unified._write_cache, unified._attend
    monkeypatch.setattr(unified, "_write_cache", lambda k, v, *rest: write(_round_trip(k), _round_trip(v), *rest))
    monkeypatch.setattr(unified, "_attend", lambda q, k, v, *rest: attend(q, _round_trip(k), _round_trip(v), *rest))


def _fake_quantized(monkeypatch, mode: str) -> LLM:
    """A float32-cache engine that computes what the fp8 engine should."""
    _round_kv_through_e4m3(monkeypatch)
    return _llm("auto", mode)


def _generate(llm: LLM) -> list:
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # fills the prefix cache for the others
    return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _max_logprob_diff(a, b, steps: int) -> float:
    return max(abs(x[t] - y[t]) for x, y in zip(a.logprobs[:steps], b.logprobs[:steps]) for t in x if t in y)


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))


@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=pytest.mark.slow),
                                  pytest.param("graphs", marks=pytest.mark.slow)])
def test_fp8_engine_equals_a_float32_cache_of_e4m3_values(mode, monkeypatch):
    llm = _llm("fp8", mode)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    outs = _generate(llm)
    reference = _generate(_fake_quantized(monkeypatch, mode))
    assert llm.engine.scheduler.kv_manager.pool.prefix_cache_hits >= 3 * 16, "the shared prefix's block hits"
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
        assert _max_logprob_diff(out, ref, len(ref.token_ids)) <= EXACT_TOL
    if mode != "eager":
        assert llm.engine.runner.compile_counters.recompiles == 0
    if mode == "graphs":
        paths = {path for path, _ in llm.engine.runner.graphs.dispatch_counts}
        assert {Path.FULL, Path.PIECEWISE} <= paths, paths


def test_fp8_against_the_float32_cache_within_tolerance():
    fp32, fp8 = _generate(_llm("auto")), _generate(_llm("fp8"))
    for a, b in zip(fp32, fp8):
        n = _first_difference(a, b)
        assert _max_logprob_diff(a, b, min(n + 1, len(a.token_ids))) <= FP32_TOL
        if n < len(a.token_ids):
            top = sorted(a.logprobs[n].values(), reverse=True)
            assert top[0] - top[1] <= 2 * FP32_TOL, f"token {n} differs though the margin was {top[0] - top[1]:.2f}"
    assert sum(a.token_ids == b.token_ids for a, b in zip(fp32, fp8)) >= 2, "most prompts agree throughout"


def test_fp8_blocks_take_a_quarter_of_float32_ones(caplog):
    with caplog.at_level(logging.INFO, logger="vgraph"):
        fp8 = LLM(str(DEMO_MODEL_DIR), device="cpu", enforce_eager=True, kv_cache_dtype="fp8", cpu_kv_cache_gib=0.01)
    fp32 = LLM(str(DEMO_MODEL_DIR), device="cpu", enforce_eager=True, cpu_kv_cache_gib=0.01)
    assert 4 * fp8.engine.runner.spec.bytes_per_block == fp32.engine.runner.spec.bytes_per_block
    assert fp8.engine.runner.num_blocks >= 4 * fp32.engine.runner.num_blocks, "the same memory, 4x the blocks"
    assert "KV cache (float8_e4m3fn):" in caplog.text
    assert "the checkpoint has no k_scale/v_scale, so every scale is 1.0" in caplog.text


def _with_scales(tmp_path, scales: dict) -> str:
    """A copy of the tiny Llama checkpoint with these extra tensors."""
    path = tmp_path / "tiny-llama-kv-scales"
    shutil.copytree(tiny_checkpoint(arch="llama"), path)
    weights = load_file(path / "model.safetensors")
    save_file({**weights, **scales}, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def test_scales_are_read_from_the_checkpoint(tmp_path, caplog):
    # Layer 0 in vLLM's current names (a scalar and a [1] tensor), layer 1 in compressed-tensors'
    # older output-scale names; any further layer keeps 1.0.
    path = _with_scales(tmp_path, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.25), "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(2.0),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(4.0)})
    with caplog.at_level(logging.INFO, logger="vgraph"):
        llm = LLM(path, device="cpu", enforce_eager=True, kv_cache_dtype="fp8", block_size=16, num_gpu_blocks=16)
    scales = [(k.item(), v.item()) for k, v in llm.engine.runner.kv_scales]
    assert scales[:2] == [(0.25, 0.5), (2.0, 4.0)] and all(s == (1.0, 1.0) for s in scales[2:])
    assert "k_scale/v_scale read from the checkpoint" in caplog.text
    out = llm.generate([{"prompt_token_ids": list(range(10, 40))}], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    auto = LLM(path, device="cpu", enforce_eager=True, block_size=16, num_gpu_blocks=16)
    assert auto.engine.runner.kv_scales is None, "an unquantized cache loads the scales and ignores them"


def test_a_per_head_scale_is_refused(tmp_path):
    path = _with_scales(tmp_path, {"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_scale must be one positive finite number"):
        LLM(path, device="cpu", enforce_eager=True, kv_cache_dtype="fp8", num_gpu_blocks=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_with_graphs_equals_a_float32_cache_of_e4m3_values(monkeypatch):
    """The Triton path with FULL and PIECEWISE CUDA graphs (the CUDA default), as the first
    test checks the CPU path: the graphs read the scale tensors at replay, and the fp8 kernels
    widen e4m3 to fp32 exactly, so against the fake-quantized float32 cache the tokens are
    equal and logprobs within 1e-3 (CUDA's fp32 GEMMs may differ between the two engines'
    captures; 1e-3 leaves room for that and none for a wrong scale, which moves them by 0.1+)."""
    def cuda_llm(kv_cache_dtype: str) -> LLM:
        return LLM(str(DEMO_MODEL_DIR), device="cuda", kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=256)

    llm = cuda_llm("fp8")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    outs = _generate(llm)
    del llm
    _round_kv_through_e4m3(monkeypatch)
    reference = _generate(cuda_llm("auto"))
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
        assert _max_logprob_diff(out, ref, len(ref.token_ids)) <= 1e-3
