"""``--api-key``, ``--max-queue-len`` and ``--chat-template`` on their own server."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.conftest import EAGER_ARGS, ServerProcess

KEY = "sk-test-0123456789"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[bot]"
PROTECTED_ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/demo-model-v1"), ("POST", "/v1/completions"),
                    ("POST", "/v1/chat/completions"), ("GET", "/v1/no-such-route"), ("POST", "/tokenize"),
                    ("POST", "/detokenize"), ("POST", "/v1/embeddings")]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = [a for a in EAGER_ARGS]
    args[args.index("--max-num-seqs") + 1] = "1"
    # One of the few servers with the engine on a thread (queue limits are the server's either way).
    proc = ServerProcess(*args, "--api-key", KEY, "--max-queue-len", "2", "--chat-template", str(template),
                         "--served-model-name", "guarded", "alias", "--engine-in-process")
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


@pytest.mark.parametrize("method,path", PROTECTED_ROUTES)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                                     {"Authorization": f"Bearer: {KEY}"}],
                         ids=["none", "wrong", "no-bearer", "basic", "longer", "colon"])
def test_every_v1_route_and_the_tokenizer_routes_need_the_key(guarded, method, path, headers):
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tokens": [5]}
    response = httpx.request(method, guarded.url + path, json=body if method == "POST" else None,
                             headers=headers, timeout=30)
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert set(error) == {"message", "type", "param", "code"}


def test_the_right_key_works_and_open_routes_stay_open(guarded):
    client = guarded.client(api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["guarded", "alias"]
    out = client.completions.create(model="alias", prompt="hi", max_tokens=3)
    assert out.model == "alias" and out.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").completions.create(model="guarded", prompt="hi", max_tokens=2)
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(guarded.url + path, timeout=10).status_code == 200, path
    assert guarded.post("/tokenize", {"prompt": "hi"}, headers=AUTH).status_code == 200
    assert guarded.post("/detokenize", {"tokens": [5]}, headers=AUTH).status_code == 200


@pytest.mark.parametrize("path", ["/tokenize/", "/detokenize/", "/v1/completions/", "/v1/models/",
                                  "/v1/chat/completions//"])
def test_trailing_slashes_are_checked_and_never_redirected(guarded, path):
    """A trailing slash is the same protected path: 401 without the key, before any redirect
    (which would build its Location from the client's Host header); with the key, a 404 (a 405
    where the slash makes another route's path: POST to ``/v1/models/{id}``)."""
    body = {"prompt": "hi", "tokens": [5]}
    for headers, statuses in [({"Host": "evil.example"}, {401}), ({**AUTH, "Host": "evil.example"}, {404, 405})]:
        response = httpx.post(guarded.url + path, json=body, headers=headers, timeout=30)
        assert response.status_code in statuses and "location" not in response.headers, (path, response.headers)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_two_authorization_headers_are_refused(guarded):
    """Two Authorization headers, the right key in either place: a 400, not the first one's verdict."""
    for pair in [[AUTH["Authorization"], "Bearer wrong"], ["Bearer wrong", AUTH["Authorization"]],
                 [AUTH["Authorization"]] * 2]:
        headers = httpx.Headers([("Authorization", value) for value in pair])
        response = httpx.post(guarded.url + "/tokenize", json={"prompt": "hi"}, headers=headers, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "duplicate_authorization"
    assert httpx.get(guarded.url + "/health", headers=httpx.Headers([("Authorization", "a"), ("Authorization", "b")]),
                     timeout=10).status_code == 200  # open routes ignore the header


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr"])
def test_the_scheme_is_case_insensitive(guarded, scheme):
    headers = {"Authorization": f"{scheme}  {KEY}"}
    assert httpx.get(guarded.url + "/v1/models", headers=headers, timeout=10).status_code == 200
    assert guarded.post("/tokenize", {"prompt": "hi"}, headers=headers).status_code == 200


def test_the_chat_template_flag_replaces_the_tokenizers(guarded):
    messages = [{"role": "user", "content": "hello"}]
    tokens = guarded.post("/tokenize", {"messages": messages}, headers=AUTH).json()["tokens"]
    assert guarded.post("/detokenize", {"tokens": tokens}, headers=AUTH).json()["prompt"] == "[user] hello\n[bot]"
    out = guarded.client(api_key=KEY).chat.completions.create(model="guarded", messages=messages, max_tokens=2)
    assert out.usage.prompt_tokens == len(tokens)


def test_tools_with_a_template_that_never_reads_them_are_a_400(guarded):
    """The demo model's own template supports tools; this server's --chat-template does not."""
    body = {"model": "guarded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}
    r = guarded.post("/v1/chat/completions", body, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and error["code"] == "tools_unsupported"
    assert "does not support tools" in error["message"]


def test_a_full_queue_answers_503_with_retry_after(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "guarded", "prompt": "Long story", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def hold(client: httpx.AsyncClient, release: asyncio.Event) -> None:
        async with client.stream("POST", guarded.url + "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            reader = asyncio.ensure_future(response.aread())
            await release.wait()
            reader.cancel()

    async def until(running: int, waiting: int) -> None:
        deadline = time.monotonic() + 60
        while True:
            m = await asyncio.to_thread(guarded.metrics)
            if m["vgraph:num_requests_running{engine=0}"] == running and m["vgraph:num_requests_waiting{engine=0}"] == waiting:
                return
            assert time.monotonic() < deadline, m
            await asyncio.sleep(0.05)

    async def main() -> httpx.Response:
        release = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client:
            holders = [asyncio.ensure_future(hold(client, release))]
            await until(running=1, waiting=0)  # --max-num-seqs 1: the only seat is taken
            holders += [asyncio.ensure_future(hold(client, release)) for _ in range(2)]
            await until(running=1, waiting=2)  # --max-queue-len 2: the queue is full
            refused = await client.post(guarded.url + "/v1/completions", headers=headers,
                                        json={"model": "guarded", "prompt": "one more", "max_tokens": 2})
            release.set()
            await asyncio.gather(*holders, return_exceptions=True)
        return refused

    refused = asyncio.run(main())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    guarded.wait_idle()
    out = guarded.client(api_key=KEY).completions.create(model="guarded", prompt="after", max_tokens=2)
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize("path,changes,param", [
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], [7], [8], [9]]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "n": 3}, "n"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
    ("/v1/embeddings", {"input": ["a", "b", "c"]}, "input"),
])
def test_a_request_that_can_never_fit_the_queue_is_a_400(guarded, path, changes, param):
    """--max-queue-len 2 counts sequences (prompts x n): more than 2 in one request could never
    be admitted, so it is a 400 saying so, not a 503 that retrying never cures."""
    body = {"model": "guarded", "max_tokens": 2, **changes}
    response = guarded.post(path, body, headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "too_many_sequences" and error["param"] == param, error
    assert "--max-queue-len 2" in error["message"] and "never" in error["message"]
    fits = guarded.post("/v1/completions", {"model": "guarded", "prompt": ["a", "b"], "max_tokens": 2}, headers=AUTH)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
