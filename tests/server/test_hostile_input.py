"""Hostile input against a real server (issue 19): every request gets its 400 in OpenAI's error
shape naming the limit and the field, never a 500, and the server answers a normal request
correctly after each one.

The shared server has the default limits (the demo model's max_model_len is 512, so prompts
may have 512 x 32 = 16,384 characters). A second server, started through override_serve.py,
has settings without a flag yet (a raised character limit), a tokenizer that fails on a
marker, a broken route, and --max-queue-len 4.
"""
from __future__ import annotations

import http.client
import json
import threading

import httpx
import pytest

from tests.server.conftest import EAGER_ARGS, ServerProcess

PROMPT_CHARS = 512 * 32
REFERENCE = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
MARKER = "<<injected-tokenizer-fault>>"


@pytest.fixture(scope="module")
def reference_text(server) -> str:
    response = server.post("/v1/completions", REFERENCE)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _assert_error(response: httpx.Response, status: int, param, code: str, words: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["param"] == param and error["code"] == code, error
    assert words.lower() in error["message"].lower(), error
    return error


def _serves_correctly(server: ServerProcess, reference_text: str) -> None:
    response = server.post("/v1/completions", REFERENCE)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference_text


def _post_raw(server: ServerProcess, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, content=content, timeout=120,
                      headers={"content-type": "application/json", **(headers or {})})


# ----------------------------------------------------------------------------- nesting depth


def _nested(depth: int, kind: str) -> bytes:
    if kind == "array":
        return b"[" * depth + b"1" + b"]" * depth
    if kind == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b'[{"a":' * (depth // 2) + b"1" + b"}]" * (depth // 2)


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize("kind", ["array", "object", "mixed"])
@pytest.mark.parametrize("where", ["body", "field", "unknown", "message"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_deep_nesting_is_a_400(server, reference_text, path, where, kind, depth):
    nested = _nested(depth, kind)
    if where == "body":
        body = nested
    elif where == "message":
        body = b'{"messages": [{"role": "user", "content": ' + nested + b"}]}"
    else:
        name = b"prompt" if where == "field" else b"metadata"
        body = b'{"' + name + b'": ' + nested + b', "messages": [{"role": "user", "content": "hi"}]}'
    _assert_error(_post_raw(server, path, body), 400, None, "json_too_deep", "--max-json-depth 64")
    _serves_correctly(server, reference_text)


def test_nesting_up_to_the_limit_is_served(server, reference_text):
    """64 levels in all: the body's object, then 63 under an ignored field."""
    ok = dict(REFERENCE, metadata=json.loads(_nested(63, "array")))
    assert server.post("/v1/completions", ok).json()["choices"][0]["text"] == reference_text
    too_deep = dict(REFERENCE, metadata=json.loads(_nested(64, "array")))
    _assert_error(server.post("/v1/completions", too_deep), 400, None, "json_too_deep")


# ----------------------------------------------------------------------------- Unicode

SURROGATE_CASES = [
    # (route, body with the marker S where the lone surrogate goes, param, where in the message)
    ("/v1/completions", {"prompt": "aSb", "max_tokens": 2}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": ["fine", "S"], "max_tokens": 2}, "prompt", "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "stop": ["S"], "max_tokens": 2}, "stop", "stop[0]"),
    ("/v1/completions", {"prompt": "hi", "stop": "xS", "max_tokens": 2}, "stop", "stop"),
    ("/v1/completions", {"prompt": "hi", "model": "S"}, "model", "model"),
    ("/v1/completions", {"prompt": "hi", "user": "S"}, "user", "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "S"}]}, "messages", "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "S"}]}]},
     "messages", "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "S"}]}, "messages",
     "messages[0].name"),
    ("/tokenize", {"prompt": "S"}, "prompt", "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "S"}]}, "messages", "messages[0].content"),
    ("/detokenize", {"tokens": [5], "model": "S"}, "model", "model"),
]


