"""Hypothesis strategies for the server fuzz suite (``test_fuzz.py``).

Request bodies are built from the request models' fields: each field of ``CompletionRequest``,
``ChatCompletionRequest``, ``TokenizeRequest`` and ``DetokenizeRequest`` has a strategy for
well-formed, cheap values (``GOOD``; the suite checks that every model field has one), and any
field can be replaced by a hostile value: the wrong JSON type, an out-of-range or huge number
(2**70, 10**100, a 5,000-digit literal, ``1e400``), an empty or 100,000-element list, nested
junk. Unknown fields with junk values are added too.

Bodies are serialized here rather than with ``json.dumps`` so that a body can hold what a
Python value cannot: number literals written verbatim (``Raw``), objects with repeated keys
(``Pairs``), and a lone surrogate either as a ``\\ud800`` escape (``ensure_ascii``) or as raw
bytes ``ED A0 80`` (the string is encoded with ``surrogatepass``).

Cost control: the server under test runs a real model on a shared 2-core machine, so a
well-formed body asks for at most 4 new tokens, 3 choices and 3 prompts, and the hostile values
for the fields that multiply work (``n``, ``max_tokens``, the prompt list) are either invalid or
small. Explosions (n x prompts) have their own strategy with sizes that must be refused.
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional

from hypothesis import strategies as st

from vgraph.models.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from vgraph.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest)
from vgraph.server.responses_protocol import ResponsesRequest

MODEL = DEMO_MODEL_NAME
VOCAB = json.loads((DEMO_MODEL_DIR / "config.json").read_text(encoding="utf-8"))["vocab_size"]
MAX_NEW = 4  # new tokens in a well-formed request


class Raw:
    """Bytes written into the body verbatim (a number literal Python cannot hold, bad UTF-8)."""

    def __init__(self, data: str | bytes) -> None:
        self.data = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data

    def __repr__(self) -> str:
        shown = self.data if len(self.data) <= 40 else self.data[:40] + b"..."
        return f"Raw({shown!r}, {len(self.data)} bytes)"


class Pairs:
    """A JSON object written from (key, value) pairs, so keys may repeat."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs

    def __repr__(self) -> str:
        return f"Pairs({self.pairs!r})"


def dumps(value: Any, ensure_ascii: bool = True) -> bytes:
    """JSON bytes for ``value``; strings with lone surrogates become ``\\udXXX`` escapes when
    ``ensure_ascii`` and raw (invalid) UTF-8 bytes ``ED xx xx`` otherwise."""
    if isinstance(value, Raw):
        return value.data
    if value is None:
        return b"null"
    if value is True:
        return b"true"
    if value is False:
        return b"false"
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("use Raw for non-finite numbers")
        return repr(value).encode()
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(dumps(v, ensure_ascii) for v in value) + b"]"
    if isinstance(value, dict):
        value = Pairs(list(value.items()))
    if isinstance(value, Pairs):
        return b"{" + b",".join(dumps(k, ensure_ascii) + b":" + dumps(v, ensure_ascii)
                                for k, v in value.pairs) + b"}"
    raise TypeError(f"cannot serialize {type(value).__name__}")


# ----------------------------------------------------------------------------- hostile values

EDGE_INTS = [0, -1, 1, 2, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -2**63,
             -2**63 - 1, 2**64 - 1, 2**64, 2**70, -2**70, 10**100]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.0000001, -2.0000001, 1e-7, 5e-324, 1e-320, 1e308, -1e308,
               2.0**63, 3.4e38]
RAW_NUMBERS = ["1e400", "-1e400", "1e-400", "-0", "1E2", "1.0e0", "1" + "0" * 5000, "-" + "9" * 5000,
               "0." + "0" * 5000 + "1", "2e308"]
ODD_STRINGS = ["", " ", "null", "true", "0", "-1", "1e400", "\x00", "\u2028", "\ufeff", "\U0001f600",
               "demo-model-v1", "<s>", "</s>", "<|user|>", "{{ raise_exception('x') }}", "{%", "a" * 10_000,
               "\\ud800", "%s%n", "../../etc/passwd"]


def texts(max_size: int = 20, min_size: int = 0) -> st.SearchStrategy[str]:
    """Any Unicode text except lone surrogates (hypothesis leaves those out; they are a class)."""
    return st.text(min_size=min_size, max_size=max_size)


