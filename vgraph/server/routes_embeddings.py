"""``POST /v1/embeddings``: one vector per input, for any served decoder model.

Each input (a string, or token ids) becomes one prefill-only engine request that batches with
the generation requests of the same steps; its final hidden states (the final norm's output,
what feeds ``lm_head``) are pooled as the server was started with (``--pooling-type``: the last
token's by default, or the mean) and L2-normalized unless ``--no-pooling-normalize``. Inputs
are bounded like completions' prompts (count, characters, tokens). ``encoding_format``
"base64" sends each vector as little-endian float32 bytes in base64, which is what the
``openai`` client asks for by default and decodes. ``dimensions`` (truncating the vector) is
not supported: it is refused rather than ignored.
"""
from __future__ import annotations

import base64
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import EmbeddingRequestOutput
from ..pooling_params import PoolingParams
from .errors import bad_request
from .protocol import _Strict
from .state import ServerState

router = APIRouter()

Input = Union[str, list[str], list[int], list[list[int]]]


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings body."""

    input: Input
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None

    def check(self) -> None:
        if self.dimensions is not None:
            raise bad_request("dimensions is not supported: embeddings have the model's hidden size",
                              "dimensions")

    def inputs(self) -> list[Union[str, list[int]]]:
        """The input field as a list of inputs (a string or token ids each); none may be empty."""
        x = self.input
        if isinstance(x, str) or (x and all(isinstance(t, int) for t in x)):
            items: list = [x]
        else:
            items = list(x)
        if not items:
            raise bad_request("input is empty", "input")
        for i, item in enumerate(items):
            if len(item) == 0:
                where = "input" if len(items) == 1 else f"input[{i}]"
                raise bad_request(f"{where} is empty", "input")
        return items


@router.post("/v1/embeddings")
async def create_embedding(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await state.read(request, EmbeddingRequest)
    body.check()
    model = state.resolve_model(body.model)
    state.require_ready()
    inputs = body.inputs()
    ids = await _token_ids(state, inputs)
    job_id = f"embd-{uuid.uuid4().hex}"
    request_ids = [f"{job_id}-{i}" for i in range(len(inputs))]
    params = PoolingParams()
    prompts = [{"prompt": p, "prompt_token_ids": t} if isinstance(p, str) else t for p, t in zip(inputs, ids)]
    collector = await state.submit(list(zip(request_ids, prompts, [params] * len(prompts))), "input",
                                   model=model)
    finals = await state.wait_finished(request, collector)
    outputs: list[EmbeddingRequestOutput] = [finals[rid] for rid in request_ids]
    data = [{"object": "embedding", "index": i, "embedding": _encode(o.outputs.embedding, body.encoding_format)}
            for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _token_ids(state: ServerState, inputs: list[Union[str, list[int]]]) -> list[list[int]]:
    """Token ids of each input, within the same limits as completions' prompts (count and
    characters before tokenizing, tokens after)."""
    limits = state.limits
    if len(inputs) > limits.prompts:
        raise bad_request(f"input holds {len(inputs)} inputs; at most {limits.prompts} are allowed per request "
                          "(--max-prompts-per-request)", "input", code="too_many_prompts")
    limits.check_sequences(len(inputs), 1, "input")
    name = (lambda i: "the input") if len(inputs) == 1 else (lambda i: f"input[{i}]")
    vocab = state.engine.vocab_size
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            limits.check_chars(len(item), name(i), "input")
        else:
            limits.check_tokens(len(item), name(i), "input")
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"{name(i)}: token id {bad} is outside the vocabulary [0, {vocab})", "input")

    def check(i: int, ids: list[int]) -> None:
        limits.check_tokens(len(ids), name(i), "input")

    return await state.tokenizer.encode_prompts(inputs, check)


def _encode(vector: list[float], encoding_format: str) -> Any:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
