"""Multi-LoRA served as a vLLM user runs it: ``--enable-lora --lora-modules name=path``, a
request's ``model`` selects the adapter (the openai client's tokens equal transformers + PEFT),
``/v1/models`` lists adapters with the base as parent, and ``/v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` change what is served at run time; bad adapters are 400s in
OpenAI's error shape and the server serves on."""
from __future__ import annotations

import functools
import json

import openai
import pytest
import transformers

from tests.checkpoints import tiny_checkpoint
from tests.lora.test_lora_engine import TOKENS, _loras, _oracle
from tests.server.conftest import EAGER_ARGS, ServerProcess
from vgraph.engine.detokenizer import IncrementalDetokenizer

PROMPT = [17, 230, 41, 99, 5, 311, 72, 8, 160]


@pytest.fixture(scope="module")
def lora_server():
    first = _loras()[0]
    proc = ServerProcess("--model", tiny_checkpoint(), "--served-model-name", "base", *EAGER_ARGS,
                         "--dtype", "float32", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                         "--lora-modules", f"first={first.lora_path}",
                         json.dumps({"name": "broken", "path": "/nowhere/at/all"}))
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def _text(server: ServerProcess, model: str) -> str:
    response = server.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": TOKENS,
                                               "temperature": 0.0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@functools.lru_cache(maxsize=None)
def _expected(adapter: int) -> str:
    """The oracle's greedy tokens (transformers + PEFT) as the server words them: through the
    same incremental detokenizer, which holds back an unfinished UTF-8 sequence at the end."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint())
    detokenizer = IncrementalDetokenizer(tokenizer, PROMPT)
    detokenizer.update(_oracle(adapter, tuple(PROMPT)))
    return detokenizer.output_text


def test_the_model_field_selects_the_adapter(lora_server):
    assert _text(lora_server, "first") == _expected(1)
    assert _text(lora_server, "base") == _expected(0)


def test_models_lists_adapters_with_their_parent_and_drops_a_broken_one(lora_server):
    models = {m.id: m for m in lora_server.client().models.list().data}
    assert set(models) == {"base", "first"}, "a --lora-modules entry it cannot serve is logged and not served"
    assert models["first"].model_extra["parent"] == "base"
    assert "cannot be served" in lora_server.log()


def test_load_use_and_unload_at_run_time(lora_server):
    second, third = _loras()[1], _loras()[2]
    response = lora_server.post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": second.lora_path})
    assert response.status_code == 200 and "second" in response.text
    assert lora_server.post("/v1/load_lora_adapter", {"lora_name": "third",
                                                      "lora_path": third.lora_path}).status_code == 200
    # Three adapters over two slots: each request's adapter is loaded into a slot it frees.
    for name, index in (("second", 2), ("third", 3), ("first", 1)):
        assert _text(lora_server, name) == _expected(index)
    again = lora_server.post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": second.lora_path})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert lora_server.post("/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        lora_server.client().completions.create(model="second", prompt="hi", max_tokens=1)
    gone = lora_server.post("/v1/unload_lora_adapter", {"lora_name": "second"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_bad_adapters_are_400s_and_the_server_serves_on(lora_server, tmp_path):
    broken = tmp_path / "rank-too-high"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 64, "lora_alpha": 8,
                                                             "target_modules": ["q_proj"]}))
    for path in (str(broken), str(tmp_path / "missing")):
        response = lora_server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "lora_path" and error["type"] == "invalid_request_error"
    assert lora_server.post("/v1/load_lora_adapter", {"lora_name": "base", "lora_path": str(broken)}
                            ).status_code == 400, "the base model's name is not an adapter's"
    assert _text(lora_server, "first") == _expected(1)
