"""Checkpoint loading: file layouts, dtypes, tied weights, hub fallbacks and clear errors."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors import safe_open

from tests.checkpoints import tiny_checkpoint
from vgraph.config import ModelConfig
from vgraph.models import demo
from vgraph.models.loader import (iterate_weights, load_generation_config, load_model,
                                  load_tokenizer, resolve_model_path, safetensors_files)
from vgraph.models.registry import get_model_class, supported_architectures


def _load(path: str, dtype: str = "auto"):
    return load_model(ModelConfig(str(path), dtype=dtype), "cpu")


def _copy_checkpoint(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_sharded_and_single_file_load_identically(tmp_path) -> None:
    sharded = demo.build_tiny_checkpoint(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert (Path(sharded) / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 2
    single, _, _ = _load(tiny_checkpoint(arch="llama"))
    split, _, stats = _load(sharded)
    ours, theirs = single.state_dict(), split.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert stats.weights_bytes == sum(t.numel() * 4 for t in split.parameters())


def test_dtype_auto_follows_checkpoint_and_can_be_overridden(tmp_path) -> None:
    bf16 = demo.build_tiny_checkpoint(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    model, _, stats = _load(bf16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert stats.weights_bytes == sum(p.numel() * 2 for p in model.parameters())
    fp32_model, _, _ = _load(bf16, dtype="float32")
    assert {p.dtype for p in fp32_model.parameters()} == {torch.float32}
    model, _, _ = _load(tiny_checkpoint(arch="qwen3"), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32  # tables stay fp32


def test_bf16_forward_runs(tmp_path) -> None:
    from tests.models.test_models import PagedSequence

    model, _, _ = _load(tiny_checkpoint(arch="qwen2"), dtype="bfloat16")
    logits = PagedSequence(model).step(torch.arange(6, 30))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_tied_embeddings_share_one_tensor() -> None:
    path = tiny_checkpoint(arch="qwen2")
    with safe_open(safetensors_files(path)[0], "pt") as f:
        assert "lm_head.weight" not in f.keys()
    tied, _, _ = _load(path)
    # A small tied head runs a packed copy of the embedding (models/linear.py); unpacked, it is
    # the embedding's own Parameter again.
    assert tied.lm_head.unpack().weight is tied.model.embed_tokens.weight
    untied, _, _ = _load(tiny_checkpoint(arch="llama"))
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path) -> None:
    """Some tied checkpoints save lm_head.weight anyway; it is the embedding, so skip it."""
    path = tiny_checkpoint(arch="qwen2")
    model, _, _ = _load(path)
    embed = model.model.embed_tokens.weight.clone()
    model.load_weights(list(iterate_weights(path)) + [("lm_head.weight", embed * 0)])
    assert torch.equal(model.model.embed_tokens.weight, embed)


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path) -> None:
    path = _copy_checkpoint(tiny_checkpoint(arch="llama"), tmp_path / "gpt2")
    _edit_json(path / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        _load(str(path))
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)
    assert supported_architectures() == sorted(supported_architectures())
    with pytest.raises(ValueError, match="none listed"):
        get_model_class(None)


def test_sliding_window_checkpoint_is_a_clear_error(tmp_path) -> None:
    path = _copy_checkpoint(tiny_checkpoint(arch="llama"), tmp_path / "mistral")
    _edit_json(path / "config.json", architectures=["MistralForCausalLM"], model_type="mistral",
               sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window=64"):
        _load(str(path))


def test_offline_hub_id_says_to_use_a_local_directory(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="could not fetch model 'vgraph-tests/no-such-model'"
                                           ".*local directory path") as err:
        _load("vgraph-tests/no-such-model")
    assert "offline" in str(err.value)


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="is not a directory"):
        resolve_model_path(str(tmp_path / "nope"))
    assert resolve_model_path(tiny_checkpoint(arch="llama")) == tiny_checkpoint(arch="llama")


def test_load_logs_name_architecture_dtype_size_and_time(caplog) -> None:
    path = tiny_checkpoint(arch="qwen3")
    with caplog.at_level(logging.INFO, logger="vgraph"):
        _, _, stats = _load(path)
    message = next(r.getMessage() for r in caplog.records if r.name == "vgraph")
    assert path in message and "Qwen3ForCausalLM" in message and "float32" in message
    assert "MiB of weights" in message and stats.load_seconds > 0


def test_generation_config_overrides_config_eos(tmp_path) -> None:
    path = _copy_checkpoint(tiny_checkpoint(arch="llama"), tmp_path / "eos")
    assert load_generation_config(str(path)) == {1}
    _edit_json(path / "config.json", eos_token_id=[1, 7])
    _edit_json(path / "generation_config.json", eos_token_id=[1, 3, 4])
    assert load_generation_config(str(path)) == {1, 3, 4}
    (path / "generation_config.json").unlink()
    assert load_generation_config(str(path)) == {1, 7}


def test_tokenizer_round_trips_and_has_a_chat_template() -> None:
    tokenizer = load_tokenizer(tiny_checkpoint(arch="llama"))
    assert len(tokenizer) == 512
    text = "Hello, world! Ünïcödé and 日本語 survive byte-level BPE."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>\nHi</s>\n<|assistant|>\n"


def test_tiny_checkpoints_are_deterministic(tmp_path) -> None:
    first = Path(demo.build_tiny_checkpoint(tmp_path / "a", "qwen2", seed=3))
    second = Path(demo.build_tiny_checkpoint(tmp_path / "b", "qwen2", seed=3))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    assert demo._tokenizer_json.__wrapped__() == demo._tokenizer_json()  # training is repeatable
    other = Path(demo.build_tiny_checkpoint(tmp_path / "c", "qwen2", seed=4))
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_the_shipped_demo_model_loads_its_half_weights_as_float32() -> None:
    """Stored fp16, declared float32: the default dtype widens every weight exactly."""
    path = demo.demo_model_dir()
    model, hf_config, _ = _load(path)
    assert hf_config.architectures == ["LlamaForCausalLM"]
    weights = dict(iterate_weights(path))
    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.float32 and weights["model.embed_tokens.weight"].dtype == torch.float16
    assert torch.equal(embed, weights["model.embed_tokens.weight"].float())