@pytest.mark.parametrize("encoding", ["escape", "raw-bytes"])
@pytest.mark.parametrize("path,body,param,where", SURROGATE_CASES)
def test_lone_surrogates_are_a_400_naming_the_field(server, reference_text, path, body, param, where, encoding):
    text = json.dumps(body)  # ASCII: the marker S is the only capital S
    if encoding == "escape":
        content = text.replace("S", "\\ud800").encode()
    else:
        content = text.replace("S", "\ud800").encode("utf-8", "surrogatepass")
        assert b"\xed\xa0\x80" in content
    error = _assert_error(_post_raw(server, path, content), 400, param, "invalid_unicode", "surrogate")
    assert error["message"].startswith(where)
    _serves_correctly(server, reference_text)


def test_a_surrogate_in_a_key_is_a_400(server, reference_text):
    _assert_error(_post_raw(server, "/v1/completions", b'{"prompt": "hi", "\\udfff": 1}'), 400, None,
                  "invalid_unicode", "a key of the body")
    _serves_correctly(server, reference_text)


# ----------------------------------------------------------------------------- request limits

LIMIT_CASES = [
    # (route, body, param, code, words in the message)
    ("/v1/completions", {"prompt": "x" * (PROMPT_CHARS + 1)}, "prompt", "prompt_too_long", "--max-prompt-chars"),
    ("/v1/completions", {"prompt": ["hi", "x" * (PROMPT_CHARS + 1)]}, "prompt", "prompt_too_long", "prompt 1 has"),
    ("/v1/completions", {"prompt": "hello " * 200}, "prompt", "context_length_exceeded",
     "maximum context length is 512 tokens. However, the prompt has"),
    ("/v1/completions", {"prompt": [[5]] * 2 + [[5] * 512]}, "prompt", "context_length_exceeded",
     "This model's maximum context length is 512 tokens. However, prompt 2 has 512 tokens"),
    ("/v1/completions", {"prompt": ["a"] * 257}, "prompt", "too_many_prompts", "--max-prompts-per-request"),
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 128}, "n", "too_many_sequences", "--max-sequences-per-request"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, "stop", "too_many_stop_strings",
     "--max-stop-strings"),
    ("/v1/completions", {"prompt": "hi", "stop": "s" * 1025}, "stop", "stop_string_too_long",
     "--max-stop-string-chars"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(65))}, "stop_token_ids",
     "too_many_stop_token_ids", "--max-stop-token-ids"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed", "seed_out_of_range", "64-bit"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, "seed", "seed_out_of_range", "64-bit"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, "seed", "seed_out_of_range", "64-bit"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (PROMPT_CHARS + 1)}]}, "messages",
     "prompt_too_long", "--max-prompt-chars"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 2049}, "messages",
     "too_many_messages", "--max-messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]},
     "messages", "prompt_too_long", "the messages' text has 199999 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 200}]}, "messages",
     "context_length_exceeded", "maximum context length is 512 tokens. However, the rendered messages has"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed",
     "seed_out_of_range", "64-bit"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["s"] * 65}, "stop",
     "too_many_stop_strings", "at most 64"),
    ("/tokenize", {"prompt": "x" * (PROMPT_CHARS + 1)}, "prompt", "prompt_too_long", "--max-prompt-chars"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * (PROMPT_CHARS + 1)}]}, "messages",
     "prompt_too_long", "--max-prompt-chars"),
    ("/detokenize", {"tokens": [5] * 513}, "tokens", "too_many_tokens", "max_model_len"),
]


@pytest.mark.parametrize("path,body,param,code,words", LIMIT_CASES)
def test_request_limits_are_a_400_naming_the_limit(server, reference_text, path, body, param, code, words):
    _assert_error(server.post(path, {"max_tokens": 2, **body}), 400, param, code, words)
    _serves_correctly(server, reference_text)


