"""fp8 models: quantized at load (dynamic activations) and static fp8 checkpoints.

fp8 is lossy, so the quantized-at-load model is held to a relative logit error against the
unquantized one; the static model is held to a hand-computed fake-quant reference (weights
dequantized, activations quantized with the static scale, fp32 matmuls) that it must match
to fp32 rounding.
"""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.checkpoints import TINY_ARCHS, process_tmp_dir, tiny_checkpoint
from tests.models.test_models import PagedSequence
from vgraph import LLM, SamplingParams
from vgraph.config import ModelConfig
from vgraph.testing.checkpoints import build_tiny_fp8_static_checkpoint
from vgraph.models.linear import PackedLinear, RowMajorLinear
from vgraph.models.llama import Linear, LlamaForCausalLM
from vgraph.models.loader import load_model
from vgraph.models.quantization import (Fp8Config, Fp8Linear, Fp8MergedLinear,
                                        quantize_weight, resolve_quantization)
from vgraph.ops.fp8 import (dynamic_per_token_scaled_fp8_quant_reference,
                            static_scaled_fp8_quant_reference)
from vgraph.ops.kernels.common import FP8_DTYPE

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
HF_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "self_attn.o_proj": ("self_attn.o_proj",),
                  "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                  "mlp.down_proj": ("mlp.down_proj",)}


@functools.lru_cache(maxsize=None)
def static_checkpoint() -> str:
    return build_tiny_fp8_static_checkpoint(Path(process_tmp_dir()) / "tiny-fp8-static")


def _load(path: str, quantization: str | None = None, **kwargs) -> LlamaForCausalLM:
    model, _, _ = load_model(ModelConfig(path, dtype="float32", quantization=quantization),
                             "cpu", **kwargs)
    return model


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(6, 512, (length,), generator=torch.Generator().manual_seed(seed))


def _logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return PagedSequence(model).step(ids)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


# ---------------------------------------------------------------- choosing the scheme


def test_unknown_quantization_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported quantization 'int3'.*fp8"):
        _load(tiny_checkpoint(arch="llama"), "int3")


@pytest.mark.parametrize("requested", [None, "fp8"])
def test_the_checkpoint_decides_its_scheme(requested: str | None) -> None:
    cfg = transformers.PretrainedConfig()
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "static"}
    assert resolve_quantization(requested, cfg) == Fp8Config(serialized=True, static_activations=True)
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert resolve_quantization(requested, cfg) == Fp8Config(serialized=True, static_activations=False)
    plain = transformers.PretrainedConfig()
    expected = None if requested is None else Fp8Config(serialized=False, static_activations=False)
    assert resolve_quantization(requested, plain) == expected


@pytest.mark.parametrize("stored,message", [
    ({"quant_method": "gptq", "bits": 4}, "'gptq'.*fp8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme"),
])
def test_unsupported_checkpoint_formats_are_clear_errors(stored: dict, message: str) -> None:
    cfg = transformers.PretrainedConfig()
    cfg.quantization_config = stored
    with pytest.raises(ValueError, match=message):
        resolve_quantization(None, cfg)


# ---------------------------------------------------------------- quantized at load


@functools.lru_cache(maxsize=None)
def _dynamic_pair(arch: str) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    path = tiny_checkpoint(arch=arch)
    return _load(path), _load(path, "fp8")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fp8_at_load_quantizes_every_projection_and_nothing_else(arch: str) -> None:
    full, fp8 = _dynamic_pair(arch)
    for layer in fp8.model.layers:
        for name in PROJECTIONS:
            proj = layer.get_submodule(name)
            assert isinstance(proj, Fp8Linear) and proj.input_scale is None
            assert proj.weight.dtype == FP8_DTYPE and proj.weight_scale.shape == (1,)
    # lm_head stays float32 (packed on CPU, or row-major on the same kernel when tied, see
    # models/linear.py)
    assert isinstance(fp8.lm_head, (Linear, PackedLinear, RowMajorLinear)) and fp8.lm_head.weight.dtype == torch.float32
    assert fp8.model.embed_tokens.weight.dtype == torch.float32 and fp8.dtype == torch.float32
    assert not any(isinstance(m, (Linear, PackedLinear)) for n, m in fp8.named_modules()
                   if n != "lm_head")
    ref = full.model.layers[0].self_attn.qkv_proj
    if ref.bias is not None:  # qwen2: biases stay exact, in the activation dtype
        assert torch.equal(fp8.model.layers[0].self_attn.qkv_proj.bias, ref.bias)


