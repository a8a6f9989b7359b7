"""What every route shares: settings, the engine client, its tokenizer and limits, metrics, and
the engine-error mapping."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence, Union

from fastapi import Request

from ..engine.client import (EngineClient, EngineDeadError, EngineNotReadyError, OutputCollector, QueueFullError,
                             RequestTooLargeError)
from ..engine.dp_engine import DataParallelEngine
from ..engine.inputs import ContextLengthError, PromptType
from .. import vllm_compat
from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..structured.params import StructuredOutputsParams
from .body import read_request
from .errors import APIError, bad_request, engine_gone, internal_error
from .limits import Limits
from .logprobs import TokenTexts
from .lora_adapters import LoRAAdapters
from .metrics import ServerMetrics
from .protocol import ChatMessage, content_parts, param_from_message, template_messages
from .streaming import DisconnectWatch
from .structured import compile_or_400, requested_constraint
from ..engine.inputs import template_supports_tools
from .tokenization import ServerTokenizer

logger = logging.getLogger("vgraph.server")

# The engine behind the routes: in its own process (the default) or on a thread of this one, or
# several of either as data-parallel replicas.
Engine = Union[EngineClient, DataParallelEngine]

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
OFFLOAD_PARTS = 1024  # chat content parts above which their conversion leaves the event loop
# Flat fields, each a --flag (see the CLI); none of them can be below 1.
_AT_LEAST_ONE = ("max_json_depth", "max_prompt_chars", "max_prompt_tokens", "max_prompts_per_request",
                 "max_sequences_per_request", "max_messages", "max_stop_strings", "max_stop_string_chars",
                 "max_stop_token_ids")


@dataclass
class ServerSettings:
    """Everything the HTTP layer needs besides the engine (the CLI fills it from flags)."""

    served_model_names: list[str]
    api_key: Optional[str] = None
    chat_template: Optional[str] = None  # overrides the tokenizer's
    # A field with "help" metadata is a `vgraph serve` flag, named, typed, defaulted and
    # documented from the field (vgraph/cli_options.py); the others are set by hand there.
    max_queue_len: Optional[int] = field(default=1024, metadata={
        "help": "sequences that may wait to be scheduled; beyond that new requests get 503 + Retry-After"})
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, metadata={
        "help": "largest request body in bytes; a larger one gets 413"})
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

    # What one request may ask for (see limits.py); each refusal is a 400 naming the limit.
    max_json_depth: int = field(default=64, metadata={
        "help": "levels JSON arrays and objects may nest in a request body (deeper: 400, before parsing)"})
    max_prompt_chars: Optional[int] = field(default=None, metadata={
        "help": "characters a prompt (or a chat request's messages together) may have, checked before "
                "tokenizing (default: 32 per token of max_model_len)"})
    max_prompt_tokens: Optional[int] = field(default=None, metadata={
        "help": "tokens a prompt may have (default and ceiling: max_model_len - 1)"})
    max_prompts_per_request: int = field(default=256, metadata={
        "help": "prompts one /v1/completions request may batch"})
    max_sequences_per_request: int = field(default=1024, metadata={
        "help": "sequences (prompts x n) one request may ask for"})
    max_messages: int = field(default=2048, metadata={
        "help": "messages one chat request (or /tokenize) may have"})
    max_stop_strings: int = field(default=64, metadata={"help": "stop strings one request may give"})
    max_stop_string_chars: int = field(default=1024, metadata={"help": "characters each stop string may have"})
    max_stop_token_ids: int = field(default=64, metadata={"help": "stop_token_ids one request may give"})
    # Tool calling (tools.py, tool_parsers.py).
    tool_call_parser: Optional[str] = field(default=None, metadata={
        "help": "how to read tool calls from the model's replies for tool_choice auto: hermes "
                "(Qwen2.5, Hermes: <tool_call> JSON) or llama3_json (Llama 3.1 JSON); without it "
                "tool_choice auto is refused (required and named calls need no parser)",
        "choices": ["hermes", "llama3_json"]})
    # Chat replies, the HTTP server and its log, under vLLM's flag names (docs/vllm-compat.md).
    response_role: str = field(default="assistant", metadata={
        "help": "the role of the message in chat completions' replies"})
    root_path: str = field(default="", metadata={
        "help": "the path prefix a reverse proxy serves this server under (uvicorn's root_path; "
                "default: none)"})
    uvicorn_log_level: Optional[str] = field(default=None, metadata={
        "help": "log level of uvicorn's own messages (default: that of --log-level)",
        "choices": ["critical", "error", "warning", "info", "debug", "trace"]})
    log_requests: bool = field(default=True, metadata={
        "help": "one INFO line per finished request (id, tokens in and out, finish reasons, latency)",
        "flag": "--enable-log-requests", "negative": "--disable-log-requests", "positive": "--enable-log-requests"})
    max_log_len: Optional[int] = field(default=None, metadata={
        "help": "with each request's log line, log up to this many characters of its prompt "
                "(default: none, prompts are not logged)"})
    # Multi-LoRA (lora_adapters.py): adapters served by name, with the engine's --enable-lora.
    lora_modules: list[str] = field(default_factory=list, metadata={
        "help": "LoRA adapters to serve, each name=path (or JSON {\"name\": ..., \"path\": ...}); a request "
                "selects one with its model field (needs --enable-lora)", "nargs": "+"})
    # vLLM's default is auto; vgraph keeps its own defaults unless asked, so that an upgrade
    # does not change what existing requests sample.
    generation_config: str = field(default="vllm", metadata={
        "help": "default sampling settings (temperature, top_p, top_k, min_p, repetition_penalty) of requests "
                "that do not send them: vllm, vgraph's own; auto, those of the model's generation_config.json; "
                "or DIR, those of DIR/generation_config.json"})

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        for name in _AT_LEAST_ONE:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        for name in ("header_timeout", "body_timeout", "stall_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        vllm_compat.check_generation_config(self.generation_config)
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be at least 0, got {self.max_log_len}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        LoRAAdapters(self.lora_modules, self.served_model_names)  # a bad spec or a repeated name: ValueError


class ServerState:
    def __init__(self, settings: ServerSettings, engine: Engine, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.created = int(time.time())
        self.shutting_down = False  # the lifespan is stopping the engine
        self.exit_requested: Callable[[], bool] = lambda: False  # set by lifecycle: a drain has begun
        self._token_texts: Optional[TokenTexts] = None
        self._tokenizer: Optional[ServerTokenizer] = None
        self._sampling_defaults: Optional[dict[str, Any]] = None
        self.adapters = LoRAAdapters(settings.lora_modules, settings.served_model_names)

    def close(self) -> None:
        """Stops the tokenizer's worker thread (the lifespan's end)."""
        if self._tokenizer is not None:
            self._tokenizer.close()

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    @property
    def token_texts(self) -> TokenTexts:
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.engine.tokenizer)
        return self._token_texts

    @property
    def tokenizer(self) -> ServerTokenizer:
        """The routes' tokenizer (needs the engine ready: ``require_ready`` first)."""
        if self._tokenizer is None:
            self._tokenizer = ServerTokenizer(self.engine.tokenizer, self.engine.worker_tokenizer)
        return self._tokenizer

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """What ``--generation-config`` gives requests that omit a sampling setting (read once,
        when the engine is ready: ``auto`` needs the model's directory)."""
        if self._sampling_defaults is None:
            source = self.settings.generation_config
            self._sampling_defaults = vllm_compat.sampling_defaults(source, self.engine.model_path)
            if self._sampling_defaults:
                logger.info("requests that do not set them sample with %s (--generation-config %s)",
                            ", ".join(f"{k}={v}" for k, v in self._sampling_defaults.items()), source)
        return self._sampling_defaults

    @property
    def limits(self) -> Limits:
        """The per-request limits, with the engine's max_model_len (``require_ready`` first)."""
        return Limits.resolve(self.settings, self.engine.max_model_len)

    def resolve_model(self, name: Optional[str]) -> str:
        """The served name a request asked for (the first one when it names none): the base
        model's or a LoRA adapter's; else 404."""
        if name is None:
            return self.model_name
        if name not in self.settings.served_model_names and self.adapters.get(name) is None:
            served = [*self.settings.served_model_names, *self.adapters.names()]
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(map(repr, served))}", param="model", code="model_not_found")
        return name

    def require_ready(self) -> None:
        """Routes that need the tokenizer answer 503 (or report the failure) until it is there."""
        engine = self.engine
        if engine.error is not None:
            raise APIError(503, f"the engine has failed: {engine.error}", code="engine_dead")
        if not engine.ready:
            raise APIError(503, "the model is still loading", code="not_ready", headers={"Retry-After": "5"})

    async def read(self, request: Request, schema: type) -> Any:
        """The body as ``schema``, after the size, syntax, depth and Unicode checks (body.py)."""
        settings = self.settings
        return await read_request(request, schema, max_bytes=settings.max_body_bytes,
                                  max_depth=settings.max_json_depth)

    async def read_generation_request(self, request: Request, schema: type) -> tuple[Any, str]:
        """The body of a generation route, validated against ``schema``, its own checks and the
        stop limits, and the model it resolves to, once the engine is ready: the preamble both
        routes share."""
        body = await self.read(request, schema)
        body.check()
        model = self.resolve_model(body.model)
        self.require_ready()
        self.limits.check_stops(body.stop_strings, body.stop_token_ids)
        return body, model

    async def constrain(self, body: Any, params: SamplingParams,
                        forced: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """``params`` with the request's structured-output constraint, if it asks for one,
        compiled first (off the event loop) so that an invalid one is a 400 naming it.
        ``forced``: the constraint of tool_choice required / named, which excludes any other."""
        found = requested_constraint(body)
        if forced is not None:
            if found is not None:
                raise bad_request(f"{found[1]} cannot be combined with a required or named tool_choice",
                                  found[1])
            found = (forced, "tool_choice")
        if found is None:
            return params
        spec, param = found
        try:
            constrained = replace(params, structured_outputs=spec)
        except ValueError as exc:
            raise bad_request(str(exc), param) from None
        await compile_or_400(self.engine.grammar_compiler, spec, param)
        return constrained

    async def submit(self, items: Sequence[tuple[str, PromptType, SamplingParams]],
                     prompt_param: str = "prompt", field_names: Optional[dict[str, str]] = None,
                     model: Optional[str] = None) -> OutputCollector:
        """Hands requests to the engine, mapping its refusals to HTTP errors. A refusal names
        the request's own field: ``prompt_param`` for the prompt (chat's ``messages``),
        ``field_names`` for sampling fields sent under another name (chat's
        ``max_completion_tokens``). ``model``: the served name resolved, whose LoRA adapter
        (if it names one) the requests run with."""
        try:
            return await self.engine.add_requests(items, self.adapters.get(model))
        except RequestTooLargeError as exc:
            many = any(params.n > 1 for _, _, params in items)
            raise bad_request(str(exc), "n" if many else prompt_param, code="too_many_sequences") from None
        except ValueError as exc:
            param = getattr(exc, "param", None) or param_from_message(str(exc))
            param = prompt_param if param == "prompt" else (field_names or {}).get(param or "", param)
            if isinstance(exc, ContextLengthError) and prompt_param == "messages":
                exc = exc.said_of("messages")
            code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
            raise bad_request(str(exc), param, code=code) from None
        except QueueFullError as exc:
            raise APIError(503, f"the server is overloaded: {exc}", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineNotReadyError as exc:
            raise APIError(503, str(exc), code="not_ready", headers={"Retry-After": "5"}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except Exception as exc:  # the engine failed this request without dying
            error = internal_error("the engine failed to add a request", exc)
            error.code = "engine_error"
            raise error from None

    async def load_adapter(self, name: str, path: str) -> None:
        """Has the engine read and check an adapter, then serves it under ``name``: a bad
        adapter (or LoRA not enabled) is a 400 naming the field at fault."""
        try:
            lora = self.adapters.new(name, path)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_name") from None
        try:
            await self.engine.load_lora(lora)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_path") from None
        except EngineNotReadyError as exc:
            raise APIError(503, str(exc), code="not_ready", headers={"Retry-After": "5"}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        try:
            self.adapters.register(lora)
        except ValueError as exc:  # the same name loaded meanwhile by another request
            raise bad_request(str(exc), "lora_name") from None
        logger.info("serving LoRA adapter %r from %s", name, path)

    async def check_adapters(self) -> None:
        """Once the engine is ready, has it read and check each ``--lora-modules`` adapter; one
        it cannot serve is logged and not served (its requests get 404)."""
        for lora in self.adapters.all():
            try:
                await self.engine.load_lora(lora)
            except Exception as exc:
                self.adapters.remove(lora.lora_name)
                logger.error("--lora-modules %s=%s cannot be served, so it is not: %s", lora.lora_name,
                             lora.lora_path, exc)

    def unload_adapter(self, name: str) -> None:
        """Stops serving ``name`` (requests running with it finish with it); 404 if unknown."""
        try:
            lora = self.adapters.remove(name)
        except KeyError:
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded", param="lora_name",
                           code="model_not_found") from None
        self.engine.unload_lora(lora.lora_int_id)
        logger.info("stopped serving LoRA adapter %r", name)

    async def wait_finished(self, request: Request, collector: OutputCollector) -> dict[str, RequestOutput]:
        """The final output of each request; aborts them if the client disconnects first."""
        finals: dict[str, RequestOutput] = {}
        ids = collector.request_ids
        try:
            async with DisconnectWatch(request, lambda: self._abandon(collector)):
                while not collector.finished:
                    finals.update(await collector.next())
        except EngineDeadError as exc:
            raise engine_gone(exc) from None
        except _ClientGone:
            raise APIError(499, "the client disconnected", code="client_disconnected") from None
        finally:
            if not collector.finished:
                self.engine.abort(ids)
        return finals

    def _abandon(self, collector: OutputCollector) -> None:
        self.engine.abort(collector.request_ids)
        collector._fail(_ClientGone())

    async def chat_messages(self, messages: list[ChatMessage], n: int = 1,
                            param: str = "messages") -> list[dict[str, Any]]:
        """The messages as the template takes them, within the message limit; converted off the
        loop when they hold many content parts (up to hundreds of thousands fit in a body).
        ``param``: the request field a refusal names (``/v1/responses`` builds them from ``input``)."""
        self.limits.check_messages(len(messages), n, param)
        if content_parts(messages) > OFFLOAD_PARTS:
            return await asyncio.to_thread(template_messages, messages)
        return template_messages(messages)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          limit_tokens: bool = True,
                          tools: Optional[list[dict[str, Any]]] = None,
                          param: str = "messages") -> tuple[str, list[int]]:
        """Renders the chat template (``--chat-template`` or the tokenizer's) and tokenizes it,
        within the character limit and, with ``limit_tokens``, the token limit (``/tokenize``
        reports any count). ``param``: the request field a refusal names."""
        limits = self.limits
        limits.check_message_chars(messages, param)
        template = self.settings.chat_template
        if template is None and not getattr(self.engine.tokenizer, "chat_template", None):
            raise bad_request("the model's tokenizer has no chat template; start the server with "
                              "--chat-template", "messages", code="no_chat_template")
        if tools and not template_supports_tools(template or self.engine.tokenizer.chat_template):
            raise bad_request("the chat template does not support tools (it never reads 'tools'); start the "
                              "server with a --chat-template that does, or send no tools", "tools",
                              code="tools_unsupported")
        text, ids = await self.tokenizer.render_chat(messages, template, add_generation_prompt, tools)
        if limit_tokens:
            limits.check_tokens(len(ids), "the rendered messages", param)
        return text, ids


class _ClientGone(Exception):
    """Raised into a waiting handler when its client has disconnected."""


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

