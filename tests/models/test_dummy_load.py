"""load_format="dummy": a model built from config.json alone, random weights, no weights read."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.cli import build_parser
from vgraph.config import ModelConfig
from vgraph.testing import checkpoints
from vgraph.models.loader import load_model
from vgraph.models.quantization import Fp8Linear


def _config_only(src: str, dst: Path) -> str:
    """A copy of a checkpoint directory without its weight files: config and tokenizer only."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not list(dst.glob("*.safetensors"))
    return str(dst)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_dummy_load_fills_every_parameter_without_weight_files(tmp_path, arch) -> None:
    path = _config_only(tiny_checkpoint(arch=arch), tmp_path / arch)
    with pytest.raises(FileNotFoundError, match="safetensors"):  # "auto" does need the weights
        load_model(ModelConfig(path), "cpu")
    model, _, stats = load_model(ModelConfig(path, load_format="dummy"), "cpu")
    assert stats.weights_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        assert param.float().std() > 0, name  # random, not all zero and not constant
        if name.endswith("norm.weight"):
            assert abs(param.float().mean().item() - 1.0) < 0.05, name
        else:
            assert param.float().abs().mean().item() < 0.1, name


def test_dummy_load_is_seeded(tmp_path) -> None:
    path = _config_only(tiny_checkpoint(arch="llama"), tmp_path / "llama")
    a, _, _ = load_model(ModelConfig(path, load_format="dummy", seed=3), "cpu")
    b, _, _ = load_model(ModelConfig(path, load_format="dummy", seed=3), "cpu")
    c, _, _ = load_model(ModelConfig(path, load_format="dummy", seed=4), "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_dummy_model_generates_the_requested_tokens(tmp_path) -> None:
    path = _config_only(tiny_checkpoint(arch="llama"), tmp_path / "llama")
    llm = LLM(path, load_format="dummy", device="cpu", enforce_eager=True, num_gpu_blocks=64,
              max_num_seqs=4)
    assert llm.engine.config.model.load_format == "dummy"
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    outputs = llm.generate(["hello there", "the quick brown fox"], params, use_tqdm=False)
    for out in outputs:
        assert len(out.outputs[0].token_ids) == 7
    assert any(p.abs().sum() > 0 for p in llm.engine.runner.model.parameters())


def test_dummy_with_fp8_quantized_at_load(tmp_path) -> None:
    path = _config_only(tiny_checkpoint(arch="llama"), tmp_path / "llama")
    llm = LLM(path, load_format="dummy", quantization="fp8", device="cpu", enforce_eager=True,
              num_gpu_blocks=32, max_num_seqs=2)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.weight.float().abs().sum() > 0 for m in layers)
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_dummy_with_static_fp8_checkpoint_config(tmp_path) -> None:
    """A config that declares fp8 weights: random e4m3 weights with per-tensor scales."""
    src = checkpoints.build_tiny_fp8_static_checkpoint(tmp_path / "src", seed=0)
    path = _config_only(src, tmp_path / "fp8")
    llm = LLM(path, load_format="dummy", device="cpu", enforce_eager=True, num_gpu_blocks=32,
              max_num_seqs=2)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert layers
    for m in layers:
        assert m.weight.float().abs().sum() > 0
        assert m.weight_scale.numel() == 1 and 0 < m.weight_scale.item() < 1
        assert m.input_scale is not None and m.input_scale.item() > 0
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_load_format_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="load_format 'random'.*auto, dummy"):
        ModelConfig("some/model", load_format="random")
    with pytest.raises(ValueError, match="load_format"):
        LLM(tiny_checkpoint(arch="llama"), load_format="zeros", device="cpu")


def test_cli_flag() -> None:
    args = build_parser().parse_args(["generate", "--load-format", "dummy", "--prompt", "hi"])
    assert args.load_format == "dummy"
    assert build_parser().parse_args(["generate", "--prompt", "hi"]).load_format == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--load-format", "npz", "--prompt", "hi"])
