"""``/v1/responses`` through the official ``openai`` client: the chat route's text for the same
conversation, streamed events in OpenAI's order, and 400s naming what is not supported."""
from __future__ import annotations

import json

import openai
import pytest

from vgraph.server.auth import _protected

SYSTEM = "You are terse."
TURNS = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "Again, please"}]
# The same turns in the Responses API's input forms: a short message, an earlier assistant turn as
# the output message OpenAI returned, and a message with input_text parts.
INPUT = [{"role": "user", "content": "Say hi"},
         {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
          "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again, please"}]}]
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _chat(client, model, messages, max_tokens):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)


def _check_against_chat(out, chat):
    (choice,) = chat.choices
    assert out.object == "response" and out.id.startswith("resp_") and out.output_text == choice.message.content
    assert out.output_text, "an empty text would prove nothing"
    assert out.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.status == out.status
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.usage.total_tokens == chat.usage.total_tokens


def test_string_input_equals_the_chat_routes_greedy_text(client, model):
    out = client.responses.create(model=model, input="Say hi", max_output_tokens=12, temperature=0,
                                  user="someone", metadata={"run": "1"})
    _check_against_chat(out, _chat(client, model, [{"role": "user", "content": "Say hi"}], 12))
    assert out.store is False and out.metadata == {"run": "1"} and out.model == model


def test_messages_with_instructions_equal_the_chat_routes_greedy_text(client, model):
    out = client.responses.create(model=model, instructions=SYSTEM, input=INPUT, max_output_tokens=12,
                                  temperature=0, store=False)
    chat = _chat(client, model, [{"role": "system", "content": SYSTEM}, *TURNS], 12)
    _check_against_chat(out, chat)
    assert out.instructions == SYSTEM


def test_streamed_events_and_text_equal_the_non_streamed(client, model):
    full = client.responses.create(model=model, instructions=SYSTEM, input=INPUT, max_output_tokens=16,
                                   temperature=0)
    events = list(client.responses.create(model=model, instructions=SYSTEM, input=INPUT, max_output_tokens=16,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == STREAM_ORDER and kinds[-4:-1] == CLOSING
    assert kinds[-1] == f"response.{full.status}"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[4:-4] == ["response.output_text.delta"] * len(deltas) and deltas
    text = "".join(e.delta for e in deltas)
    assert text == full.output_text == events[-4].text == events[-2].item.content[0].text
    final = events[-1].response
    assert final.output_text == full.output_text and final.status == full.status
    assert final.usage.model_dump() == full.usage.model_dump()
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert {e.item_id for e in deltas} == {events[2].item.id} == {final.output[0].id}


def test_the_stream_helper_reads_the_events(client, model):
    """``client.responses.stream`` parses every event; its text is the non-streamed text. (Its
    ``get_final_response`` wants ``response.completed``, which a reply cut by max_output_tokens
    does not end with, at OpenAI as here: the demo model never stops on its own.)"""
    full = client.responses.create(model=model, input="Hi", max_output_tokens=24, temperature=0)
    with client.responses.stream(model=model, input="Hi", max_output_tokens=24, temperature=0) as stream:
        events = list(stream)
    texts = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(texts) == full.output_text and events[-1].type == f"response.{full.status}"
    assert events[-1].response.output_text == full.output_text


def test_max_output_tokens_reached_is_incomplete(client, model):
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    out = client.responses.create(model=model, input="Say hi", max_output_tokens=3, temperature=0)
    if chat.choices[0].finish_reason != "length" or out.usage.output_tokens < 3:
        pytest.skip("the demo model stopped within 3 tokens")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output[0].status == "incomplete"
    events = list(client.responses.create(model=model, input="Say hi", max_output_tokens=3, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


REFUSED = [
    ("store", {"store": True}),
    ("previous_response_id", {"previous_response_id": "resp_123"}),
    ("conversation", {"conversation": "conv_123"}),
    ("background", {"background": True}),
    ("tools", {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
    ("tool_choice", {"tool_choice": "required"}),
    ("reasoning", {"reasoning": {"effort": "low"}}),
    ("include", {"include": ["message.output_text.logprobs"]}),
    ("text", {"text": {"format": {"type": "json_object"}}}),
    ("truncation", {"truncation": "auto"}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("prompt", {"prompt": {"id": "pmpt_1"}}),
    ("input", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}),
    ("input", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}),
    ("input", {"input": [{"type": "function_call_output", "call_id": "c", "output": "{}"}]}),
    ("input", {"input": [{"type": "item_reference", "id": "msg_1"}]}),
    ("input", {"input": ""}),
    ("input", {"input": []}),
    ("max_output_tokens", {"max_output_tokens": 0}),
    ("temperature", {"temperature": -1.0}),
    ("top_p", {"top_p": 1.5}),
]


@pytest.mark.parametrize("param,change", REFUSED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REFUSED)])
def test_unsupported_fields_are_a_400_naming_them(server, model, param, change):
    response = server.post("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 4, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_a_malformed_item_is_named_in_the_message(server, model):
    response = server.post("/v1/responses", {"model": model, "input": [{"role": "user", "content": "hi"},
                                                                        {"role": "tool", "content": "x"}]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "input" and "'input.1.role'" in error["message"], error


def test_the_openai_client_raises_bad_request_on_a_refusal(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="hi", previous_response_id="resp_1")
    assert caught.value.body["param"] == "previous_response_id"
    assert "keeps no responses" in caught.value.body["message"]


def test_neutral_values_of_refusable_fields_are_accepted(server, model):
    body = {"model": model, "input": "hi", "max_output_tokens": 2, "store": False, "background": False,
            "tools": [], "tool_choice": "auto", "reasoning": {"effort": None}, "include": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "parallel_tool_calls": False,
            "service_tier": "auto"}
    response = server.post("/v1/responses", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] <= 2


def test_unknown_model_is_a_404(server):
    response = server.post("/v1/responses", {"model": "nope", "input": "hi"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_sse_events_are_named(server, model):
    """Each event carries ``event: <type>`` as OpenAI's do, and no ``[DONE]`` line follows."""
    response = server.post("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 3, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in response.text.split("\n\n") if b.strip()]
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: "):])["type"] == event[len("event: "):]
    assert "[DONE]" not in response.text


def test_the_route_is_behind_the_api_key():
    assert _protected("/v1/responses") and _protected("/v1/responses/")
