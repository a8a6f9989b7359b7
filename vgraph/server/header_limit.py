"""The request-header size limit (64 KiB for the request line and headers together).

uvicorn's h11 parser only enforces its limit on a header block it has not yet seen whole
(``h11_max_incomplete_event_size``): when an oversized block arrives in one socket read it
is parsed and passed on. This middleware is the check that always holds, answering with the
OpenAI error shape; the parser limit still bounds what is buffered before the headers end.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, error_response

MAX_HEADER_BYTES = 64 * 1024


def header_bytes(scope: Scope) -> int:
    """Bytes of the request line's target and every header name and value."""
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    return target + sum(len(name) + len(value) for name, value in scope.get("headers", []))


class HeaderLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int = MAX_HEADER_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (size := header_bytes(scope)) > self.limit:
            error = APIError(400, f"request headers are {size} bytes, over the {self.limit // 1024} "
                                  f"KiB limit", code="headers_too_large")
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)
