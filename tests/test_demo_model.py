"""The built-in demo model: readable output from untrained weights, and rebuilt when stale."""
from __future__ import annotations

import os
import unicodedata
from pathlib import Path

import pytest

from vgraph import LLM, SamplingParams
from vgraph.models import demo


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    """By name, as a user writes it: built under $VGRAPH_CACHE_DIR, never looked up on the hub."""
    return LLM(demo.DEMO_MODEL_NAME, enforce_eager=True, device="cpu", cpu_kv_cache_gib=0.02)


def _unreadable(text: str) -> list[str]:
    return [c for c in text if c == "\ufffd" or (unicodedata.category(c) == "Cc" and c not in "\n\t")]


def test_unreadable_tokens_are_the_lone_bytes():
    tokenizer = demo.build_tokenizer()
    ids = set(demo.unreadable_token_ids(tokenizer))
    bytes_only = [i for i in ids if len(tokenizer.convert_ids_to_tokens(i)) == 1]
    assert len(bytes_only) == len(ids) > 100, "single bytes: C0 controls, DEL and every byte >= 0x80"
    assert tokenizer.eos_token_id not in ids and tokenizer.encode("\n")[0] not in ids


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_sampled_text_has_no_control_chars_or_replacement_chars(demo_llm, temperature):
    params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=200, ignore_eos=True)
              for seed in range(4)]
    outs = demo_llm.generate(["Hello", "The quick brown fox", "Once upon a time", "日本 🙂"], params,
                             use_tqdm=False)
    bad_ids = set(demo.unreadable_token_ids(demo_llm.get_tokenizer()))
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 200
        assert not bad_ids & set(completion.token_ids)
        assert _unreadable(completion.text) == [], completion.text


def test_a_stale_demo_copy_is_rebuilt(tmp_path):
    stale = tmp_path / demo.DEMO_MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # what an older vgraph left, without a build file
    path = Path(demo.ensure_demo_model(tmp_path))
    assert (path / "model.safetensors").is_file() and demo._is_current(path)
    assert os.listdir(tmp_path) == [demo.DEMO_MODEL_NAME], "the stale copy and temp dirs are gone"


def test_the_demo_name_resolves_to_the_built_in_model(tmp_path, monkeypatch):
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    assert demo.demo_model_path(demo.DEMO_MODEL_NAME) == str(tmp_path / "cache" / demo.DEMO_MODEL_NAME)
    assert demo.demo_model_path("Qwen/Qwen2.5-0.5B-Instruct") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / demo.DEMO_MODEL_NAME).mkdir()
    assert demo.demo_model_path(demo.DEMO_MODEL_NAME) is None, "a local directory of that name wins"


def test_engine_reports_the_demo_path(demo_llm):
    assert demo_llm.engine.config.model.model.endswith(os.sep + demo.DEMO_MODEL_NAME)