@pytest.mark.parametrize("name", PROJECTIONS)
def test_fp8_at_load_projection_error_is_that_of_fp8(name: str) -> None:
    """One GEMM: e4m3 keeps 3 mantissa bits, so weights and activations each lose ~2.6% (rms)."""
    full, fp8 = _dynamic_pair("llama")
    ours, ref = fp8.model.layers[0].get_submodule(name), full.model.layers[0].get_submodule(name)
    x = torch.randn(16, ref.weight.shape[1])
    with torch.no_grad():
        assert _relative_error(ours(x), ref(x)) < 5e-2


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fp8_at_load_logits_stay_close_to_the_unquantized_model(arch: str) -> None:
    """Whole model: the tiny random models amplify rounding (bf16 weights alone move their
    logits by ~1.3%), and eight fp8 GEMMs per token land at ~8-14%; exactness is pinned by
    the fake-quant comparison below, this bounds the loss."""
    full, fp8 = _dynamic_pair(arch)
    ids = _prompt(40, seed=1)
    expected, actual = _logits(full, ids), _logits(fp8, ids)
    assert actual.dtype == torch.float32
    assert _relative_error(actual, expected) < 0.2
    assert torch.nn.functional.cosine_similarity(actual, expected, dim=0) > 0.98


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fp8_at_load_matches_the_fake_quant_reference(arch: str) -> None:
    _, fp8 = _dynamic_pair(arch)
    hf = _hf_fake_quant_model(fp8, tiny_checkpoint(arch=arch))
    ids = _prompt(24, seed=4)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0, -1]
    torch.testing.assert_close(_logits(fp8, ids), expected, atol=1e-4, rtol=1e-4)


def test_fp8_weight_quantization_round_trips_within_one_fp8_step() -> None:
    w = torch.randn(64, 32)
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and scale.item() == pytest.approx(w.abs().max().item() / 448)
    # e4m3 has 3 mantissa bits: relative rounding error at most 2^-4 (above the subnormals)
    torch.testing.assert_close(q.float() * scale, w, atol=scale.item() * 2**-6 * 4, rtol=2**-4)


# ---------------------------------------------------------------- static fp8 checkpoints


def test_merged_shards_are_requantized_to_the_largest_scale() -> None:
    layer = Fp8MergedLinear(32, [("a", 8), ("b", 8)], False, torch.float32, "cpu", static=True)
    wa, wb = torch.randn(8, 32), 3 * torch.randn(8, 32)
    (qa, sa), (qb, sb) = quantize_weight(wa), quantize_weight(wb)
    for shard, q, s, x_scale in (("a", qa, sa, 0.5), ("b", qb, sb, 0.25)):
        layer.shard_view("weight", shard).copy_(q)
        layer.shard_view("weight_scale", shard).copy_(s)
        layer.shard_view("input_scale", shard).fill_(x_scale)
    layer.finalize()
    top = torch.maximum(sa, sb)
    assert torch.equal(layer.weight_scale, top) and layer.input_scale.item() == 0.5
    largest, q_largest = ("b", qb) if sb > sa else ("a", qa)
    start, size = layer.shards[largest]
    assert torch.equal(layer.weight[start:start + size].float(), q_largest.float())  # untouched
    dequant = layer.weight.float() * layer.weight_scale
    original = torch.cat([qa.float() * sa, qb.float() * sb])
    torch.testing.assert_close(dequant, original, atol=top.item() * 2**-6 * 4, rtol=2**-4)


def test_static_checkpoint_loads_as_static_fp8_whatever_was_requested() -> None:
    for requested in (None, "fp8"):
        model = _load(static_checkpoint(), requested)
        for layer in model.model.layers:
            for name in PROJECTIONS:
                proj = layer.get_submodule(name)
                assert proj.weight.dtype == FP8_DTYPE
                assert proj.weight_scale.shape == (1,) and proj.input_scale.shape == (1,)
                assert proj.input_scale.item() > 0 and proj.weight_scale.item() > 0
        assert model.lm_head.weight.dtype == torch.float32


def _checkpoint_tensors() -> dict[str, torch.Tensor]:
    return load_file(str(Path(static_checkpoint()) / "model.safetensors"))


@torch.no_grad()
def _fake_quant_linear(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                       x_scale: torch.Tensor) -> torch.Tensor:
    """The static fp8 linear by hand: quantize x with its scale, dequantize both, fp32 matmul."""
    xq = static_scaled_fp8_quant_reference(x, x_scale).float() * x_scale
    return xq @ (q.float() * w_scale).t()


