"""Fuzzing every route of one real ``vgraph serve`` with generated and hostile requests.

One eager server on the demo model, with ``--api-key``, serves the whole module. Every
example, whatever it sends, must satisfy:

- no 5xx (the server is idle, so not even a 503: a request it can never serve is a 4xx);
- the response arrives complete (no reset or truncated body; a stream ends with ``[DONE]``);
- a 4xx has OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``; nothing
  is redirected (no trailing-slash 307 built from the client's Host header);
- a 2xx is a well-formed answer to what was asked (choice counts, token counts, SSE events);
- afterwards, on the same keep-alive connection, a greedy completion gives the same text as
  before the fuzzing started; ``/health`` answers 200 after each test's examples.

Bodies come from ``fuzz_strategies``: every field of the request models, with right and wrong
types, out-of-range and huge numbers, empty and huge lists, nested junk and unknown fields; and
the hostile classes: lone surrogates (``\\ud800`` escapes and raw ``ED A0 80`` bytes), nesting
1,000-100,000 deep, invalid UTF-8, bodies that are not one JSON object, wrong content types,
huge stop lists, n x prompts explosions, seeds past 64 bits, and every spelling of the
``Authorization`` header.

Example counts are sized for CI: about 1,000 examples in all, 60-90 s on 2 cores plus the
server's start. ``VGRAPH_FUZZ_EXAMPLES=N`` runs N examples for every test instead (e.g. 5000 for
a long run: hours).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import urllib.parse
from dataclasses import dataclass
from typing import Any, Optional

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")  # in the dev extras
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

from tests.server import fuzz_strategies as fs  # noqa: E402
from tests.server.conftest import EAGER_ARGS, ServerProcess  # noqa: E402

# Hypothesis caches Unicode tables under its home directory (.hypothesis/ in the working
# directory by default): keep the checkout clean.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "vgraph-hypothesis"))

KEY = "sk-fuzz-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"model": fs.MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
ERROR_FIELDS = {"message", "type", "param", "code"}
OVERRIDE = int(os.environ.get("VGRAPH_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    """Hypothesis settings for one test: ``examples`` in CI, ``$VGRAPH_FUZZ_EXAMPLES`` if set;
    no deadline (a shared 2-core machine), no example database (nothing written to the tree)."""
    return settings(max_examples=OVERRIDE or examples, deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server():
    proc = ServerProcess(*EAGER_ARGS, "--api-key", KEY, "--engine-in-process")  # one of the few in-process servers
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


@pytest.fixture(scope="module")
def http(fuzz_server):
    """One keep-alive client for the fuzz requests and the checks after them, so that a
    connection left in a bad state by one request is caught by the next."""
    with httpx.Client(base_url=fuzz_server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(http) -> str:
    """The greedy text before any fuzzing."""
    response = http.post("/v1/completions", json=GREEDY, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture(autouse=True)
def _healthy_after_each_test(request):
    """After each test's examples: ``/health`` still answers 200."""
    yield
    if "http" in request.fixturenames:
        health = request.getfixturevalue("http").get("/health")
        assert health.status_code == 200, health.text


# ----------------------------------------------------------------------------- the invariants


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    body: bytes
    method: str

    def json(self) -> Any:
        return json.loads(self.body)


def send(http: httpx.Client, method: str, path: str, content: Optional[bytes] = None,
         content_type: Optional[str] = "application/json", headers: Optional[dict] = None,
         auth: bool = True, timeout: float = 60) -> Answer:
    """Sends one request and reads the whole response; a reset, a refused connection or a
    truncated body fails the example."""
    all_headers: dict[str, Any] = dict(AUTH) if auth else {}
    if content_type is not None:
        all_headers["Content-Type"] = content_type
    all_headers.update(headers or {})
    try:
        response = http.request(method, path, content=content, headers=all_headers, timeout=timeout)
    except httpx.TimeoutException:
        pytest.fail(f"{method} {path}: no complete answer within {timeout} s")
    except httpx.TransportError as exc:
        pytest.fail(f"{method} {path}: the connection failed instead of a response: {type(exc).__name__}: {exc}")
    return Answer(response.status_code, response.headers, response.content, method)


