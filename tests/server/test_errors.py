"""Every bad request gets its status and OpenAI's error shape, and the server keeps serving."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

LONG = [7] * 600  # longer than the demo model's max_model_len (512)

COMPLETION_CASES = [
    # (body changes, expected status, expected param or None, words in the message)
    ({"prompt": LONG}, 400, "prompt", "This model's maximum context length is 512 tokens. However, the prompt has 600"),
    ({"prompt": [7] * 400, "max_tokens": 200}, 400, "max_tokens",
     "This model's maximum context length is 512 tokens. However, you requested 600 tokens (400 in the prompt, "
     "200 in the completion). Please reduce the length of the prompt or completion."),
    ({"prompt": ""}, 400, None, "empty"),
    ({"prompt": []}, 400, "prompt", "empty"),
    ({"prompt": [5, 100000]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": [5, -1]}, 400, "prompt", "must be a token id in [0, 2147483647]"),
    ({"prompt": [5, 2**64]}, 400, "prompt", "must be a token id in [0, 2147483647]"),
    ({"stop_token_ids": [100000]}, 400, "stop_token_ids", "outside the vocabulary"),
    ({"top_k": 2**70}, 400, "top_k", "[-1, 2147483647]"),
    ({"prompt": ["fine", ""]}, 400, None, "prompt 1"),
    ({"temperature": -1.0}, 400, "temperature", "temperature"),
    ({"top_p": 0.0}, 400, "top_p", "top_p"),
    ({"top_p": 1.5}, 400, "top_p", "top_p"),
    ({"top_k": -2}, 400, "top_k", "top_k"),
    ({"min_p": 2.0}, 400, "min_p", "min_p"),
    ({"presence_penalty": 3.0}, 400, "presence_penalty", "presence_penalty"),
    ({"frequency_penalty": -2.5}, 400, "frequency_penalty", "frequency_penalty"),
    ({"repetition_penalty": 0.0}, 400, "repetition_penalty", "repetition_penalty"),
    ({"min_tokens": 10, "max_tokens": 5}, 400, "min_tokens", "min_tokens"),
    ({"stop": [""]}, 400, "stop", "stop strings"),
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids"),
    ({"logprobs": 6}, 400, "logprobs", "maximum of 5"),
    ({"logprobs": -1}, 400, "logprobs", "logprobs"),
    ({"n": 0}, 400, "n", "n must be"),
    ({"n": 1000}, 400, "n", "in [1, 128]"),
    ({"max_tokens": 0}, 400, "max_tokens", "only allowed with echo"),
    ({"max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ({"max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ({"temperature": True}, 400, "temperature", "valid number"),
    ({"prompt": [1, "a"]}, 400, "prompt", "prompt"),
    ({"prompt": None}, 400, "prompt", "prompt"),
    ({"stop": 5}, 400, "stop", "stop"),
    ({"stream": "yes"}, 400, "stream", "stream"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ({"logit_bias": {"5": 1.0}}, 400, "logit_bias", "not supported"),
    ({"suffix": "end"}, 400, "suffix", "not supported"),
    ({"best_of": 3}, 400, "best_of", "not supported"),
    ({"echo": True, "logprobs": 6}, 400, "logprobs", "maximum of 5"),
    ({"model": "no-such-model"}, 404, "model", "does not exist"),
]

CHAT_CASES = [
    ({"messages": []}, 400, "messages", "empty"),
    ({"messages": "hi"}, 400, "messages", "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "role"),
    ({"messages": [{"content": "hi"}]}, 400, "messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages", "only text"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 6}, 400, "top_logprobs", "maximum of 5"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens", "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ({"echo": True}, 400, "echo", "not supported in chat"),
    ({"max_completion_tokens": 600}, 400, "max_completion_tokens", "in the messages, 600 in the completion). Please "
     "reduce the length of the messages or completion."),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "--tool-call-parser"),
    ({"response_format": {"type": "xml"}}, 400, "response_format", "json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format",
     "needs a 'schema'"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ({"temperature": "hot"}, 400, "temperature", "valid number"),
    ({"model": "no-such-model"}, 404, "model", "does not exist"),
]


def _assert_error(response: httpx.Response, status: int, param=None, words: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert words.lower() in error["message"].lower(), error
    if param is not None:
        assert error["param"] == param, error
    return error


def _still_serving(client, model) -> None:
    out = client.completions.create(model=model, prompt="ok", max_tokens=2)
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize("changes,status,param,words", COMPLETION_CASES)
def test_bad_completion_requests(server, client, model, changes, status, param, words):
    body = {"model": model, "prompt": "hello", "max_tokens": 4, **changes}
    _assert_error(server.post("/v1/completions", body), status, param, words)
    _still_serving(client, model)


@pytest.mark.parametrize("changes,status,param,words", CHAT_CASES)
def test_bad_chat_requests(server, client, model, changes, status, param, words):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **changes}
    _assert_error(server.post("/v1/chat/completions", body), status, param, words)
    _still_serving(client, model)


@pytest.mark.parametrize("content,content_type,words", [
    (b'{"prompt": "hi", ', "application/json", "malformed JSON"),
    (b'{"prompt": NaN}', "application/json", "malformed JSON"),
    (b"\xff\xfe", "application/json", "malformed JSON"),
    (b"[1, 2]", "application/json", "JSON object"),
    (b'"hello"', "application/json", "JSON object"),
    (b'{"prompt": "hi"}', "text/plain", "Content-Type"),
    (b'{"prompt": "hi"}', None, "Content-Type"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_bodies(server, client, model, path, content, content_type, words):
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(server.url + path, content=content, headers=headers, timeout=30)
    error = _assert_error(response, 400, words=words)
    assert error["type"] == "invalid_request_error"
    _still_serving(client, model)


def test_body_size_limit(server, client, model):
    huge = json.dumps({"model": model, "prompt": "x" * (17 * 2**20)}).encode()
    response = httpx.post(server.url + "/v1/completions", content=huge,
                          headers={"content-type": "application/json"}, timeout=60)
    _assert_error(response, 413, words="exceeds")
    _still_serving(client, model)


def test_header_size_limit(server, client, model):
    """Headers over 64 KiB are refused by the HTTP parser: a 400, or (when the server closes
    while the client is still sending) a reset connection; either way nothing reaches the app."""
    try:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"},
                              headers={"x-padding": "a" * (128 * 1024)}, timeout=30)
        assert response.status_code == 400
    except httpx.TransportError:  # reset, broken pipe or a half-read response: all "refused"
        pass
    _still_serving(client, model)


def test_unknown_routes_and_methods_use_the_error_shape(server, client, model):
    _assert_error(httpx.get(server.url + "/v1/nothing-here", timeout=10), 404)
    _assert_error(httpx.get(server.url + "/v1/completions", timeout=10), 405)
    _assert_error(httpx.get(server.url + "/v1/models/no-such-model", timeout=10), 404, "model")
    _still_serving(client, model)


def test_tokenize_and_detokenize_errors(server, client, model):
    _assert_error(server.post("/tokenize", {}), 400, "prompt", "exactly one")
    _assert_error(server.post("/tokenize", {"prompt": "a", "messages": []}), 400, "prompt", "exactly one")
    _assert_error(server.post("/detokenize", {"tokens": [1, 100000]}), 400, "tokens", "outside the vocabulary")
    _assert_error(server.post("/detokenize", {"tokens": "abc"}), 400, "tokens")
    _assert_error(server.post("/tokenize", {"prompt": "a", "model": "nope"}), 404, "model")
    _still_serving(client, model)


def test_the_openai_client_maps_errors_to_its_exceptions(client, model):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=True,
                                       max_completion_tokens=0)


def test_bad_requests_leave_nothing_behind(server):
    server.wait_idle()