def test_requests_at_the_limits_are_served(server):
    """The other side of each limit: what is exactly at it is served."""
    stops = {"prompt": "hi", "max_tokens": 2, "stop": ["s" * 1024] + [f"s{i}" for i in range(63)],
             "stop_token_ids": list(range(400, 464))}
    assert server.post("/v1/completions", stops).status_code == 200
    seeded = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2})
    assert seeded.status_code == 200 and len(seeded.json()["choices"]) == 2
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": -2**63}).status_code == 200
    tokenized = server.post("/tokenize", {"prompt": "x" * PROMPT_CHARS})
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
    assert server.post("/detokenize", {"tokens": [5] * 512}).status_code == 200


@pytest.mark.parametrize("prompt,code,words", [([5, -1], "prompt_out_of_range", "must be a token id in [0, "),
                                               ([5, 2**70], "prompt_out_of_range", "must be a token id in [0, "),
                                               ([[5], [7, 10**6]], None, "outside the vocabulary")])
def test_bad_token_ids_with_echo_are_a_400(server, reference_text, prompt, code, words):
    """echo decodes token-id prompts: only once the engine has accepted them (the tokenizer's
    binding raised OverflowError on a negative id, a 500)."""
    error = _assert_error(server.post("/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 2}),
                          400, "prompt", code, words)
    assert "token id" in error["message"]
    echoed = server.post("/v1/completions", {"prompt": [[5, 6]], "echo": True, "max_tokens": 2})
    expected = server.post("/detokenize", {"tokens": [5, 6]}).json()["prompt"]
    assert echoed.status_code == 200 and echoed.json()["choices"][0]["text"].startswith(expected)
    _serves_correctly(server, reference_text)


def test_a_15_mb_prompt_is_refused_before_tokenizing_while_health_answers(server, reference_text):
    """A 15 MB prompt used to hold the event loop in the tokenizer for about a minute."""
    content = json.dumps({"prompt": "The quick brown fox. " * 750_000}).encode()
    assert len(content) > 15_000_000
    result: dict[str, httpx.Response] = {}
    big = threading.Thread(target=lambda: result.update(r=_post_raw(server, "/tokenize", content)))
    big.start()
    try:
        health = httpx.get(server.url + "/health", timeout=60)
        assert health.status_code == 200
    finally:
        big.join(120)
    _assert_error(result["r"], 400, "prompt", "prompt_too_long", f"at most {PROMPT_CHARS}")
    _serves_correctly(server, reference_text)


def test_hostile_requests_leave_nothing_behind(server):
    server.wait_idle()


# ----------------------------------------------------------------------------- the override server


@pytest.fixture(scope="module")
def overridden():
    settings = {"max_prompt_chars": 4_000_000}
    env = {"VGRAPH_TEST_SETTINGS": json.dumps(settings), "VGRAPH_TEST_TOKENIZER_FAULT": MARKER,
           "VGRAPH_TEST_BREAK_VERSION": "1"}
    program = [__import__("sys").executable, "-m", "tests.server.override_serve"]
    proc = ServerProcess(*EAGER_ARGS, "--max-queue-len", "4", "--max-model-len", "256", program=program, env=env)
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def test_models_reports_the_engines_max_model_len(overridden):
    models = httpx.get(overridden.url + "/v1/models", timeout=10).json()["data"]
    assert [m["max_model_len"] for m in models] == [256]
    assert overridden.post("/tokenize", {"prompt": "hi"}).json()["max_model_len"] == 256
    _assert_error(overridden.post("/v1/completions", {"prompt": [5] * 256}), 400, "prompt", "context_length_exceeded",
                  "maximum context length is 256 tokens. However, the prompt has 256 tokens")


def test_a_large_prompt_is_tokenized_while_health_keeps_answering(overridden):
    """With the character limit raised, a 1 MB prompt takes the demo tokenizer seconds: on the
    tokenizer's thread, so /health answers before the big response starts. Before, the event
    loop was held by the tokenizer, and /health answered only after the big response had begun."""
    content = json.dumps({"prompt": "The quick brown fox. " * 50_000}).encode()
    sent, started = threading.Event(), threading.Event()

    def chunks():
        for start in range(0, len(content), 2**16):
            yield content[start:start + 2**16]
        sent.set()  # runs once the last chunk has been written

    result: dict[str, object] = {}

    def big() -> None:
        headers = {"content-type": "application/json", "content-length": str(len(content))}
        with httpx.stream("POST", overridden.url + "/tokenize", content=chunks(), headers=headers,
                          timeout=300) as response:
            started.set()
            result["status"], result["body"] = response.status_code, json.loads(response.read())

    thread = threading.Thread(target=big)
    thread.start()
    answered_before_the_big_response = 0
    try:
        assert sent.wait(60)
        while not started.is_set() and thread.is_alive():
            assert httpx.get(overridden.url + "/health", timeout=60).status_code == 200
            answered_before_the_big_response += not started.is_set()
    finally:
        thread.join(300)
    assert result["status"] == 200 and result["body"]["count"] > 100_000
    assert answered_before_the_big_response >= 1


def test_a_tokenizer_failure_is_a_logged_500_on_a_usable_connection(overridden):
    """The tokenizer raising something unexpected: a 500 in the error shape, one log line, no
    traceback, and the same keep-alive connection serves the next request."""
    connection = http.client.HTTPConnection("127.0.0.1", overridden.port, timeout=60)
    try:
        for path, body in [("/tokenize", {"prompt": f"a {MARKER} b"}),
                           ("/v1/completions", {"prompt": f"x {MARKER}", "max_tokens": 2})]:
            status, headers, error = _request(connection, "POST", path, body)
            assert status == 500 and error["error"]["code"] == "internal_error", error
            assert "injected tokenizer failure" in error["error"]["message"]
            assert headers.get("connection", "").lower() != "close"
            socket_before = connection.sock
            status, _, ok = _request(connection, "POST", "/tokenize", {"prompt": "fine"})
            assert status == 200 and ok["count"] > 0 and connection.sock is socket_before
    finally:
        connection.close()
    log = overridden.log()
    assert log.count("the tokenizer failed to encode the prompt: RuntimeError: injected tokenizer failure") == 2
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_an_exception_no_handler_takes_is_a_500_on_a_usable_connection(overridden):
    """Starlette's last resort sent its 500 and re-raised: uvicorn logged the traceback again and
    closed the keep-alive connection without a word to the client."""
    connection = http.client.HTTPConnection("127.0.0.1", overridden.port, timeout=60)
    try:
        status, headers, error = _request(connection, "GET", "/version", None)
        assert status == 500 and set(error["error"]) == {"message", "type", "param", "code"}
        assert headers.get("connection", "").lower() != "close"
        socket_before = connection.sock
        status, _, _ = _request(connection, "GET", "/health", None)
        assert status == 200 and connection.sock is socket_before
    finally:
        connection.close()
    log = overridden.log()
    assert "GET /version failed" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log


@pytest.mark.parametrize("changes,param", [({"prompt": ["a"] * 5}, "prompt"), ({"prompt": "a", "n": 5}, "n"),
                                           ({"prompt": ["a", "b", "c"], "n": 2}, "n")])
def test_more_sequences_than_the_queue_holds_is_a_400(overridden, changes, param):
    _assert_error(overridden.post("/v1/completions", {"max_tokens": 2, **changes}), 400, param,
                  "too_many_sequences", "--max-queue-len 4")
    fits = overridden.post("/v1/completions", {"prompt": ["a"] * 4, "max_tokens": 2})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4


def _request(connection: http.client.HTTPConnection, method: str, path: str, body) -> tuple[int, dict, dict]:
    payload = None if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"content-type": "application/json"}
    connection.request(method, path, body=payload, headers=headers)
    response = connection.getresponse()
    data = json.loads(response.read())
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data
