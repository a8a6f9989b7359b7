"""What every route shares: settings, the async engine, metrics, and the engine-error mapping."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from fastapi import Request

from ..engine.async_engine import (AsyncEngine, EngineDeadError, EngineNotReadyError, OutputCollector,
                                   QueueFullError)
from ..engine.inputs import PromptType
from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from .errors import APIError, bad_request
from .logprobs import TokenTexts
from .metrics import ServerMetrics
from .protocol import param_from_message, read_json_object, validate
from .streaming import DisconnectWatch

logger = logging.getLogger("vgraph.server")

DEFAULT_MAX_BODY_BYTES = 16 * 2**20


@dataclass
class ServerSettings:
    """Everything the HTTP layer needs besides the engine (the CLI fills it from flags)."""

    served_model_names: list[str]
    api_key: Optional[str] = None
    chat_template: Optional[str] = None  # overrides the tokenizer's
    max_queue_len: Optional[int] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # After a fatal engine error the port stays open this long, answering 503, so that health
    # checkers and clients see why before the process exits.
    fatal_exit_grace_s: float = 2.0
    # Slow, stalled and excess connections each hold a descriptor; see connections.py.
    header_timeout: float = field(default=10.0, metadata={
        "help": "seconds a client may take to send a request's headers before the connection is closed"})
    body_timeout: float = field(default=30.0, metadata={
        "help": "seconds a client may take to send a request body (plus 1 s per 64 KiB received)"})
    stall_timeout: float = field(default=30.0, metadata={
        "help": "seconds a response may wait on a client that stopped reading before the connection "
                "is dropped and its request aborted"})
    keep_alive_timeout: float = field(default=5.0, metadata={
        "help": "seconds an idle keep-alive connection stays open"})
    max_connections: Optional[int] = field(default=None, metadata={
        "help": "open connections at most (default and ceiling: what the descriptor limit allows); "
                "over it, the connection waiting longest for its request headers is closed, or the "
                "new one gets 503"})

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        for name in ("header_timeout", "body_timeout", "stall_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")


class ServerState:
    def __init__(self, settings: ServerSettings, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.created = int(time.time())
        self.shutting_down = False  # the lifespan is stopping the engine
        self.exit_requested: Callable[[], bool] = lambda: False  # set by lifecycle: a drain has begun
        self._token_texts: Optional[TokenTexts] = None

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    @property
    def token_texts(self) -> TokenTexts:
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.engine.tokenizer)
        return self._token_texts

    def resolve_model(self, name: Optional[str]) -> str:
        """The served name a request asked for (the first one when it names none); else 404."""
        if name is None:
            return self.model_name
        if name not in self.settings.served_model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.settings.served_model_names))}",
                           param="model", code="model_not_found")
        return name

    def require_ready(self) -> None:
        """Routes that need the tokenizer answer 503 (or report the failure) until it is there."""
        engine = self.engine
        if engine.error is not None:
            raise APIError(503, f"the engine has failed: {engine.error}", code="engine_dead")
        if not engine.ready:
            raise APIError(503, "the model is still loading", code="not_ready", headers={"Retry-After": "5"})

    async def read_generation_request(self, request: Request, schema: type) -> tuple[Any, str]:
        """The body of a generation route, validated against ``schema`` and its own checks, and
        the model it resolves to, once the engine is ready: the preamble both routes share."""
        body = validate(schema, await read_json_object(request, self.settings.max_body_bytes))
        body.check()
        model = self.resolve_model(body.model)
        self.require_ready()
        return body, model

    async def submit(self, items: Sequence[tuple[str, PromptType, SamplingParams]]) -> OutputCollector:
        """Hands requests to the engine, mapping its refusals to HTTP errors."""
        try:
            return await self.engine.add_requests(items)
        except ValueError as exc:
            raise bad_request(str(exc), param_from_message(str(exc))) from None
        except QueueFullError as exc:
            raise APIError(503, f"the server is overloaded: {exc}", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineNotReadyError as exc:
            raise APIError(503, str(exc), code="not_ready", headers={"Retry-After": "5"}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except Exception as exc:  # the engine failed this request without dying
            logger.exception("the engine failed to add a request")
            raise APIError(500, f"the engine failed the request: {type(exc).__name__}: {exc}",
                           code="engine_error") from None

    async def wait_finished(self, request: Request, collector: OutputCollector) -> dict[str, RequestOutput]:
        """The final output of each request; aborts them if the client disconnects first."""
        finals: dict[str, RequestOutput] = {}
        ids = collector.request_ids
        try:
            async with DisconnectWatch(request, lambda: self._abandon(collector)):
                while not collector.finished:
                    finals.update(await collector.next())
        except EngineDeadError as exc:
            raise APIError(500, str(exc), code="engine_error") from None
        except _ClientGone:
            raise APIError(499, "the client disconnected", code="client_disconnected") from None
        finally:
            if not collector.finished:
                self.engine.abort(ids)
        return finals

    def _abandon(self, collector: OutputCollector) -> None:
        self.engine.abort(collector.request_ids)
        collector._fail(_ClientGone())

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> tuple[str, list[int]]:
        """Renders the chat template (``--chat-template`` or the tokenizer's) and tokenizes it."""
        tokenizer = self.engine.tokenizer
        template = self.settings.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise bad_request("the model's tokenizer has no chat template; start the server with "
                              "--chat-template", "messages", code="no_chat_template")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # template errors (raise_exception, bad roles) are the caller's
            raise bad_request(f"the chat template failed on these messages: {exc}", "messages") from None
        return text, list(tokenizer.encode(text, add_special_tokens=False))


class _ClientGone(Exception):
    """Raised into a waiting handler when its client has disconnected."""


def prompt_text(state: ServerState, output: RequestOutput) -> str:
    """The prompt as text: as given, or decoded from its token ids."""
    if output.prompt is not None:
        return output.prompt
    return state.engine.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

