"""``--api-key``: every ``/v1`` route needs ``Authorization: Bearer <key>``.

A plain ASGI middleware rather than a route dependency, so that it covers every path under
``/v1`` (unknown ones included: a 404 would tell an unauthenticated caller which routes exist)
and runs before the body is read. ``/health``, ``/metrics`` and the other operational routes
stay open, as in vLLM, for load balancers and scrapers. The comparison is constant-time
(``hmac.compare_digest`` on bytes) so response timing leaks nothing about the key.
"""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, error_response

PROTECTED_PREFIX = "/v1"


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _protected(scope.get("path", "")) or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = "missing API key" if not given else "invalid API key"
        response = error_response(APIError(401, f"{message}: send 'Authorization: Bearer <key>'",
                                           code="invalid_api_key",
                                           headers={"WWW-Authenticate": "Bearer"}))
        await response(scope, receive, send)


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
