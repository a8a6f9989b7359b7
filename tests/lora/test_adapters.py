"""Reading PEFT folders: the .bin format, scaling, and bad adapters refused with an error that
names the file and the field or key (before any slot is touched)."""
from __future__ import annotations

import functools
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import process_tmp_dir, tiny_checkpoint
from tests.lora.adapters import cached_adapter, edit_config, make_adapter
from vgraph.config import ModelConfig
from vgraph.lora import LoRAConfig, LoRARequest
from vgraph.lora.adapter import LoRAAdapterError, load_adapter
from vgraph.lora.slots import LoRASlotManager
from vgraph.models.loader import load_model


@functools.lru_cache(maxsize=1)
def _model():
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_num_tokens=64)
    model, _, _ = load_model(ModelConfig(tiny_checkpoint(arch="llama"), dtype="float32"), "cpu", lora_config=config)
    return model


def _copy(tmp_path, name="adapter", **spec) -> str:
    source = cached_adapter(tiny_checkpoint(arch="llama"), process_tmp_dir(), **{"seed": 5, "rank": 4, **spec})
    return shutil.copytree(source, tmp_path / name)


def _load(path: str, max_rank: int = 8):
    return load_adapter(LoRARequest("bad", 1, os.fspath(path)), _model().lora_targets(), max_rank)


def _rewrite_weights(path, change) -> None:
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def test_scaling_is_folded_into_b(tmp_path):
    path = _copy(tmp_path, alpha=12)
    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    adapter = _load(path)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    assert adapter.scaling == 3.0 and adapter.rank == 4
    torch.testing.assert_close(adapter.weights[(1, "down_proj")][1], raw[key] * 3.0)
    edit_config(path, use_rslora=True)
    assert _load(path).scaling == pytest.approx(12 / math.sqrt(4))


def test_bin_format_reads_the_same(tmp_path):
    base = tiny_checkpoint(arch="llama")
    safe = _load(make_adapter(base, tmp_path / "safe", seed=9, rank=4))
    legacy_dir = make_adapter(base, tmp_path / "bin", seed=9, rank=4, safe_serialization=False)
    assert os.path.isfile(os.path.join(legacy_dir, "adapter_model.bin"))
    legacy = _load(legacy_dir)
    assert legacy.weights.keys() == safe.weights.keys()
    for key, (a, b) in safe.weights.items():
        assert torch.equal(legacy.weights[key][0], a) and torch.equal(legacy.weights[key][1], b)


@pytest.mark.parametrize("fields, match", [
    (dict(r=16, lora_alpha=16), "field r is 16, above max_lora_rank 8"),
    (dict(use_dora=True), "field use_dora is set"),
    (dict(bias="lora_only"), "field bias is 'lora_only'"),
    (dict(modules_to_save=["lm_head"]), "field modules_to_save is set"),
    (dict(rank_pattern={"q_proj": 2}), "field rank_pattern is set"),
    (dict(target_modules=["q_proj", "embed_tokens"]), r"field target_modules names \['embed_tokens'\]"),
    (dict(peft_type="IA3"), "field peft_type is 'IA3'"),
    (dict(r="four"), "field r must be a positive integer"),
])
def test_bad_config_fields_are_named(tmp_path, fields, match):
    path = _copy(tmp_path)
    edit_config(path, **fields)
    with pytest.raises(LoRAAdapterError, match=match) as info:
        _load(path)
    assert "adapter_config.json" in str(info.value)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(LoRAAdapterError, match="folder does not exist"):
        _load(tmp_path / "nowhere")
    path = _copy(tmp_path)
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"adapter_model.safetensors\): missing"):
        _load(path)
    os.remove(os.path.join(path, "adapter_config.json"))
    with pytest.raises(LoRAAdapterError, match=r"adapter_config.json\): missing"):
        _load(path)


def test_corrupt_files_are_named(tmp_path):
    path = _copy(tmp_path)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(b"not safetensors")
    with pytest.raises(LoRAAdapterError, match="adapter_model.safetensors.*not a readable"):
        _load(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{")
    with pytest.raises(LoRAAdapterError, match="adapter_config.json.*not readable JSON"):
        _load(path)


def test_wrong_base_shapes_are_named(tmp_path):
    path = _copy(tmp_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _rewrite_weights(path, lambda t: t.update({key: torch.zeros(t[key].shape[0] + 1, 4)}))
    with pytest.raises(LoRAAdapterError, match=f"weight {key} has shape .*expected .*q_proj") as info:
        _load(path)
    assert "adapter_model.safetensors" in str(info.value)


def test_unsupported_weights_are_named(tmp_path):
    path = _copy(tmp_path)
    extra = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    _rewrite_weights(path, lambda t: t.update({extra: torch.ones(4)}))
    with pytest.raises(LoRAAdapterError, match=f"weight {extra} is not a LoRA A/B weight"):
        _load(path)


def test_a_weight_without_its_partner_is_named(tmp_path):
    path = _copy(tmp_path)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    _rewrite_weights(path, lambda t: t.pop(key))
    with pytest.raises(LoRAAdapterError, match="up_proj.lora_A.weight has no lora_B partner"):
        _load(path)


def test_a_layer_beyond_the_model_is_named(tmp_path):
    path = _copy(tmp_path)
    key = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    far = key.replace("layers.0", "layers.40")
    _rewrite_weights(path, lambda t: t.update({far: t[key].clone(), far.replace("lora_A", "lora_B"): t[key.replace("lora_A", "lora_B")].clone()}))
    with pytest.raises(LoRAAdapterError, match="is for layer 40; the model has 2"):
        _load(path)


def test_a_bad_adapter_leaves_the_slots_alone(tmp_path):
    model = _model()
    slots = LoRASlotManager(model, model.lora_config, torch.float32)
    good = LoRARequest("good", 1, _copy(tmp_path, "good"))
    slots.prepare([good])
    before = {name: buf.clone() for name, buf in model.named_buffers() if "lora_a" in name}
    bad_path = _copy(tmp_path, "bad")
    edit_config(bad_path, use_dora=True)
    with pytest.raises(LoRAAdapterError):
        slots.prepare([good, LoRARequest("bad", 2, bad_path)])
    assert slots.resident == {1: 0} and slots.cached == [1]
    assert all(torch.equal(buf, before[name]) for name, buf in model.named_buffers() if "lora_a" in name)
