"""Tools through the offline API: ``LLM.chat(tools=...)`` renders them with the chat template
exactly as transformers does, a structured-output schema forces a well-formed call, and a
template that never reads ``tools`` is a ValueError instead of tools silently dropped."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tests.checkpoints import tiny_checkpoint, tool_chat_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.structured import StructuredOutputsParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
CALL = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                         "arguments": WEATHER["function"]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tool_chat_checkpoint(), dtype="float32", device="cpu", num_gpu_blocks=256,
               max_model_len=1024, enforce_eager=True)


def test_tools_are_rendered_as_transformers_renders_them(llm):
    path = llm.engine.config.model.model
    hf = AutoTokenizer.from_pretrained(path)
    want = hf.apply_chat_template(MESSAGES, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "get_weather" in want
    assert llm.encode_chat(MESSAGES, tools=[WEATHER]) == hf.encode(want, add_special_tokens=False)
    assert llm.encode_chat(MESSAGES, tools=[WEATHER]) != llm.encode_chat(MESSAGES)


def test_a_schema_forces_a_valid_call(llm):
    params = SamplingParams(temperature=0, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(json=CALL))
    out = llm.chat(MESSAGES, params, tools=[WEATHER], use_tqdm=False)[0].outputs[0]
    call = json.loads(out.text)
    assert out.finish_reason == "stop"
    assert call["name"] == "get_weather" and call["arguments"]["city"] in ("Paris", "Oslo")


def test_a_template_without_tools_is_a_value_error():
    plain = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=64,
                enforce_eager=True)
    with pytest.raises(ValueError, match="never reads 'tools'"):
        plain.chat(MESSAGES, tools=[WEATHER], use_tqdm=False)
    assert plain.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
