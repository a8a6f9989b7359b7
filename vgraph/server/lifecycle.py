"""Running the server process: uvicorn, graceful drain on SIGTERM, exit codes.

- SIGTERM / SIGINT: uvicorn closes the listening socket (new connections are refused), lets
  in-flight responses finish for up to ``shutdown_timeout`` seconds, then cancels what is
  left; the lifespan then stops the engine. Uvicorn re-raises the captured signal once done;
  a handler installed here turns that SIGTERM into a normal return, so a drained server exits
  0 instead of dying by signal.
- A fatal engine error: ``/health`` turns 503 at once, in-flight requests fail with 500 (or an
  error event in their stream), and after a short grace period the server shuts down and the
  process exits 1. A failure while building the engine (a bad model path, say) is re-raised
  to the CLI, which reports user errors in one line with exit code 2.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Callable, Optional

import uvicorn

from ..engine.llm_engine import LLMEngine
from .app import build_app
from .header_limit import MAX_HEADER_BYTES  # also bounds h11's buffer before the headers end
from .state import ServerSettings, ServerState

logger = logging.getLogger("vgraph.server")



def serve(settings: ServerSettings, engine_factory: Callable[[], LLMEngine], *, host: str, port: int,
          shutdown_timeout: float = 30.0, log_level: str = "info", access_log: bool = False) -> int:
    """Serves until a signal or a fatal engine error; returns the process exit code."""
    server: Optional[uvicorn.Server] = None

    def on_fatal(error: BaseException) -> None:
        state: ServerState = app.state.server
        startup = state.engine.startup_error is not None
        if not startup:
            logger.error("the engine failed (%s: %s); shutting down in %.1f s", type(error).__name__, error,
                         settings.fatal_exit_grace_s)
        delay = 0.0 if startup else settings.fatal_exit_grace_s
        asyncio.get_running_loop().call_later(delay, _request_exit, server)

    app = build_app(settings, engine_factory, on_fatal=on_fatal)
    config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level=log_level.lower(),
                            access_log=access_log, http="h11", h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on", timeout_keep_alive=5)
    server = uvicorn.Server(config)
    state: ServerState = app.state.server
    state.exit_requested = lambda: bool(server and server.should_exit)
    previous = signal.signal(signal.SIGTERM, _drained)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    engine = state.engine
    if engine.startup_error is not None:
        raise engine.startup_error
    if engine.error is not None:
        return 1
    return 0


def _request_exit(server: Optional[uvicorn.Server]) -> None:
    if server is not None:
        server.should_exit = True


def _drained(signum: int, frame: Optional[FrameType]) -> None:
    """Receives the SIGTERM uvicorn re-raises after its graceful shutdown: nothing left to do."""
    logger.info("shut down after signal %d", signum)
