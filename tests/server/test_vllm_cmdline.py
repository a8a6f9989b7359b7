"""Issue 37's "done when": ``vgraph serve`` started with a typical ``vllm serve`` command line
(prefix caching, auto tool choice with the hermes parser, ``-tp 1``, ``--dtype half``, an fp8 KV
cache, ``-O`` JSON, ``--generation-config auto``, ``--disable-log-requests``) serves the clients a
vLLM user points at it: the official openai client, litellm and LangChain's ChatOpenAI.

The server is the built-in demo model (float16 here, as ``--dtype half`` asks, also on CPU) with
its hermes tool template. Tool calls are checked for shape, not for what a 4.5 MB model would
choose: a named ``tool_choice`` (LangChain's ``bind_tools(..., tool_choice=name)``) is enforced by
the server, so the call is always complete and schema-valid (given a closed schema: see the
LangChain test). Slow: the ``-O`` level compiles the
model (about 15 s on 2 cores when the compile cache is cold).
"""
from __future__ import annotations

import json
import os
from typing import Literal

import jsonschema
import openai
import pytest

from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.slow

VLLM_COMMAND_LINE = [
    "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "-tp", "1",
    "--dtype", "half", "--kv-cache-dtype", "fp8", "-O", '{"level": 3, "cudagraph_capture_sizes": [1, 2, 4, 8]}',
    "--generation-config", "auto", "--disable-log-requests",
]
# vgraph's own settings for a small CPU test machine: a small KV pool and few seats.
CPU_SIZING = ["--device", "cpu", "--kv-cache-gib", "0.05", "--max-num-seqs", "8"]
MODEL = "demo-model-v1"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                                 "parameters": CITY}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def vllm_server():
    proc = ServerProcess(*VLLM_COMMAND_LINE, *CPU_SIZING)
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


@pytest.fixture(scope="module")
def client(vllm_server) -> openai.OpenAI:
    return vllm_server.client()


def test_the_flags_took_effect(vllm_server, client):
    log = vllm_server.log()
    assert "KV cache (float8_e4m3fn):" in log and "float16" in log
    assert "compiled" in log and "served by" in log, "-O level 3 compiles"
    client.completions.create(model=MODEL, prompt="import os\n", max_tokens=4, temperature=0)
    assert " finished: prompt tokens " not in vllm_server.log(), "--disable-log-requests"


def test_openai_client_chat_completions_and_a_tool_call(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    text = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=12, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens == 12
    again = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=12, temperature=0)
    assert again.choices[0].text == text.choices[0].text, "greedy repeats itself over the prefix cache"
    named = {"type": "function", "function": {"name": "get_weather"}}
    call = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice=named,
                                          max_tokens=64)
    assert call.choices[0].finish_reason == "tool_calls"
    (tool_call,) = call.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather"
    jsonschema.validate(json.loads(tool_call.function.arguments), CITY)


def test_litellm_completion_and_its_context_window_error(vllm_server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list (offline CI)
    litellm = pytest.importorskip("litellm")
    common = dict(model=f"openai/{MODEL}", api_base=vllm_server.url + "/v1", api_key="unused", num_retries=0)
    reply = litellm.completion(messages=QUESTION, max_tokens=8, temperature=0, **common)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=QUESTION, max_tokens=100000, **common)


def test_langchain_invoke_and_a_bound_tool(vllm_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """Forecast for a city."""
        return "sunny"

    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=vllm_server.url + "/v1", api_key="unused",
                                       max_tokens=64, temperature=0)
    message = chat.invoke("Write a Python function that adds two numbers.")
    assert message.content and message.response_metadata["finish_reason"] in ("stop", "length")
    # strict: LangChain closes the schema (additionalProperties false), as OpenAI's strict mode does;
    # an open one lets the model add properties until max_tokens.
    bound = chat.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    answer = bound.invoke("What is the weather in Paris?")
    assert [call["name"] for call in answer.tool_calls] == ["get_weather"]
    assert answer.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")
