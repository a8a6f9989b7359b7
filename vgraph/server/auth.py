"""``--api-key``: every ``/v1`` route, ``/tokenize`` and ``/detokenize`` need
``Authorization: Bearer <key>``.

A plain ASGI middleware rather than a route dependency, so that it covers every path under
``/v1`` (unknown ones included: a 404 would tell an unauthenticated caller which routes exist)
and runs before the body is read. ``/tokenize`` and ``/detokenize`` are protected too: they
run the tokenizer on whatever the caller sends, work an anonymous client should not be able
to ask of a server that requires a key. ``/health``, ``/metrics`` and ``/version`` stay open,
as in vLLM, for load balancers and scrapers.

A path is protected with or without a trailing slash (``/tokenize/``), and the app redirects no
trailing slashes (``app.py``): such a redirect would answer before the key is checked, with a
``Location`` built from the client's own ``Host`` header. A request with more than one
``Authorization`` header is refused (400) rather than judged by whichever comes first.

The scheme is case-insensitive (``bearer KEY`` works, as RFC 7235 says of auth schemes); the
key is compared in constant time (``hmac.compare_digest`` on bytes) so response timing leaks
nothing about it.
"""
from __future__ import annotations

import hmac
import re

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, error_response

PROTECTED_PREFIX = "/v1"
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})
_CREDENTIALS = re.compile(rb"\s*(\S+)[ \t]+(.*?)\s*\Z", re.S)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _protected(scope.get("path", "")) or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = [value for name, value in scope.get("headers", []) if name == b"authorization"]
        if len(headers) > 1:
            response = error_response(APIError(400, f"{len(headers)} Authorization headers: send exactly one",
                                               param="Authorization", code="duplicate_authorization"))
            await response(scope, receive, send)
            return
        given = headers[0] if headers else b""
        if hmac.compare_digest(bearer_token(given), self._key):
            await self.app(scope, receive, send)
            return
        message = "missing API key" if not given else "invalid API key"
        response = error_response(APIError(401, f"{message}: send 'Authorization: Bearer <key>'",
                                           code="invalid_api_key",
                                           headers={"WWW-Authenticate": "Bearer"}))
        await response(scope, receive, send)


def bearer_token(header: bytes) -> bytes:
    """The credentials of a ``Bearer`` Authorization header (any case of the scheme, spaces or
    tabs after it); ``b""`` for another scheme or none."""
    match = _CREDENTIALS.match(header)
    if match is None or match.group(1).lower() != b"bearer":
        return b""
    return match.group(2)


def _protected(path: str) -> bool:
    path = path.rstrip("/") or "/"
    return path in PROTECTED_PATHS or path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
