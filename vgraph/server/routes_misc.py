"""The small routes: ``/v1/models``, ``/health``, ``/version``, ``/tokenize``, ``/detokenize``,
``/metrics``. Tokenization runs on the event loop with the server's own tokenizer copy (a
few microseconds for a prompt), never on the engine's."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from .errors import APIError, bad_request
from .metrics import CONTENT_TYPE
from .protocol import DetokenizeRequest, TokenizeRequest, read_json_object, validate
from .state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once the engine is ready; 503 while loading, after a fatal error, or while draining."""
    state = _state(request)
    engine = state.engine
    if engine.error is not None:
        raise APIError(503, f"the engine has failed: {type(engine.error).__name__}: {engine.error}",
                       code="engine_dead")
    if state.shutting_down or state.exit_requested():
        raise APIError(503, "the server is shutting down", code="shutting_down")
    if not engine.ready:
        raise APIError(503, "the model is still loading", code="not_ready", headers={"Retry-After": "5"})
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    engine = state.engine
    data = [{"id": name, "object": "model", "created": state.created, "owned_by": "vgraph",
             "root": engine.model_path or None, "parent": None,
             "max_model_len": engine.max_model_len or None} for name in state.settings.served_model_names]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.resolve_model(model_id)
    return next(m for m in (await list_models(request))["data"] if m["id"] == model_id)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state = _state(request)
    body = validate(TokenizeRequest, await read_json_object(request, state.settings.max_body_bytes))
    body.check()
    state.resolve_model(body.model)
    state.require_ready()
    if body.messages is not None:
        messages = [m.as_template_input(i) for i, m in enumerate(body.messages)]
        _, tokens = state.encode_chat(messages, body.add_generation_prompt)
    else:
        tokens = list(state.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    return {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    state = _state(request)
    body = validate(DetokenizeRequest, await read_json_object(request, state.settings.max_body_bytes))
    state.resolve_model(body.model)
    state.require_ready()
    vocab = state.engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    text = state.engine.tokenizer.decode(body.tokens, skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
    return {"prompt": text}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)
