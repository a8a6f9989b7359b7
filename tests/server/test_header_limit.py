"""The header limit holds however the bytes arrive (h11's own limit only covers a header
block it has not seen whole), and answers with the OpenAI error shape."""
from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from vgraph.server.header_limit import MAX_HEADER_BYTES, HeaderLimitMiddleware


def _client() -> TestClient:
    app = Starlette(routes=[Route("/v1/x", lambda request: PlainTextResponse("ok"), methods=["POST"])])
    return TestClient(HeaderLimitMiddleware(app))


def test_oversized_headers_get_a_400_in_the_error_shape():
    response = _client().post("/v1/x", headers={"x-padding": "a" * (MAX_HEADER_BYTES + 1)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "headers_too_large" and "64 KiB" in error["message"]


def test_headers_under_the_limit_pass():
    response = _client().post("/v1/x", headers={"x-padding": "a" * (MAX_HEADER_BYTES // 2)})
    assert response.status_code == 200 and response.text == "ok"