def numbers() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(EDGE_INTS), st.integers(), st.sampled_from(EDGE_FLOATS),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.sampled_from(RAW_NUMBERS).map(Raw))


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), numbers(), texts(), st.sampled_from(ODD_STRINGS))


def junk() -> st.SearchStrategy[Any]:
    """Nested JSON junk: scalars in lists and objects a few levels deep."""
    return st.recursive(scalars(), lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(texts(8), inner, max_size=4)), max_leaves=12)


def huge_lists() -> st.SearchStrategy[list]:
    """Empty to 100,000-element lists of one non-string scalar (strings would be prompts: an
    explosion, which has its own class)."""
    element = st.one_of(st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(0, VOCAB - 1),
                        st.just({}), st.just([]))
    return st.builds(lambda v, n: [v] * n, element, st.sampled_from([0, 1, 1000, 100_000]))


def bad_values() -> st.SearchStrategy[Any]:
    """A hostile replacement for any field."""
    return st.one_of(junk(), numbers(), huge_lists(), st.sampled_from(ODD_STRINGS))


# Fields whose value multiplies the work of a request: their hostile values must be invalid
# (rejected before any work) or small, so one example never costs seconds of model time.
COSTLY = {"n", "best_of", "max_tokens", "max_completion_tokens", "max_output_tokens", "prompt", "messages", "input"}


def cheap_bad_values() -> st.SearchStrategy[Any]:
    ints = st.one_of(st.sampled_from([v for v in EDGE_INTS if v <= 2 or v > 4096]),
                     st.integers(max_value=0), st.integers(min_value=10**6))
    return st.one_of(st.none(), st.booleans(), ints, st.sampled_from(EDGE_FLOATS),
                     st.sampled_from(RAW_NUMBERS).map(Raw), st.sampled_from(ODD_STRINGS), huge_lists(),
                     st.dictionaries(texts(8), scalars(), max_size=3), st.lists(scalars(), max_size=3))


# ----------------------------------------------------------------------------- well-formed values

def token_ids(max_size: int = 8) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_size)


def prompts() -> st.SearchStrategy[Any]:
    return st.one_of(texts(min_size=1), st.lists(texts(min_size=1), min_size=1, max_size=3), token_ids(),
                     st.lists(token_ids(), min_size=1, max_size=3))


def content_parts() -> st.SearchStrategy[list]:
    part = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts()}),
                     st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "text", ""])},
                                           optional={"text": st.one_of(st.none(), texts())}))
    return st.lists(part, max_size=3)


def messages() -> st.SearchStrategy[list]:
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
         "content": st.one_of(texts(), st.none(), content_parts())},
        optional={"name": texts(10), "tool_call_id": texts(10)})
    return st.lists(message, min_size=1, max_size=3)


def response_inputs() -> st.SearchStrategy[Any]:
    """``/v1/responses`` input: a string, or messages in the short and typed forms with text
    parts, and items it refuses (image parts, tool calls, references)."""
    part = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": texts()}),
                     st.fixed_dictionaries({"type": st.sampled_from(["input_image", "input_file", "refusal", ""])},
                                           optional={"text": st.one_of(st.none(), texts())}))
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
         "content": st.one_of(texts(), st.none(), st.lists(part, max_size=3))},
        optional={"type": st.sampled_from(["message", "function_call", "item_reference"]), "id": texts(10)})
    return st.one_of(texts(min_size=1), st.lists(message, min_size=1, max_size=3))


