"""The small routes: ``/v1/models``, ``/health``, ``/version``, ``/tokenize``, ``/detokenize``,
``/metrics``.

``/tokenize`` and ``/detokenize`` use the server's own tokenizer copies, never the engine's:
short inputs on the event loop, long ones on the tokenizer's worker thread (tokenization.py),
within the request limits (limits.py). With ``--api-key`` they need the key like ``/v1``
(auth.py): they run the tokenizer on the caller's input, which is work an anonymous client
should not be able to ask for. ``/v1/models`` reports the engine's own ``max_model_len``.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from .errors import APIError, bad_request
from .metrics import CONTENT_TYPE
from .protocol import DetokenizeRequest, TokenizeRequest
from .state import ServerState

# Responses with more token ids than this are serialized off the event loop.
OFFLOAD_IDS = 16_384

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once the engine is ready; 503 while loading, after a fatal error, while draining, or
    when admission is stuck (submissions the engine has not answered for a minute)."""
    state = _state(request)
    engine = state.engine
    if engine.error is not None:
        raise APIError(503, f"the engine has failed: {type(engine.error).__name__}: {engine.error}",
                       code="engine_dead")
    if state.shutting_down or state.exit_requested():
        raise APIError(503, "the server is shutting down", code="shutting_down")
    if not engine.ready:
        raise APIError(503, "the model is still loading", code="not_ready", headers={"Retry-After": "5"})
    stall = engine.admission_stall()
    if stall is not None:
        raise APIError(503, f"admission is stuck: {stall}", code="admission_stalled")
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The base model under each served name, then each LoRA adapter, its parent the base."""
    state = _state(request)
    engine = state.engine
    card = {"object": "model", "created": state.created, "owned_by": "vgraph",
            "max_model_len": engine.max_model_len or None}
    data = [{"id": name, **card, "root": engine.model_path or None, "parent": None}
            for name in state.settings.served_model_names]
    data += [{"id": lora.lora_name, **card, "root": lora.lora_path, "parent": state.model_name}
             for lora in state.adapters.all()]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.resolve_model(model_id)
    return next(m for m in (await list_models(request))["data"] if m["id"] == model_id)


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """Token ids of a prompt, or of chat messages rendered by the template. The prompt (or the
    messages' text) must be within the character limit; the count is reported whatever it is."""
    state = _state(request)
    body = await state.read(request, TokenizeRequest)
    body.check()
    state.resolve_model(body.model)
    state.require_ready()
    if body.messages is not None:
        messages = await state.chat_messages(body.messages)
        _, tokens = await state.encode_chat(messages, body.add_generation_prompt, limit_tokens=False)
    else:
        state.limits.check_chars(len(body.prompt), "the prompt", "prompt")
        tokens = await state.tokenizer.encode(body.prompt, body.add_special_tokens)
    result = {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}
    return await _json(result, large=len(tokens) > OFFLOAD_IDS)


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    state = _state(request)
    body = await state.read(request, DetokenizeRequest)
    state.resolve_model(body.model)
    state.require_ready()
    state.limits.check_detokenize(len(body.tokens))
    vocab = state.engine.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": await state.tokenizer.decode(body.tokens)}


async def _json(content: Any, large: bool) -> Response:
    """A JSON response, serialized on a worker thread when ``large``."""
    if not large:
        return JSONResponse(content)
    data = await asyncio.to_thread(lambda: json.dumps(content, separators=(",", ":")).encode())
    return Response(data, media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)
