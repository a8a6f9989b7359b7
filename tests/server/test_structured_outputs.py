"""Structured outputs through a real server and the official openai client: response_format
(json_object, json_schema) and vLLM's guided_* / structured_outputs extras on chat and
completions, streamed and not, n > 1, greedy and seeded; every output validates. Bad
constraints are 400s naming the field, and the server keeps answering."""
from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from tests.structured.cases import (CHOICES, CODE_REGEX, MAX_TOKENS, PERSON, check_choice, check_code,
                                    check_person, json_prefix_ok)

SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person."}]


def _stream_chat(client, model, **kwargs) -> dict[int, tuple[str, str]]:
    """Streams a chat completion; per choice index, the joined content and the finish reason."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kwargs):
        for choice in chunk.choices:
            texts.setdefault(choice.index, []).append(choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return {i: ("".join(parts), finish[i]) for i, parts in texts.items()}


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=4)])
def test_chat_json_schema_validates_streamed_and_not(client, model, sampling):
    response = client.chat.completions.create(model=model, messages=MESSAGES, n=3, max_tokens=MAX_TOKENS,
                                              response_format=SCHEMA_FORMAT, **sampling)
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        check_person(choice.message.content)
    streamed = _stream_chat(client, model, n=3, max_tokens=MAX_TOKENS, response_format=SCHEMA_FORMAT, **sampling)
    assert sorted(streamed) == [0, 1, 2]
    for text, reason in streamed.values():
        assert reason == "stop"
        check_person(text)
    assert [streamed[c.index][0] for c in response.choices] == [c.message.content for c in response.choices]


def test_chat_json_object_is_honest(client, model):
    response = client.chat.completions.create(model=model, messages=MESSAGES, n=4, max_tokens=48,
                                              temperature=0.8, seed=2, response_format={"type": "json_object"})
    for choice in response.choices:
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert json_prefix_ok(text), text


@pytest.mark.parametrize("extra, check", [
    ({"guided_json": PERSON}, check_person),
    ({"guided_json": json.dumps(PERSON)}, check_person),
    ({"guided_regex": CODE_REGEX}, check_code),
    ({"guided_choice": CHOICES}, check_choice),
    ({"structured_outputs": {"choice": CHOICES}}, check_choice),
    ({"structured_outputs": {"json": PERSON}}, check_person),
    ({"response_format": SCHEMA_FORMAT}, check_person),
])
def test_completions_constraints(client, model, extra, check):
    for sampling in (dict(temperature=0.0), dict(temperature=0.9, seed=8)):
        response = client.completions.create(model=model, prompt=["Hello", "Rain fell"], n=2,
                                             max_tokens=MAX_TOKENS, extra_body=extra, **sampling)
        assert len(response.choices) == 4
        for choice in response.choices:
            assert choice.finish_reason == "stop"
            check(choice.text)
        texts: dict[int, str] = {}
        for chunk in client.completions.create(model=model, prompt=["Hello", "Rain fell"], n=2, stream=True,
                                               max_tokens=MAX_TOKENS, extra_body=extra, **sampling):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert texts == {c.index: c.text for c in response.choices}


def test_guided_grammar(client, model):
    grammar = 'start: "(" num ("," num)? ")"\nnum: /[0-9]{1,3}/'
    response = client.completions.create(model=model, prompt="Hello", max_tokens=20, temperature=0.0,
                                         extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})?\)", response.choices[0].text)


def test_constrained_and_free_requests_share_batches(server, model):
    """Free requests sent together with constrained ones get the tokens they get alone."""
    client = server.async_client()

    async def free(prompt: str):
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def constrained(prompt: str):
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                            extra_body={"guided_json": PERSON})
        return r.choices[0].text

    async def run():
        alone = [await free(p) for p in ("Hello", "The sea")]
        mixed = await asyncio.gather(constrained("A"), free("Hello"), constrained("B"), free("The sea"),
                                     constrained("C"))
        return alone, mixed

    alone, mixed = asyncio.run(run())
    assert [mixed[1], mixed[3]] == alone
    for text in mixed[0::2]:
        check_person(text)


@pytest.mark.parametrize("route, extra, param, message", [
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "at most one"),
    ("completions", {"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "structured_outputs",
     "at most one"),
    ("completions", {"guided_regex": "[a-"}, "guided_regex", "invalid structured output regex"),
    ("completions", {"guided_json": {"type": "no-such-type"}}, "guided_json", "invalid structured output json"),
    ("completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format", "invalid structured output json"),
    ("completions", {"guided_grammar": "start: nothing_here"}, "guided_grammar", "invalid structured output grammar"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of"),
    ("completions", {"guided_regex": "a+", "min_tokens": 2}, "guided_regex", "min_tokens"),
])
def test_bad_constraints_are_400s_naming_the_field(client, model, route, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, extra_body=extra)
        else:
            client.completions.create(model=model, prompt="Hello", max_tokens=8, extra_body=extra)
    error = info.value.body
    assert error["param"] == param, error
    assert message in error["message"], error
    ok = client.completions.create(model=model, prompt="Hello", max_tokens=16, extra_body={"guided_choice": CHOICES})
    check_choice(ok.choices[0].text)