def _generation_fields() -> dict[str, st.SearchStrategy[Any]]:
    probability = st.floats(0.01, 1.0)
    return {
        "model": st.sampled_from([MODEL, None]),
        "n": st.integers(1, 3),
        "temperature": st.one_of(st.none(), st.just(0.0), st.floats(0.0, 2.0)),
        "top_p": st.one_of(st.none(), probability),
        "top_k": st.one_of(st.none(), st.sampled_from([-1, 0, 1, 5, 50, 10**6])),
        "min_p": st.one_of(st.none(), st.floats(0.0, 1.0)),
        "seed": st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
        "presence_penalty": st.one_of(st.none(), st.floats(-2.0, 2.0)),
        "frequency_penalty": st.one_of(st.none(), st.floats(-2.0, 2.0)),
        "repetition_penalty": st.one_of(st.none(), st.floats(0.01, 2.0)),
        "stop": st.one_of(st.none(), texts(5, min_size=1), st.lists(texts(5, min_size=1), max_size=4)),
        "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=4)),
        "include_stop_str_in_output": st.booleans(),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 1),
        "skip_special_tokens": st.booleans(),
        "stream": st.one_of(st.none(), st.booleans()),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "logit_bias": st.one_of(st.none(), st.just({})),
        "user": st.one_of(st.none(), texts()),
        # Structured outputs, bounded so a constrained request ends within MAX_NEW tokens.
        "response_format": st.sampled_from([None, {"type": "text"}, {}, {"type": "json_object"},
                                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                                "enum": ["a", "b"]}}}]),
        "guided_json": st.sampled_from([None, {"type": "integer", "minimum": 0, "maximum": 9}]),
        "guided_regex": st.sampled_from([None, "[ab]{1,3}"]),
        "guided_choice": st.sampled_from([None, ["x", "y"]]),
        "guided_grammar": st.sampled_from([None, 'start: "a" | "b"']),
        "structured_outputs": st.sampled_from([None, {"choice": ["p", "q"]}]),
    }


