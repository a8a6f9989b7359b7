"""Every integer a request may carry, at and beyond every integer boundary, on every route, on
both engine layouts (the engine on a thread of the server, and in its own process): a 200 or a
4xx in OpenAI's shape naming the field, never a 5xx, and the server keeps serving afterwards
with nothing left counted in its queue.

Why both layouts: a ``top_k`` of 2**70 was a 200 in process and a 500 across the process
boundary (msgpack carries 64 bits), and sixteen such requests with n=64 left the server
refusing everyone as overloaded. The ranges are ``protocol.INT_RANGES``; a new integer field
without one fails ``test_every_integer_field_has_a_range``.
"""
from __future__ import annotations

import typing
from typing import Any

import httpx
import pytest

from tests.server.conftest import EAGER_ARGS, ServerProcess
from vgraph.server.protocol import (INT_RANGES, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest)
from vgraph.server.responses_protocol import ResponsesRequest
from vgraph.server.routes_embeddings import EmbeddingRequest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MODEL = "demo-model-v1"
CHAT = [{"role": "user", "content": "hi"}]
# Each route: a cheap valid body, and the integer fields it takes (a list field gets [value]).
ROUTES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "/v1/completions": ({"model": MODEL, "prompt": "hi", "max_tokens": 1},
                        ["n", "best_of", "max_tokens", "min_tokens", "top_k", "seed", "logprobs",
                         "stop_token_ids", "prompt"]),
    "/v1/chat/completions": ({"model": MODEL, "messages": CHAT, "max_tokens": 1, "logprobs": True},
                             ["n", "max_tokens", "max_completion_tokens", "min_tokens", "top_k", "seed",
                              "top_logprobs", "stop_token_ids"]),
    "/v1/responses": ({"model": MODEL, "input": "hi", "max_output_tokens": 1}, ["max_output_tokens", "top_logprobs"]),
    "/v1/embeddings": ({"model": MODEL, "input": "hi"}, ["input", "dimensions"]),
    "/detokenize": ({"model": MODEL, "tokens": [5]}, ["tokens"]),
}
LIST_FIELDS = {"stop_token_ids", "prompt", "input", "tokens"}
BOUNDARIES = sorted({0, 1, 2**31 - 1, 2**31, 2**32, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70,
                     -1, -2**31, -2**31 - 1, -2**53, -2**63, -2**63 - 1, -2**64, -10**30})
MODELS = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, EmbeddingRequest,
          ResponsesRequest]
REFUSED = {"dimensions"}  # integer fields refused whatever their value
ERROR_FIELDS = {"message", "type", "param", "code"}


def values_for(field: str) -> list[int]:
    """The boundaries, plus the edges of the field's own range."""
    low, high = INT_RANGES.get(field, (0, 0))
    return sorted(set(BOUNDARIES) | {low - 1, low, high, high + 1})


def body_with(route: str, field: str, value: int) -> dict[str, Any]:
    base, _ = ROUTES[route]
    return {**base, field: [value] if field in LIST_FIELDS else value}


@pytest.fixture(scope="module", params=["engine-process", "engine-in-process"])
def bounds_server(request):
    extra = ["--engine-in-process"] if request.param == "engine-in-process" else []
    proc = ServerProcess(*EAGER_ARGS, "--max-queue-len", "1024", *extra)
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def check(server: ServerProcess, route: str, body: dict, field: str) -> httpx.Response:
    response = server.post(route, body)
    shown = f"{route} {body}: {response.status_code} {response.text[:300]}"
    assert response.status_code < 500, shown
    assert response.status_code in (200, 400), shown
    if response.status_code == 400:
        error = response.json()["error"]
        assert set(error) == ERROR_FIELDS and error["message"], shown
        assert error["param"] == field, shown
    return response


def test_every_integer_field_has_a_range():
    """Every integer field of every request model is bounded (or refused outright)."""
    for model in MODELS:
        for name, info in model.model_fields.items():
            if _holds_int(info.annotation):
                assert name in INT_RANGES or name in REFUSED, f"{model.__name__}.{name} has no range"


def _holds_int(annotation: Any) -> bool:
    if annotation is int:
        return True
    return any(_holds_int(arg) for arg in typing.get_args(annotation))


@pytest.mark.parametrize("route", list(ROUTES))
def test_integer_boundaries_on_every_route(bounds_server, route):
    reference = bounds_server.post("/v1/completions", {"model": MODEL, "prompt": "The quick brown fox",
                                                       "max_tokens": 6, "temperature": 0})
    assert reference.status_code == 200, reference.text
    _, fields = ROUTES[route]
    for field in fields:
        low, high = INT_RANGES.get(field, (None, None))
        for value in values_for(field):
            response = check(bounds_server, route, body_with(route, field, value), field)
            if low is not None and not low <= value <= high:
                assert response.status_code == 400, f"{route} {field}={value} was accepted"
    assert bounds_server.wait_idle()["vllm:num_requests_waiting"] == 0
    again = bounds_server.post("/v1/completions", {"model": MODEL, "prompt": "The quick brown fox",
                                                   "max_tokens": 6, "temperature": 0})
    assert again.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


FIELDS = [(route, field) for route, (_, fields) in ROUTES.items() for field in fields]


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(target=st.sampled_from(FIELDS),
       value=st.one_of(st.sampled_from(BOUNDARIES), st.integers(min_value=-2**80, max_value=2**80)))
def test_random_integers_anywhere(bounds_server, target, value):
    route, field = target
    check(bounds_server, route, body_with(route, field, value), field)


def test_the_wedge_is_a_400_and_admission_stays_open(bounds_server):
    """Sixteen requests of n=64 with a top_k past 64 bits, then a normal one, at a queue limit
    of 1024 sequences: sixteen 400s naming top_k, then a 200, and /health stays 200."""
    for _ in range(16):
        response = bounds_server.post("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4,
                                                          "n": 64, "top_k": 2**64})
        assert response.status_code == 400 and response.json()["error"]["param"] == "top_k", response.text
    for route, body in [("/v1/completions", {"prompt": "hello", "max_tokens": 4, "top_k": 1180591620717411303424}),
                        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "top_k": 2**64}),
                        ("/v1/completions", {"prompt": "hello", "max_tokens": 4, "stop_token_ids": [2**64]})]:
        response = bounds_server.post(route, {"model": MODEL, **body})
        assert response.status_code == 400, response.text
    normal = bounds_server.post("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4, "n": 64})
    assert normal.status_code == 200 and len(normal.json()["choices"]) == 64, normal.text
    assert httpx.get(bounds_server.url + "/health").status_code == 200
    assert bounds_server.wait_idle()["vllm:num_requests_waiting"] == 0
