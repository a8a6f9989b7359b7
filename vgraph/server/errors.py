"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports, whatever raised it (validation, the engine, Starlette's
own 404/405, an unexpected bug), leaves through ``error_response`` so that clients such as the
``openai`` package can parse it and map the status to their exception classes.

Unexpected exceptions stop at ``CatchAllMiddleware``: one log line per failed request (the
traceback at DEBUG, once per place of failure), a 500 in the same shape, and the connection
stays usable. Starlette's own last resort would send its 500 and then re-raise, so that uvicorn
logged a second full traceback and closed a keep-alive connection the client was never told
about (no ``Connection: close``).
"""
from __future__ import annotations

import json
import logging
import traceback
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.client import EngineProcessDiedError, EngineShutdownError

logger = logging.getLogger("vgraph.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable_error"}

# Where failures were already logged with their traceback: (exception type, file, line). Bounded,
# so a stream of distinct failures cannot grow it without end.
_TRACED: set[tuple[str, str, int]] = set()
_MAX_TRACED = 256


class APIError(Exception):
    """An error with its HTTP status, OpenAI error type/code, the offending field and headers."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        # A message may quote input (a model name, a template error); lone surrogates in it
        # would make the response itself fail to encode, so they are written as escapes.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse_chunk(self) -> bytes:
        """The same error as one server-sent event, for failures after a stream has started."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def log_failure(what: str, exc: BaseException) -> None:
    """Logs a request's unexpected failure as one ERROR line.

    A failure that repeats (the same bug hit by every request) would otherwise flood the log
    with a 70-line traceback each time; the traceback is logged at DEBUG the first time its
    place of failure is seen, which is all a developer needs to find it.
    """
    logger.error("%s: %s: %s", what, type(exc).__name__, exc)
    frames = traceback.extract_tb(exc.__traceback__)
    site = (type(exc).__name__, frames[-1].filename, frames[-1].lineno or 0) if frames else (type(exc).__name__, "", 0)
    if site not in _TRACED and len(_TRACED) < _MAX_TRACED:
        _TRACED.add(site)
        logger.debug("traceback of %s (logged once)", what, exc_info=exc)


def engine_gone(exc: BaseException) -> APIError:
    """The error for requests the engine stopped serving: 503 when the server is shutting down
    (retrying elsewhere is right) or the engine-core process died (the server exits; another
    replica can serve), 500 when the engine failed."""
    if isinstance(exc, EngineShutdownError):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, EngineProcessDiedError):
        return APIError(503, str(exc), code="engine_dead")
    return APIError(500, str(exc), code="engine_error")


def internal_error(what: str, exc: BaseException) -> APIError:
    """Logs an unexpected failure (see ``log_failure``) and returns the 500 that reports it."""
    log_failure(what, exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


class CatchAllMiddleware:
    """The last resort: an exception no handler took becomes a logged 500 on a usable connection.

    When the response has already started (a stream), nothing well-formed can be sent any more:
    the exception is logged and swallowed, and uvicorn closes the connection because the
    response never completed, which the client sees as a truncated response.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            return  # the client left mid-body (or a read deadline cut it): nobody to answer
        except Exception as exc:
            error = internal_error(f"{scope.get('method', '')} {scope.get('path', '')} failed", exc)
            if not started:
                await error_response(error)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Routes ``APIError`` and Starlette's HTTP errors into the OpenAI error shape (anything
    else is ``CatchAllMiddleware``'s)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_response(APIError(exc.status_code, message, headers=dict(exc.headers or {})))
