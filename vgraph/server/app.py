"""The FastAPI application: routes, error shape, auth, and the engine's lifespan.

The engine starts in the lifespan but is not awaited there: uvicorn binds the port only after
the lifespan's startup finishes, and ``/health`` must be reachable (answering 503) while the
model loads and compiles, which can take minutes. Requests that need the engine get 503 with
``Retry-After`` until it is ready.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

from fastapi import FastAPI

from .. import __version__
from ..engine.dp_engine import DataParallelEngine
from ..engine.gc_tuning import freeze_after_startup
from ..engine.stats import StepOutput
from . import routes_chat, routes_completions, routes_embeddings, routes_lora, routes_misc, routes_responses
from .auth import APIKeyMiddleware
from .header_limit import HeaderLimitMiddleware
from .errors import CatchAllMiddleware, install_error_handlers
from .metrics import ServerMetrics
from .request_log import RequestLog
from .state import Engine, ServerSettings, ServerState

logger = logging.getLogger("vgraph.server")


def _both(first: Callable[[StepOutput], None], second: Callable[[StepOutput], None]) -> Callable[[StepOutput], None]:
    def on_step(step: StepOutput) -> None:
        first(step)
        second(step)
    return on_step


def build_app(settings: ServerSettings, engine: Engine, tune_gc: bool = False) -> FastAPI:
    """An app serving ``engine`` (not started yet): an ``EngineClient`` (the engine in its own
    process or on a thread of this one) or a ``DataParallelEngine`` (several of them); the
    routes see one interface.

    The engine's ``on_fatal`` runs on the event loop when it fails to start or dies later; the
    caller sets it and decides how the process ends (see ``lifecycle.serve``). The app sets
    ``on_step`` (the metrics, and the request log unless --disable-log-requests).
    ``tune_gc``: once the engine is ready, freeze what startup left alive and make young
    collections rarer (``gc_tuning``); for a server process, not for an app inside a test.
    """
    replicas = engine.replicas if isinstance(engine, DataParallelEngine) else [engine]
    metrics = ServerMetrics(settings.served_model_names[0], lambda: [replica.stats for replica in replicas])
    engine.on_step = metrics.observe
    if settings.log_requests:  # one hook: the request log follows the metrics
        engine.on_step = _both(metrics.observe, RequestLog(settings.max_log_len).observe)
    state = ServerState(settings, engine, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        announce = asyncio.create_task(_announce_ready(state, tune_gc))
        try:
            yield
        finally:
            state.shutting_down = True
            announce.cancel()
            await engine.shutdown()
            state.close()

    # No trailing-slash redirects: a wrong path is a 404, never a 307 to an address built from
    # the client's Host header (see auth.py).
    app = FastAPI(title="vgraph", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.server = state
    install_error_handlers(app)
    for module in (routes_completions, routes_chat, routes_responses, routes_embeddings, routes_lora, routes_misc):
        app.include_router(module.router)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(HeaderLimitMiddleware)
    app.add_middleware(CatchAllMiddleware)  # added last: runs first, so it sees every failure
    return app


async def _announce_ready(state: ServerState, tune_gc: bool) -> None:
    try:
        await state.engine.wait_ready()
    except Exception:
        return  # on_fatal reports it
    engine = state.engine
    await state.check_adapters()
    if tune_gc:
        freeze_after_startup()  # what startup left alive is never walked by a collection again
    logger.info("ready: serving %s as %s (max_model_len %d)", engine.model_path,
                ", ".join([*state.settings.served_model_names, *state.adapters.names()]), engine.max_model_len)
