"""The tool-call parsers on their own: complete replies, replies streamed in every possible
split, and malformed calls (which stay plain content)."""
from __future__ import annotations

import json

import pytest

from vgraph.server.tool_parsers import ToolCall, get_parser
from vgraph.server.tools import MAX_PARALLEL_CALLS, FunctionTool, NamedCall, RequiredCalls, required_schema

HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"days": [1, {"x": "}]{"}]}}\n</tool_call>\n<tool_call>{"arguments": {"q": "a\\"b"}, '
              '"name": "search"}</tool_call>')
LLAMA_TWO = '<|python_tag|>{"name": "f", "parameters": {"q": "x y"}}; {"name": "g", "parameters": {}}'


def stream(parser, text: str, step: int) -> tuple[str, dict[int, list[str]], list[dict]]:
    """Feeds the text in pieces of ``step`` chars; returns content, {index: [name, arguments]}
    and the raw deltas."""
    streamer = parser.streamer()
    content, calls, raw = "", {}, []
    for end in list(range(step, len(text), step)) + [len(text)]:
        piece, deltas = streamer.feed(text[:end], end == len(text))
        content += piece
        for d in deltas:
            raw.append(d)
            entry = calls.setdefault(d.index, [None, ""])
            if d.name is not None:
                assert entry[0] is None, "a call's name is sent once, first"
                entry[0] = d.name
            else:
                assert entry[0] is not None, "arguments come after the name"
            entry[1] += d.arguments
    return content, calls, raw


def test_hermes_complete():
    content, calls = get_parser("hermes").parse(HERMES_TWO)
    assert content == "Let me check.\n\n"
    assert calls == [ToolCall("get_weather", '{"city": "Paris", "days": [1, {"x": "}]{"}]}'),
                     ToolCall("search", '{"q": "a\\"b"}')]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": [1, {"x": "}]{"}]}


def test_hermes_calls_separated_by_whitespace_have_no_content():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>\n'
    assert get_parser("hermes").parse(text) == (None, [ToolCall("f", "{}"), ToolCall("g", "{}")])
    for step in (1, 5):
        content, calls, _ = stream(get_parser("hermes"), text, step)
        assert content == "" and [c[0] for c in calls.values()] == ["f", "g"]


def test_hermes_unclosed_last_call_counts_when_its_json_is_complete():
    content, calls = get_parser("hermes").parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert content is None and calls == [ToolCall("f", '{"a": 1}')]


@pytest.mark.parametrize("text", [
    "just text",
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    "<tool_call",
])
def test_hermes_malformed_is_content(text):
    assert get_parser("hermes").parse(text) == (text, [])
    content, calls, _ = stream(get_parser("hermes"), text, 1)
    assert content == text and not calls


def test_hermes_call_broken_inside_its_arguments():
    """Whole: content. Streamed: the call was already begun when it broke (documented)."""
    text = '<tool_call>{"name": "f", "arguments": {"a": </tool_call>'
    assert get_parser("hermes").parse(text) == (text, [])
    content, calls, _ = stream(get_parser("hermes"), text, 1)
    assert content == text and calls == {0: ["f", '{"a": ']}


def test_hermes_malformed_region_stays_content_next_to_a_good_call():
    text = 'a <tool_call>oops</tool_call> b <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = get_parser("hermes").parse(text)
    assert content == "a <tool_call>oops</tool_call> b " and calls == [ToolCall("f", "{}")]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_streamed_equals_whole(step):
    content, calls, raw = stream(get_parser("hermes"), HERMES_TWO, step)
    whole_content, whole_calls = get_parser("hermes").parse(HERMES_TWO)
    assert content == whole_content
    assert [ToolCall(*calls[i]) for i in sorted(calls)] == whole_calls
    if step == 1:
        assert sum(1 for d in raw if d.index == 0 and d.name is None) > 5, "arguments stream in fragments"
        assert "<" not in content, "a partial <tool_call> tag is never sent as content"


def test_llama3_json_complete_and_streamed():
    parser = get_parser("llama3_json")
    assert parser.parse(LLAMA_TWO) == (None, [ToolCall("f", '{"q": "x y"}'), ToolCall("g", "{}")])
    assert parser.parse('{"name": "f", "arguments": {"a": 1}}') == (None, [ToolCall("f", '{"a": 1}')])
    assert parser.parse(' {"name": "f", "parameters": "{\\"a\\": 1}"}')[1] == [ToolCall("f", '{"a": 1}')]
    for step in (1, 4, 1000):
        content, calls, _ = stream(parser, LLAMA_TWO, step)
        assert content == ""
        assert [ToolCall(*calls[i]) for i in sorted(calls)] == parser.parse(LLAMA_TWO)[1]


@pytest.mark.parametrize("text", ["Hello there", '{"parameters": {}}', '{"name": "f", "parameters": "x"}',
                                  "<|python_tag|>oops", "<|pyth", ""])
def test_llama3_json_malformed_is_content(text):
    parser = get_parser("llama3_json")
    assert parser.parse(text) == (text, [])
    content, calls, _ = stream(parser, text, 1)
    assert content == text and not calls


def test_llama3_json_broken_after_its_arguments_began():
    """Whole: content. Streamed: the call was begun before the reply broke (documented)."""
    parser = get_parser("llama3_json")
    for text in ('{"name": "f", "parameters": {"a": 1}} trailing', '{"name": "f", "parameters": {"a": '):
        assert parser.parse(text) == (text, [])
        content, calls, _ = stream(parser, text, 1)
        assert content == text and calls[0][0] == "f"


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_parser("nope")


def test_forced_replies():
    named = NamedCall("f")
    assert named.parse('{"a": 1}') == (None, [ToolCall("f", '{"a": 1}')])
    content, calls, _ = stream(named, '{"a": 1}', 1)
    assert content == "" and calls == {0: ["f", '{"a": 1}']}
    text = '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{}}]'
    assert RequiredCalls().parse(text) == (None, [ToolCall("f", '{"a":1}'), ToolCall("g", "{}")])
    content, calls, _ = stream(RequiredCalls(), text, 1)
    assert calls == {0: ["f", '{"a":1}'], 1: ["g", "{}"]}


def test_required_schema_shape():
    tools = [FunctionTool("f", None, {"type": "object"}), FunctionTool("g", None, {"type": "object"})]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["f", "g"]
    assert required_schema(tools, parallel=True)["maxItems"] == MAX_PARALLEL_CALLS > 1