GOOD: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/v1/completions": {
        **_generation_fields(),
        "prompt": prompts(),
        "max_tokens": st.integers(1, MAX_NEW),
        "logprobs": st.one_of(st.none(), st.integers(0, 5)),
        "echo": st.booleans(),
        "best_of": st.none(),  # or n: set in request_bodies
        "suffix": st.sampled_from([None, ""]),
    },
    "/v1/chat/completions": {
        **_generation_fields(),
        "messages": messages(),
        "max_tokens": st.integers(1, MAX_NEW),
        "max_completion_tokens": st.integers(1, MAX_NEW),
        "logprobs": st.booleans(),
        "top_logprobs": st.one_of(st.none(), st.integers(0, 5)),
        "add_generation_prompt": st.booleans(),
        "echo": st.just(False),  # true is a 400 in chat (completions only)
        "tools": st.sampled_from([None, [], [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
            "additionalProperties": False}}}]]),
        "tool_choice": st.sampled_from([None, "none", "auto", "required",
                                        {"type": "function", "function": {"name": "f"}}]),
        "parallel_tool_calls": st.sampled_from([None, False]),
    },
    "/v1/responses": {
        "model": st.sampled_from([MODEL, None]),
        "input": response_inputs(),
        "instructions": st.one_of(st.none(), texts()),
        "max_output_tokens": st.integers(1, MAX_NEW),
        "temperature": st.one_of(st.none(), st.just(0.0), st.floats(0.0, 2.0)),
        "top_p": st.one_of(st.none(), st.floats(0.01, 1.0)),
        "stream": st.one_of(st.none(), st.booleans()),
        "user": st.one_of(st.none(), texts()),
        "metadata": st.one_of(st.none(), st.dictionaries(texts(8), texts(8), max_size=3)),
        "store": st.sampled_from([None, False, True]),
        "previous_response_id": st.sampled_from([None, "resp_1"]),
        "conversation": st.sampled_from([None, "conv_1"]),
        "background": st.sampled_from([None, False, True]),
        "tools": st.sampled_from([None, [], [{"type": "function", "name": "f"}]]),
        "tool_choice": st.sampled_from([None, "none", "auto", "required"]),
        "reasoning": st.sampled_from([None, {}, {"effort": None}, {"effort": "low"}]),
        "include": st.sampled_from([None, [], ["message.output_text.logprobs"]]),
        "text": st.sampled_from([None, {}, {"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                                 {"format": "text"}, {"format": 3}]),
        "truncation": st.sampled_from([None, "disabled", "auto"]),
        "top_logprobs": st.one_of(st.none(), st.integers(0, 5)),
        "prompt": st.sampled_from([None, {"id": "pmpt_1"}]),
    },
    "/tokenize": {
        "model": st.sampled_from([MODEL, None]),
        "prompt": texts(40),
        "messages": messages(),
        "add_special_tokens": st.booleans(),
        "add_generation_prompt": st.booleans(),
    },
    "/detokenize": {
        "model": st.sampled_from([MODEL, None]),
        "tokens": st.lists(st.integers(0, VOCAB - 1), max_size=20),
    },
}

MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
REQUIRED = {"/v1/completions": ("prompt", "max_tokens"), "/v1/chat/completions": ("messages",),
            "/v1/responses": ("input", "max_output_tokens"), "/tokenize": (), "/detokenize": ("tokens",)}
POST_ROUTES = tuple(GOOD)


def _one_of_tokenize_inputs(draw: Any, body: dict[str, Any]) -> None:
    """``/tokenize`` wants exactly one of prompt and messages: usually keep one."""
    if "prompt" in body and "messages" in body and draw(st.integers(0, 3)):
        del body[draw(st.sampled_from(["prompt", "messages"]))]
    elif "prompt" not in body and "messages" not in body and draw(st.integers(0, 3)):
        body["prompt"] = draw(GOOD["/tokenize"]["prompt"])


def _cheap(route: str, body: dict[str, Any]) -> None:
    """Keeps a request that the server would accept cheap: a bounded number of new tokens."""
    if route == "/v1/chat/completions":
        if not (_small_int(body.get("max_tokens")) or _small_int(body.get("max_completion_tokens"))):
            if body.get("max_completion_tokens") is None:
                body["max_tokens"] = MAX_NEW
    elif route == "/v1/completions" and "max_tokens" in body and body["max_tokens"] is None:
        body["max_tokens"] = MAX_NEW
    elif route == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = MAX_NEW


def _small_int(value: Any) -> bool:
    return type(value) is int and 1 <= value <= MAX_NEW


@st.composite
def request_bodies(draw: Any, route: str) -> dict[str, Any]:
    """A body for ``route``: well-formed fields, some replaced by hostile values, unknown fields."""
    fields = GOOD[route]
    body: dict[str, Any] = {}
    for name, strategy in fields.items():
        if name in REQUIRED[route] or draw(st.integers(0, 3)) == 0:
            body[name] = draw(strategy)
    if route == "/tokenize":
        _one_of_tokenize_inputs(draw, body)
    if body.get("stream_options") is not None and not body.get("stream") and draw(st.booleans()):
        body["stream"] = True
    if route == "/v1/completions" and draw(st.integers(0, 7)) == 0:
        body["best_of"] = body.get("n", 1)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = draw(cheap_bad_values() if name in COSTLY else bad_values())
    if draw(st.integers(0, 7)) == 0 and body:
        del body[draw(st.sampled_from(sorted(body)))]
    if draw(st.integers(0, 3)) == 0:
        extra = draw(st.dictionaries(texts(12).filter(lambda k: k not in fields), junk(), min_size=1, max_size=3))
        body.update(extra)
    _cheap(route, body)
    return body


# ----------------------------------------------------------------------------- hostile classes

LONE_SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)


@st.composite
def with_surrogate(draw: Any, route: str) -> tuple[dict[str, Any], str]:
    """A well-formed cheap body with a lone surrogate spliced into one of its strings (or a key);
    returns the body and where the surrogate went."""
    body = draw(minimal_bodies(route))
    s = draw(LONE_SURROGATES)
    text = draw(st.sampled_from(["{}", "a{}", "{}b", "x{}y{}"])).replace("{}", s)
    spots = {"/v1/completions": ["prompt", "prompt[]", "stop", "user", "model", "key"],
             "/v1/chat/completions": ["content", "content_part", "name", "stop", "role", "model", "key"],
             "/v1/responses": ["input", "instructions", "user", "model", "key"],
             "/tokenize": ["prompt", "content", "model", "key"],
             "/detokenize": ["model", "key"]}[route]
    spot = draw(st.sampled_from(spots))
    if spot == "prompt":
        body["prompt"] = text
    elif spot == "prompt[]":
        body["prompt"] = ["fine", text]
    elif spot in ("content", "content_part", "name", "role"):
        message = {"role": "user", "content": "hi"}
        if spot == "content_part":
            message["content"] = [{"type": "text", "text": text}]
        else:
            message[spot] = text
        body.pop("prompt", None)
        body["messages"] = [message]
    elif spot == "stop":
        body["stop"] = [text]
    elif spot == "key":
        body[text] = 1
    else:
        body[spot] = text
    return body, spot


MINIMAL = {"/v1/completions": {"prompt": "hello", "max_tokens": 2},
           "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
           "/v1/responses": {"input": "hi", "max_output_tokens": 2},
           "/tokenize": {"prompt": "hello"},
           "/detokenize": {"tokens": [10, 20]}}


def minimal_bodies(route: str) -> st.SearchStrategy[dict[str, Any]]:
    """The simplest well-formed cheap body for ``route``, with or without the model's name."""
    return st.fixed_dictionaries({k: st.just(v) for k, v in MINIMAL[route].items()},
                                 optional={"model": st.just(MODEL)}).map(lambda d: json.loads(json.dumps(d)))


@st.composite
def deep_bodies(draw: Any, route: str) -> tuple[bytes, int]:
    """A body nested ``depth`` (1,000-100,000) levels deep: the whole body, a field's value, an
    unknown field's value, or inside a message; arrays, objects or both alternating."""
    depth = draw(st.one_of(st.sampled_from([1000, 1001, 5000, 10_000, 100_000]), st.integers(1000, 100_000)))
    kind = draw(st.sampled_from(["array", "object", "mixed"]))
    leaf = draw(st.sampled_from([b"", b"1", b'"x"', b"null"]))
    if kind == "array":
        nested = b"[" * depth + leaf + b"]" * depth
    elif kind == "object":
        nested = b'{"a":' * depth + (leaf or b"1") + b"}" * depth
    else:
        half = depth // 2
        nested = b'[{"a":' * half + (leaf or b"1") + b"}]" * half
    where = draw(st.sampled_from(["body", "field", "unknown", "message"]))
    field = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/v1/responses": "input",
             "/tokenize": "prompt", "/detokenize": "tokens"}[route]
    base = draw(minimal_bodies(route))
    if where == "body":
        return nested, depth
    if where == "field":
        base[field] = Raw(nested)
    elif where == "unknown":
        base["metadata"] = Raw(nested)
    else:
        base.pop("prompt", None)
        base["messages"] = [{"role": "user", "content": Raw(nested)}]
    return dumps(base), depth