def check_answer(answer: Answer, route: str, body: Any = None) -> None:
    """No 5xx; a 4xx in OpenAI's shape; a 2xx well-formed for ``route`` and ``body``."""
    shown = answer.body[:600]
    assert answer.status < 500, f"{answer.status} from {route}: {shown!r}"
    if answer.status >= 400:
        if answer.method == "HEAD":
            return
        error = error_of(answer)
        assert error["message"], shown
        return
    assert not 300 <= answer.status < 400, f"{answer.status} redirect from {route} to {answer.headers.get('location')}"
    assert 200 <= answer.status < 300, f"{answer.status} from {route}: {shown!r}"
    if answer.method == "HEAD":
        return
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(answer, route, body)
    elif route == "/metrics":
        assert b"vgraph:" in answer.body
    else:
        check_json_answer(answer.json(), route, body)


def error_of(answer: Answer) -> dict[str, Any]:
    shown = answer.body[:600]
    assert answer.headers.get("content-type", "").startswith("application/json"), shown
    obj = answer.json()
    assert isinstance(obj, dict) and set(obj) == {"error"}, shown
    error = obj["error"]
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS, shown
    assert isinstance(error["message"], str) and isinstance(error["type"], str), shown
    assert error["param"] is None or isinstance(error["param"], str), shown
    assert error["code"] is None or isinstance(error["code"], str), shown
    return error


def expected_choices(route: str, body: Any) -> Optional[int]:
    """How many choices a successful answer to ``body`` has, when the body says so plainly."""
    if not isinstance(body, dict) or route == "/v1/responses":
        return None
    n = body.get("n", 1)
    if type(n) is not int:
        return None
    if route == "/v1/chat/completions":
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(x) is int for x in prompt)):
        return n
    return n * len(prompt) if isinstance(prompt, list) else None


def max_new(route: str, body: Any) -> Optional[int]:
    if not isinstance(body, dict):
        return None
    names = {"/v1/chat/completions": ("max_completion_tokens", "max_tokens"), "/v1/responses": ("max_output_tokens",)}
    for name in names.get(route, ("max_tokens",)):
        if type(body.get(name)) is int:
            return body[name]
    return None


def forces_a_call(body: Any) -> bool:
    """A chat request whose reply must be a tool call: tool_choice "required" or a named
    function (it was answered, so its tools were valid)."""
    choice = body.get("tool_choice") if isinstance(body, dict) else None
    return choice == "required" or isinstance(choice, dict)


def check_forced_call(choice: dict) -> None:
    """The reply is the call's JSON, never content: whole calls end it ("tool_calls"), and one
    cut by max_tokens ("length") returns only the calls that were complete (server/tools.py)."""
    message = choice["message"]
    assert message["content"] is None, choice
    if choice["finish_reason"] == "tool_calls":
        assert message["tool_calls"], choice
    else:
        assert choice["finish_reason"] == "length", choice


