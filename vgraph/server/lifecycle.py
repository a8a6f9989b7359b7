"""Running the server process: uvicorn, graceful drain on SIGTERM, exit codes.

- SIGTERM / SIGINT: uvicorn closes the listening socket (new connections are refused) and
  lets in-flight responses finish for up to ``shutdown_timeout`` seconds. At that deadline
  the engine is stopped, which ends every request still running the way an engine failure
  does: a stream with an error event and ``data: [DONE]``, any other request with a 500 in
  the error shape, instead of a chunked body cut off mid-way. Uvicorn cancels whatever is
  still left ``CUT_GRACE_S`` later (a client that stopped reading, say); the lifespan then
  stops the engine (again, a no-op). Uvicorn re-raises the captured signal once done;
  a handler installed here turns that SIGTERM into a normal return, so a drained server exits
  0 instead of dying by signal.
- A fatal engine error: ``/health`` turns 503 at once, in-flight requests fail with 500 (or an
  error event in their stream), and after a short grace period the server shuts down and the
  process exits 1. A failure while building the engine (a bad model path, say) is re-raised
  to the CLI, which reports user errors in one line with exit code 2.
- Connections (connections.py): read deadlines for headers and bodies, a stall deadline for
  clients that stop reading, a connection cap below the descriptor limit (raised towards the
  hard limit first), JSON errors for malformed HTTP, and rate-limited logging of errors that
  repeat per connection or per accept attempt.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from types import FrameType
from typing import Awaitable, Callable, Iterator, Optional

import uvicorn

from .app import build_app
from .connections import (ConnectionGuard, ConnectionLimits, LogRateLimit, plan_connections, protocol_class,
                          raise_descriptor_limit)
from .header_limit import MAX_HEADER_BYTES  # also bounds h11's buffer before the headers end
from .state import Engine, ServerSettings, ServerState

logger = logging.getLogger("vgraph.server")

# After the drain deadline ends the remaining requests, their last events get this long to be
# written before uvicorn cancels what is left.
CUT_GRACE_S = 5.0
# Loggers whose records can repeat once per connection or per accept attempt.
_NOISY_LOGGERS = ("asyncio", "uvicorn.error", "vgraph.server")


def serve(settings: ServerSettings, engine: Engine, *, host: str, port: int,
          shutdown_timeout: float = 30.0, log_level: str = "info", access_log: bool = False,
          sockets: Optional[list[socket.socket]] = None) -> int:
    """Serves ``engine`` (not started yet) until a signal or a fatal engine error; returns the
    process exit code.

    ``sockets``: listening sockets already bound (the CLI binds before the model loads, so a
    port in use fails at once); uvicorn serves on them instead of binding ``host:port``."""
    server: Optional[uvicorn.Server] = None

    def on_fatal(error: BaseException) -> None:
        state: ServerState = app.state.server
        startup = state.engine.startup_error is not None
        if not startup:
            logger.error("the engine failed (%s: %s); shutting down in %.1f s", type(error).__name__, error,
                         settings.fatal_exit_grace_s)
        delay = 0.0 if startup else settings.fatal_exit_grace_s
        asyncio.get_running_loop().call_later(delay, _request_exit, server)

    engine.on_fatal = on_fatal
    app = build_app(settings, engine, tune_gc=True)
    guard = ConnectionGuard(_connection_limits(settings))
    config = uvicorn.Config(app, host=host, port=port, log_config=None,
                            log_level=(settings.uvicorn_log_level or log_level).lower(),
                            root_path=settings.root_path, access_log=access_log, http=protocol_class(guard),
                            backlog=guard.limits.backlog,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + CUT_GRACE_S,  # type: ignore[arg-type]
                            timeout_keep_alive=settings.keep_alive_timeout)  # type: ignore[arg-type]
    state: ServerState = app.state.server
    server = _Server(config, shutdown_timeout, lambda: _end_unfinished(state, shutdown_timeout))
    state.exit_requested = lambda: bool(server and server.should_exit)
    previous = signal.signal(signal.SIGTERM, _drained)
    try:
        with _rate_limited(_NOISY_LOGGERS):
            server.run(sockets=sockets)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if engine.startup_error is not None:
        raise engine.startup_error
    if engine.error is not None:
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server with a drain deadline: ``on_deadline`` starts ``drain_timeout`` seconds
    into the graceful shutdown unless the shutdown has finished by then."""

    def __init__(self, config: uvicorn.Config, drain_timeout: float,
                 on_deadline: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain_timeout = drain_timeout
        self._on_deadline = on_deadline
        self._deadline_task: Optional[asyncio.Task] = None

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self._drain_timeout, self._deadline_passed)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()

    def _deadline_passed(self) -> None:
        self._deadline_task = asyncio.ensure_future(self._on_deadline())


async def _end_unfinished(state: ServerState, shutdown_timeout: float) -> None:
    """The drain deadline: stops the engine, so every request still running ends now with the
    engine's "shutting down" error (see the module docstring) while uvicorn still waits."""
    stats = state.engine.stats
    logger.warning("--shutdown-timeout (%g s) passed with %d request(s) running and %d waiting; ending them",
                   shutdown_timeout, stats.num_running, stats.num_waiting)
    await state.engine.shutdown()


def _connection_limits(settings: ServerSettings) -> ConnectionLimits:
    """The connection limits from the settings and the descriptor limit (raised first)."""
    descriptors = raise_descriptor_limit()
    max_connections, backlog = plan_connections(descriptors, settings.max_connections)
    if settings.max_connections is not None and max_connections < settings.max_connections:
        logger.warning("max_connections lowered from %d to %d to fit the descriptor limit (%d)",
                       settings.max_connections, max_connections, descriptors)
    logger.info("connections: at most %d open (descriptor limit %d, backlog %d); request headers within "
                "%g s, bodies within %g s; clients that stop reading dropped after %g s",
                max_connections, descriptors, backlog, settings.header_timeout, settings.body_timeout,
                settings.stall_timeout)
    return ConnectionLimits(header_timeout=settings.header_timeout, body_timeout=settings.body_timeout,
                            stall_timeout=settings.stall_timeout, max_connections=max_connections,
                            backlog=backlog)


@contextlib.contextmanager
def _rate_limited(names: tuple[str, ...]) -> Iterator[None]:
    """Rate-limits the records of the loggers ``names`` (see ``LogRateLimit``) for the block."""
    limit = LogRateLimit()
    loggers = [logging.getLogger(name) for name in names]
    for each in loggers:
        each.addFilter(limit)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(limit)


def _request_exit(server: Optional[uvicorn.Server]) -> None:
    if server is not None:
        server.should_exit = True


def _drained(signum: int, frame: Optional[FrameType]) -> None:
    """Receives the SIGTERM uvicorn re-raises after its graceful shutdown: nothing left to do."""
    logger.info("shut down after signal %d", signum)