@st.composite
def invalid_utf8_bodies(draw: Any, route: str) -> bytes:
    """A well-formed body with bytes that are not UTF-8 spliced into one of its strings (or its
    structure): stray continuation bytes, overlong forms, truncated sequences, code points above
    U+10FFFF, UTF-16 byte order marks, Latin-1."""
    bad = draw(st.one_of(
        st.sampled_from([b"\xff", b"\xfe", b"\x80", b"\xbf", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf",
                         b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80",
                         b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80", b"caf\xe9"]),
        st.binary(min_size=1, max_size=8).filter(lambda b: not _is_utf8(b))))
    body = dumps(draw(minimal_bodies(route)))
    marker = {"/v1/completions": b'"hello"', "/v1/chat/completions": b'"hi"', "/v1/responses": b'"hi"',
              "/tokenize": b'"hello"', "/detokenize": b"[10"}[route]
    at = body.index(marker) + 1
    where = draw(st.sampled_from(["string", "before", "after", "key"]))
    if where == "string":
        return body[:at] + bad + body[at:]
    if where == "before":
        return bad + body
    if where == "after":
        return body + bad
    return body[:1] + b'"' + bad + b'":1,' + body[1:]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def non_object_bodies() -> st.SearchStrategy[bytes]:
    """Bodies that are not one JSON object: other JSON values, empty or blank, truncated, with
    trailing data, NaN/Infinity, comments, single quotes, a BOM, UTF-16, form data."""
    values = st.one_of(scalars(), st.lists(junk(), max_size=4)).map(dumps)
    syntax = st.sampled_from([
        b"", b" ", b"\n", b"{", b"}", b"[", b'{"prompt": "hi"', b'{"prompt": "hi"}}', b'{"prompt": "hi"} {}',
        b'{"prompt": "hi", }', b"{'prompt': 'hi'}", b'{"prompt": NaN}', b'{"prompt": "hi", "temperature": Infinity}',
        b'{"prompt": "hi", "temperature": -Infinity}', b'{"prompt": "hi" /* c */}', b'{prompt: "hi"}',
        b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}', b"null", b"\x00", b"prompt=hi&max_tokens=1",
        '{"prompt": "hi", "max_tokens": 1}'.encode("utf-16"), '{"prompt": "hi"}'.encode("utf-32"),
        b'{"prompt": "\\x41"}', b'{"prompt": "\\u12"}', b'{"prompt": "tab\there"}', b"[]" * 1000])
    return st.one_of(values.filter(lambda b: not b.startswith(b"{")), syntax)


CONTENT_TYPES = ["", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/jsonx", "application/json-patch+json", "application/ld+json", "json",
                 "application/", "/json", "application/json; charset=latin-1", "application/json;charset=utf-16",
                 "APPLICATION/JSON", "application/json ;", "application/json;;;", "application/json, text/plain",
                 "text/json", "application/octet-stream", "*/*", "application/json\tx", "application/json; q=0"]


def content_types() -> st.SearchStrategy[str]:
    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)  # h11 sends these
    return st.one_of(st.sampled_from(CONTENT_TYPES), printable.map(lambda t: t.strip(" \t")))