@pytest.mark.parametrize("name", PROJECTIONS)
def test_static_projection_matches_the_hand_computed_reference(name: str) -> None:
    model, tensors = _load(static_checkpoint()), _checkpoint_tensors()
    proj = model.model.layers[1].get_submodule(name)
    hf_names = [f"model.layers.1.{n}" for n in HF_PROJECTIONS[name]]
    x = 0.5 * torch.randn(7, proj.in_features)
    with torch.no_grad():
        out = proj(x)
    # exactly the module's own fp8 operands, by hand
    torch.testing.assert_close(
        out, _fake_quant_linear(x, proj.weight, proj.weight_scale, proj.input_scale),
        atol=1e-6, rtol=1e-6)
    # and the checkpoint's own tensors: each shard with its own weight scale, the max input scale
    x_scale = max(tensors[f"{n}.input_scale"] for n in hf_names)
    expected = torch.cat([_fake_quant_linear(x, tensors[f"{n}.weight"], tensors[f"{n}.weight_scale"],
                                             x_scale) for n in hf_names], dim=-1)
    if len(hf_names) == 1:  # nothing requantized: the same numbers
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    else:  # smaller shards were rounded once more to the shared scale
        assert _relative_error(out, expected) < 2e-2


def _hf_fake_quant_model(model: LlamaForCausalLM, path: str) -> torch.nn.Module:
    """transformers' model with our dequantized weights, each projection's input quantized
    as ours is (static scale, or per token): the fp8 model by hand, for a whole forward."""
    config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    state = {k: v for k, v in load_file(str(Path(path) / "model.safetensors")).items()
             if not k.endswith("_scale")}
    for i, layer in enumerate(model.model.layers):
        for name in PROJECTIONS:
            proj = layer.get_submodule(name)
            sizes = [size for _, size in getattr(proj, "shards", {"": (0, proj.out_features)}).values()]
            rows = (proj.weight.float() * proj.weight_scale).split(sizes)
            for hf_name, weight in zip(HF_PROJECTIONS[name], rows):
                state[f"model.layers.{i}.{hf_name}.weight"] = weight
                hf_proj = hf.model.layers[i].get_submodule(hf_name)
                hf_proj.register_forward_pre_hook(functools.partial(_quantize_input, proj.input_scale))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the embedding
    return hf


def _quantize_input(scale: torch.Tensor | None, _module: torch.nn.Module,
                    args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    if scale is None:
        q, per_token = dynamic_per_token_scaled_fp8_quant_reference(args[0])
        return (q.float() * per_token,)
    return (static_scaled_fp8_quant_reference(args[0], scale).float() * scale,)


def test_static_model_forward_matches_the_fake_quant_reference() -> None:
    model = _load(static_checkpoint())
    hf = _hf_fake_quant_model(model, static_checkpoint())
    ids = _prompt(24, seed=4)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0, -1]
    actual = _logits(model, ids)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_static_checkpoint_missing_an_input_scale_is_named(tmp_path: Path) -> None:
    broken = Path(shutil.copytree(static_checkpoint(), tmp_path / "broken"))
    tensors = _checkpoint_tensors()
    del tensors["model.layers.0.self_attn.k_proj.input_scale"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"qkv_proj\.input_scale\[k\]"):
        _load(str(broken))


def test_static_checkpoint_files() -> None:
    path = Path(static_checkpoint())
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "static"}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == FP8_DTYPE
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.0.mlp.up_proj.input_scale").dtype == torch.float32


def test_static_checkpoint_generates_through_the_engine() -> None:
    llm = LLM(static_checkpoint(), dtype="float32", device="cpu", num_gpu_blocks=64)
    assert llm.engine.runner is not None and llm.engine.runner.model.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["The sea was calm", [5, 6, 7]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    again = llm.generate("The sea was calm", params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_dynamic_fp8_checkpoint_ignores_input_scales(tmp_path: Path) -> None:
    """activation_scheme "dynamic": fp8 weights from the checkpoint, activations per token."""
    path = Path(shutil.copytree(static_checkpoint(), tmp_path / "dynamic"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "dynamic"
    (path / "config.json").write_text(json.dumps(config))
    model = _load(str(path))
    proj = model.model.layers[0].self_attn.qkv_proj
    assert proj.weight.dtype == FP8_DTYPE and proj.input_scale is None
    hf = _hf_fake_quant_model(model, str(path))
    ids = _prompt(16, seed=8)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0, -1]
    torch.testing.assert_close(_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
