"""Checkpoint records: a later start reads what transformers resolved for the config and the
tokenizer class, and must build exactly what the first start built."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from tests.checkpoints import tiny_checkpoint
from vgraph.compiler.cache_key import model_fields
from vgraph.compiler.cache import stable_hash
from vgraph.models.checkpoint_record import CheckpointRecords, ModelConfigView, RECORD_FOLDER
from vgraph.models.llama import arch_spec
from vgraph.models.loader import checkpoint_dtype, load_hf_config, load_tokenizer
from vgraph.models.quantization import resolve_quantization
from vgraph.models.rotary import rope_parameters
from vgraph.testing.checkpoints import build_tiny_fp8_static_checkpoint

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def _what_the_engine_reads(config) -> dict:
    return {"spec": arch_spec(config), "rope": rope_parameters(config), "dtype": checkpoint_dtype(config),
            "quant": resolve_quantization(None, config), "key": stable_hash(model_fields(config)),
            "max_pos": config.max_position_embeddings, "arch": config.architectures}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_recorded_config_reads_as_transformers_resolved_it(tmp_path, arch) -> None:
    path = tiny_checkpoint(arch=arch)
    records = CheckpointRecords(tmp_path)
    first = load_hf_config(path, records)
    assert len(list((tmp_path / RECORD_FOLDER).iterdir())) == 1, "the first load records"
    second = load_hf_config(path, records)
    assert isinstance(first, ModelConfigView) and first == second
    expected = _what_the_engine_reads(AutoConfig.from_pretrained(path))
    assert _what_the_engine_reads(second) == expected


def test_an_fp8_checkpoint_keeps_its_quantization(tmp_path) -> None:
    path = build_tiny_fp8_static_checkpoint(tmp_path / "fp8")
    records = CheckpointRecords(tmp_path / "cache")
    load_hf_config(str(path), records)
    recorded = load_hf_config(str(path), records)
    quant = resolve_quantization(None, recorded)
    assert quant is not None and quant == resolve_quantization(None, AutoConfig.from_pretrained(path))


def test_the_view_is_read_only_and_missing_fields_are_attribute_errors() -> None:
    view = ModelConfigView({"hidden_size": 8, "rope_parameters": {"rope_theta": 10.0}})
    with pytest.raises(AttributeError, match="read-only"):
        view.hidden_size = 16
    assert getattr(view, "rope_scaling", None) is None
    view.to_dict()["rope_parameters"]["rope_theta"] = 1.0
    assert view.rope_parameters == {"rope_theta": 10.0}, "to_dict hands out a copy"
    import pickle
    assert pickle.loads(pickle.dumps(view)) == view


def test_an_edited_config_is_not_served_from_the_old_record(tmp_path) -> None:
    path = Path(shutil.copytree(tiny_checkpoint(arch="llama"), tmp_path / "ckpt"))
    records = CheckpointRecords(tmp_path / "cache")
    assert load_hf_config(str(path), records).rms_norm_eps != 0.125
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.125}))
    assert load_hf_config(str(path), records).rms_norm_eps == 0.125


def test_a_damaged_record_is_ignored(tmp_path, caplog) -> None:
    path = tiny_checkpoint(arch="qwen2")
    records = CheckpointRecords(tmp_path)
    load_hf_config(path, records)
    (record,) = (tmp_path / RECORD_FOLDER).iterdir()
    record.write_text("{not json")
    assert load_hf_config(path, records) == ModelConfigView(
        json.loads(json.dumps(AutoConfig.from_pretrained(path).to_dict(), default=str)))
    assert "ignoring the checkpoint record" in caplog.text


@pytest.mark.parametrize("arch", ARCHS)
def test_a_recorded_tokenizer_equals_autotokenizer(tmp_path, monkeypatch, arch) -> None:
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path))
    path = tiny_checkpoint(arch=arch)
    load_tokenizer(path)  # records the class
    assert any(p.name.endswith(".json") for p in (tmp_path / RECORD_FOLDER).iterdir())
    recorded, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(recorded) is type(auto)
    text = "def f(x):\n    return x + 1  # héllo <s> wörld"
    assert recorded(text)["input_ids"] == auto(text)["input_ids"]
    assert recorded.all_special_tokens == auto.all_special_tokens and recorded.eos_token_id == auto.eos_token_id
    messages = [{"role": "user", "content": "hi"}]
    if auto.chat_template:
        assert (recorded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_a_recorded_start_imports_no_transformers_config_module(tmp_path) -> None:
    """Modules loaded from a file count; transformers 5.17 registers ~200 file-less aliases of
    renamed modules (``image_processing_*_fast``) on ``import transformers``, which cost nothing."""
    path = tiny_checkpoint(arch="llama")
    script = ("import sys\nfrom vgraph.models.loader import load_hf_config, load_tokenizer\n"
              f"load_hf_config({path!r}); load_tokenizer({path!r})\n"
              "print(sorted(m for m, module in list(sys.modules.items()) if m.startswith(('transformers.models.', "
              "'torch._dynamo')) and getattr(module, '__file__', None)))")
    env = {"VGRAPH_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "transformers.models.llama" in first.stdout, "the first start asks transformers"
    second = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "[]", second.stdout