def check_json_answer(obj: Any, route: str, body: Any) -> None:
    assert isinstance(obj, dict), obj
    if route in ("/v1/completions", "/v1/chat/completions"):
        chat = route == "/v1/chat/completions"
        assert obj["object"] == ("chat.completion" if chat else "text_completion"), obj
        choices = obj["choices"]
        want = expected_choices(route, body)
        if want is not None:
            assert sorted(c["index"] for c in choices) == list(range(want)), obj
        for c in choices:
            if chat and forces_a_call(body):
                check_forced_call(c)
                continue
            assert c["finish_reason"] in ("stop", "length"), c
            text = c["message"]["content"] if chat else c["text"]
            assert isinstance(text, str), c
        usage = obj["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
        limit = max_new(route, body)
        if limit is not None:
            assert usage["completion_tokens"] <= limit * len(choices), (usage, limit)
    elif route == "/v1/responses":
        check_response(obj, body)
    elif route == "/tokenize":
        assert obj["count"] == len(obj["tokens"]), obj
        assert all(type(t) is int and 0 <= t < fs.VOCAB for t in obj["tokens"]), obj
    elif route == "/detokenize":
        assert isinstance(obj["prompt"], str), obj
    elif route == "/v1/models":
        assert [m["id"] for m in obj["data"]] == [fs.MODEL], obj
    elif route.startswith("/v1/models/"):
        assert obj["id"] == fs.MODEL, obj
    elif route == "/health":
        assert obj == {"status": "ok"}, obj
    elif route == "/version":
        assert isinstance(obj["version"], str), obj


def check_response(obj: dict[str, Any], body: Any) -> None:
    """A ``/v1/responses`` answer: one message whose text is a string, usage adding up, within
    ``max_output_tokens``."""
    assert obj["object"] == "response" and obj["status"] in ("completed", "incomplete"), obj
    (item,) = obj["output"]
    assert item["type"] == "message" and isinstance(item["content"][0]["text"], str), obj
    usage = obj["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], usage
    limit = max_new("/v1/responses", body)
    if limit is not None:
        assert usage["output_tokens"] <= limit, (usage, limit)


def check_response_stream(answer: Answer, body: Any) -> None:
    """Responses API events: numbered from 0, no error, ending in the finished response (no
    ``[DONE]`` in this API)."""
    events = [json.loads(line[len(b"data: "):]) for line in answer.body.split(b"\n") if line.startswith(b"data: ")]
    assert events and [e["sequence_number"] for e in events] == list(range(len(events))), answer.body[-300:]
    assert all(e["type"] not in ("error", "response.failed") for e in events), answer.body[-300:]
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    check_response(events[-1]["response"], body)


def check_stream(answer: Answer, route: str, body: Any) -> None:
    """Every event is JSON without an error, the last one is ``[DONE]``, and every choice
    finished exactly once."""
    if route == "/v1/responses":
        check_response_stream(answer, body)
        return
    events = [line[len(b"data: "):] for line in answer.body.split(b"\n") if line.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", answer.body[-300:]
    finished: dict[int, int] = {}
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            if c.get("finish_reason") is not None:
                finished[c["index"]] = finished.get(c["index"], 0) + 1
    want = expected_choices(route, body)
    if want is not None:
        assert finished == {i: 1 for i in range(want)}, (finished, want)


def assert_still_serving(http: httpx.Client, reference: str) -> None:
    """The same greedy text as before the fuzzing, on the connection the example used (so a
    connection left in a bad state fails the example that left it)."""
    try:
        response = http.post("/v1/completions", json=GREEDY, headers=AUTH)
    except httpx.TransportError as exc:
        pytest.fail(f"the follow-up request failed: {type(exc).__name__}: {exc}")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference, response.text


def post(http: httpx.Client, route: str, body: Any, ensure_ascii: bool = True, **kwargs) -> Answer:
    return send(http, "POST", route, fs.dumps(body, ensure_ascii), **kwargs)


# ----------------------------------------------------------------------------- request fields


def test_every_model_field_has_a_strategy():
    """The generated bodies cover every field the request models define, so a new field
    gets fuzzed (add its well-formed values to ``fuzz_strategies.GOOD``)."""
    for route, model in fs.MODELS.items():
        assert set(fs.GOOD[route]) == set(model.model_fields), route


@pytest.mark.parametrize("route,examples", [("/v1/completions", 150), ("/v1/chat/completions", 150),
                                            ("/v1/responses", 100),
                                            ("/tokenize", 80), ("/detokenize", 60)])
def test_request_fields(http, reference, route, examples):
    @fuzz(examples)
    @given(body=fs.request_bodies(route), ensure_ascii=st.booleans())
    def run(body, ensure_ascii):
        check_answer(post(http, route, body, ensure_ascii), route, body)
        assert_still_serving(http, reference)

    run()


GET_PATHS = ["/v1/models", f"/v1/models/{fs.MODEL}", "/health", "/version", "/metrics", "/v1", "/v1/", "/",
             "/v1/nope", "/tokenize", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/detokenize",
             "//health", "/v1/models/", "/health/"]


@st.composite
def other_requests(draw):
    """Any method on the GET routes and unknown paths, with junk query strings and bodies."""
    path = draw(st.one_of(st.sampled_from(GET_PATHS),
                          fs.texts(30).map(lambda s: "/v1/models/" + urllib.parse.quote(s, safe=""))))
    query = draw(st.dictionaries(fs.texts(8), fs.texts(20), max_size=3))
    if query:
        path += "?" + urllib.parse.urlencode(query)
    method = draw(st.sampled_from(["GET", "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
    content = draw(st.one_of(st.none(), fs.junk().map(fs.dumps)))
    content_type = draw(st.sampled_from([None, "application/json", "text/plain"]))
    return method, path, content, content_type


@fuzz(100)
@given(request=other_requests())
def test_get_routes_and_other_methods(http, reference, request):
    method, path, content, content_type = request
    answer = send(http, method, path, content, content_type)
    route = urllib.parse.urlsplit(path).path
    check_answer(answer, route)
    if method == "GET" and route in ("/v1/models", f"/v1/models/{fs.MODEL}", "/health", "/version", "/metrics"):
        assert answer.status == 200, answer.body[:300]
    assert_still_serving(http, reference)


# ----------------------------------------------------------------------------- hostile classes


@fuzz(60)
@given(case=st.sampled_from(fs.POST_ROUTES).flatmap(
    lambda r: st.tuples(st.just(r), fs.with_surrogate(r))), ensure_ascii=st.booleans())
def test_lone_surrogates(http, reference, case, ensure_ascii):
    """A lone surrogate as a ``\\udXXX`` escape (valid JSON, but not encodable as UTF-8) or as
    raw bytes (not UTF-8 at all) is a 400 where the text is used, never a 500."""
    route, (body, spot) = case
    answer = post(http, route, body, ensure_ascii)
    check_answer(answer, route, body)
    if not ensure_ascii or spot in ("prompt", "prompt[]", "content", "content_part", "role"):
        assert answer.status == 400, (spot, answer.body[:300])
    assert_still_serving(http, reference)


@fuzz(30)
@given(case=st.sampled_from(fs.POST_ROUTES).flatmap(lambda r: st.tuples(st.just(r), fs.deep_bodies(r))))
def test_deeply_nested_json(http, reference, case):
    """Nesting 1,000-100,000 deep: a 400 (or, in a field the server ignores, possibly a 200),
    never a RecursionError's 500."""
    route, (content, depth) = case
    answer = send(http, "POST", route, content)
    check_answer(answer, route)
    if depth > 10_000:
        assert answer.status == 400, answer.body[:300]
    assert_still_serving(http, reference)


@fuzz(60)
@given(case=st.sampled_from(fs.POST_ROUTES).flatmap(lambda r: st.tuples(st.just(r), fs.invalid_utf8_bodies(r))))
def test_invalid_utf8(http, reference, case):
    route, content = case
    answer = send(http, "POST", route, content)
    check_answer(answer, route)
    assert answer.status == 400, answer.body[:300]
    assert_still_serving(http, reference)


LENIENT = (b"\xef\xbb\xbf", '{'.encode("utf-16")[:2], '{'.encode("utf-32")[:4])  # a BOM, then a valid object


@fuzz(60)
@given(route=st.sampled_from(fs.POST_ROUTES), content=fs.non_object_bodies())
def test_bodies_that_are_not_one_json_object(http, reference, route, content):
    answer = send(http, "POST", route, content)
    check_answer(answer, route, None)
    if not content.startswith(LENIENT):
        assert answer.status == 400, (content[:100], answer.body[:300])
    assert_still_serving(http, reference)


@fuzz(60)
@given(route=st.sampled_from(fs.POST_ROUTES), content_type=st.one_of(st.none(), fs.content_types()),
       body=st.sampled_from([None, "minimal"]))
def test_content_types(http, reference, route, content_type, body):
    content = fs.dumps(fs.MINIMAL[route]) if body else None
    answer = send(http, "POST", route, content, content_type)
    check_answer(answer, route)
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        assert answer.status == 400 and error_of(answer)["code"] == "invalid_content_type", answer.body[:300]
    elif body:
        assert answer.status == 200, answer.body[:300]
    assert_still_serving(http, reference)


@settings(fuzz(30), phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: a failure can be slow
@given(case=fs.explosions(), stream=st.booleans())
def test_n_times_prompts_explosions(http, reference, case, stream):
    """At most 8 sequences are served; 10,000 or more in one request are refused at once with a
    4xx (retrying cannot help, so not a 503), before any of them is queued. The client waits 20 s
    (a refusal takes well under a second) and then disconnects, which aborts the request."""
    body, sequences = case
    if stream:
        body = {**body, "stream": True}
    answer = post(http, "/v1/completions", body, timeout=20)
    check_answer(answer, "/v1/completions", body)
    if sequences <= 8:
        assert answer.status == 200, answer.body[:300]
    else:
        assert 400 <= answer.status < 500, answer.body[:300]
    assert_still_serving(http, reference)


@fuzz(20)
@given(body=fs.stop_lists())
def test_huge_stop_lists(http, reference, body):
    answer = post(http, "/v1/completions", body)
    check_answer(answer, "/v1/completions", body)
    assert_still_serving(http, reference)


@fuzz(40)
@given(seed=fs.seeds(), n=st.integers(1, 3), stream=st.booleans(),
       route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_seeds_past_64_bits(http, reference, seed, n, stream, route):
    """A seed outside the 64-bit signed range is a 400 naming ``seed`` (not torch's overflow
    message); inside it, with n choices (seeds ``seed + i``), the request is served."""
    body = {"seed": seed, "n": n, "stream": stream, "temperature": 1.0, "max_tokens": 2}
    body.update({"prompt": "hello"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    answer = post(http, route, body)
    check_answer(answer, route, body)
    if type(seed) is int:
        if -2**63 <= seed < 2**63:
            assert answer.status == 200, answer.body[:300]
        else:
            assert answer.status == 400 and error_of(answer)["param"] == "seed", answer.body[:300]
    assert_still_serving(http, reference)


AUTH_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
               ("GET", "/v1/models"),
               ("GET", f"/v1/models/{fs.MODEL}"), ("GET", "/v1/nope"), ("POST", "/tokenize"),
               ("POST", "/detokenize"), ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics")]
BODIES = {"/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/tokenize": {"prompt": "hi"},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          "/v1/responses": {"input": "hi", "max_output_tokens": 2}, "/detokenize": {"tokens": [10, 20]}}


@fuzz(80)
@given(route=st.sampled_from(AUTH_ROUTES), value=fs.auth_headers(KEY))
def test_authorization_header_spellings(http, reference, route, value):
    """The exact ``Bearer KEY`` opens ``/v1``, ``/tokenize`` and ``/detokenize``; anything that
    is not the key after some spelling of the scheme (``bearer``, ``BEARER``, extra blanks:
    accepted or not) is a 401 in OpenAI's shape; the open routes ignore the header."""
    method, path = route
    headers = {} if value is None else {"Authorization": value}
    body = BODIES.get(path)
    answer = send(http, method, path, fs.dumps(body) if body else None, "application/json" if body else None,
                  headers=headers, auth=False)
    check_answer(answer, path, body)
    given_value = (value or b"").strip(b" \t")
    exact = given_value == f"Bearer {KEY}".encode()
    some_spelling = re.fullmatch(rb"bearer[ \t]+" + re.escape(KEY.encode()), given_value, re.I) is not None
    if path.startswith("/v1") or path in ("/tokenize", "/detokenize"):
        if exact:
            assert answer.status != 401, answer.body[:300]
        elif not some_spelling:
            assert answer.status == 401 and error_of(answer)["code"] == "invalid_api_key", answer.body[:300]
    elif path in ("/health", "/version", "/metrics"):
        assert answer.status == 200, answer.body[:300]
    assert_still_serving(http, reference)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413_not_a_reset(http, reference, route, chunked):
    """17 MiB, declared up front or streamed in chunks without a length: a complete 413."""
    size = 17 * 2**20
    if chunked:
        content: Any = iter([b" " * 2**20] * 17)
    else:
        content = b'{"prompt": "' + b"a" * (size - 20) + b'"}'
    answer = send(http, "POST", route, content)
    assert answer.status == 413, answer.body[:300]
    assert error_of(answer)["code"] == "request_too_large"
    assert_still_serving(http, reference)


def test_the_server_still_answers_chat_and_streams_the_same(http, reference, fuzz_server):
    """After everything above: nothing left running or holding KV blocks, and the greedy text
    is the same streamed and through chat's path."""
    fuzz_server.wait_idle()
    assert_still_serving(http, reference)
    stream = send(http, "POST", "/v1/completions", fs.dumps({**GREEDY, "stream": True}))
    check_answer(stream, "/v1/completions", {**GREEDY, "stream": True})
    chunks = [json.loads(line[6:]) for line in stream.body.split(b"\n")
              if line.startswith(b"data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == reference
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    first, second = (post(http, "/v1/chat/completions", chat) for _ in range(2))
    assert first.status == second.status == 200
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]