@st.composite
def auth_headers(draw: Any, key: str) -> Optional[bytes]:
    """An Authorization header value: right and wrong keys under every spelling of the scheme,
    odd whitespace, other schemes, non-ASCII bytes, and values up to 60 KB (the whole header
    block stays under the server's 64 KiB limit)."""
    scheme = draw(st.sampled_from(["Bearer", "bearer", "BEARER", "BeArEr", "Basic", "Token", "", "Bearer:"]))
    secret = draw(st.one_of(st.just(key), st.just(key.upper()), st.just(key[:-1]), st.just(key + "x"),
                            st.just(""), st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                                                 max_size=30),
                            st.integers(1, 60_000).map(lambda n: "k" * n)))
    sep = draw(st.sampled_from([" ", "  ", "\t", ""]))
    value = f"{scheme}{sep}{secret}".encode("latin-1", "replace")
    if draw(st.integers(0, 7)) == 0:
        value += draw(st.sampled_from([b"\xff", b"\xc3\xa9", b"\x80"]))
    return None if draw(st.integers(0, 9)) == 0 else sendable(value)


def sendable(value: bytes) -> bytes:
    """What an HTTP client can put in a header: no control characters, no surrounding blanks
    (h11, on both ends, refuses the first and strips the second)."""
    return bytes(b for b in value if (b >= 0x20 and b != 0x7F) or b == 0x09).strip(b" \t")


@st.composite
def explosions(draw: Any) -> tuple[dict[str, Any], int]:
    """n x prompts: either tiny (at most 8 sequences, must be served) or at least 10,000
    sequences in one request (must be refused up front: a 4xx, not hours of work or a 503)."""
    n = draw(st.one_of(st.sampled_from([1, 2, 8, 127, 128]), st.integers(1, 128)))
    small = draw(st.booleans())
    if small:
        n = min(n, 8)
        count = draw(st.integers(1, 8 // n))
    else:
        count = draw(st.one_of(st.sampled_from([10_000, 100_000]), st.integers(-(-10_000 // n), 100_000)))
    element = draw(st.sampled_from(["a", "hello world", [5], [5, 6, 7]]))
    return {"prompt": [element] * count, "n": n, "max_tokens": 1}, n * count


@st.composite
def stop_lists(draw: Any) -> dict[str, Any]:
    """Huge stop lists: up to 100,000 stop strings, or strings of up to 1 MB."""
    count = draw(st.sampled_from([0, 1, 4, 100, 10_000, 100_000]))
    length = draw(st.sampled_from([1, 10, 1000, 1_000_000]))
    while count * length > 4_000_000:  # a few MB: under the 16 MiB body limit, and quick
        length //= 10
    word = draw(st.sampled_from(["x", "\u00e9", "\U0001f600", "ab"]))
    stops = [word * max(1, length) + str(i) for i in range(count)]
    body = {"prompt": "hello", "max_tokens": draw(st.integers(1, MAX_NEW)), "stop": stops}
    if draw(st.booleans()):
        body["stream"] = True
    if draw(st.booleans()):
        body["include_stop_str_in_output"] = True
    return body


def seeds() -> st.SearchStrategy[Any]:
    """Seeds at and past the 64-bit limits (torch's generator takes 64 bits)."""
    return st.one_of(st.sampled_from([2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64 - 1, 2**64, 2**70, -2**70,
                                      10**100, -10**100]),
                     st.integers(min_value=2**64), st.integers(max_value=-2**63 - 1),
                     st.integers(-2**63, 2**63 - 1), st.sampled_from(RAW_NUMBERS).map(Raw))
