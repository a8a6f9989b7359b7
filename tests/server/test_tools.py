"""Tool calling through a real server and the official openai client, on the tiny model with a
Qwen2.5-style tool template and ``--tool-call-parser hermes``: required and named tool_choice
are enforced (so even a random model always returns valid calls), auto returns plain content
when the model writes no call, multi-turn tool messages render, streaming deltas accumulate in
the client's stream helper; and the 400s."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.checkpoints import tool_chat_checkpoint
from tests.server.conftest import EAGER_ARGS, ServerProcess

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                              "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server():
    proc = ServerProcess(tool_chat_checkpoint(), *EAGER_ARGS, "--tool-call-parser", "hermes",
                         "--served-model-name", "m")
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


@pytest.fixture(scope="module")
def tclient(tool_server) -> openai.OpenAI:
    return tool_server.client()


def _check_calls(tool_calls, names=None) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=3)])
def test_named_function_is_enforced(tclient, sampling):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = tclient.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice, n=2,
                                        max_tokens=64, **sampling)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls, {"get_weather"})


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=5)])
def test_required_is_enforced(tclient, sampling):
    r = tclient.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=3,
                                        parallel_tool_calls=False, max_tokens=64, **sampling)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        assert len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls)


def test_required_parallel_calls_are_each_valid(tclient):
    r = tclient.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        temperature=0.0, max_tokens=200)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":
        _check_calls(c.message.tool_calls)
    else:  # the array ran past max_tokens: every call before the cut-off one is valid
        assert c.finish_reason == "length"
        for call in c.message.tool_calls[:-1]:
            _check_calls([call])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_calls_accumulate_in_the_openai_stream_helper(tclient, tool_choice):
    kwargs = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=64,
                  temperature=0.0, parallel_tool_calls=False)
    whole = tclient.chat.completions.create(**kwargs).choices[0]
    with tclient.chat.completions.stream(**kwargs) as stream:
        deltas = [e for e in stream if e.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    _check_calls(final.message.tool_calls)
    pieces = [d for e in deltas for ch in e.chunk.choices for d in (ch.delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name and pieces[0].type == "function"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 2, "arguments arrive in several fragments"


def test_auto_without_a_call_is_plain_content(tclient):
    for stream in (False, True):
        kwargs = dict(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=0.0)
        if stream:  # (the stream helper refuses to finish a reply cut at max_tokens: read the chunks)
            content, reasons = "", []
            for chunk in tclient.chat.completions.create(stream=True, **kwargs):
                for ch in chunk.choices:
                    assert not ch.delta.tool_calls
                    content += ch.delta.content or ""
                    reasons.append(ch.finish_reason)
            assert content and "<tool_call>" not in content and reasons[-1] in ("stop", "length")
            continue
        c = tclient.chat.completions.create(**kwargs).choices[0]
        assert "<tool_call>" not in (c.message.content or "")
        assert c.message.content and not c.message.tool_calls
        assert c.finish_reason in ("stop", "length")
    free = tclient.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=8)
    assert free.choices[0].message.content is not None and not free.choices[0].message.tool_calls


def test_multi_turn_tool_messages_render(tclient, tool_server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = tclient.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")
    tokens = tool_server.post("/tokenize", {"messages": history}).json()["tokens"]
    text = tool_server.post("/detokenize", {"tokens": tokens}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


@pytest.mark.parametrize("extra, param, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": 7}}}]},
     "tool_choice", "invalid structured output json"),
])
def test_bad_tool_requests_are_400s(tclient, extra, param, message):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        tclient.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, extra_body=body)
    assert info.value.body["param"] == param and message in info.value.body["message"], info.value.body
    ok = tclient.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].message.content is not None


def test_auto_parses_a_call_the_model_writes(tclient):
    """A reply that holds a hermes call (forced here with a regex, as a random model will not
    write one) comes back as tool_calls, whole and streamed."""
    regex = (r'Checking\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
             r'\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 3\}\}\n</tool_call>')
    kwargs = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=200, temperature=0.0,
                  extra_body={"guided_regex": regex})
    whole = tclient.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking. \n"
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert calls == [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 3})]
    with tclient.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Checking. \n"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in final.message.tool_calls] == calls
    assert len({t.id for t in final.message.tool_calls}) == 2
