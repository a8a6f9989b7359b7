"""Request bodies of the OpenAI-compatible API, and how they become ``SamplingParams``.

Models are strict (``"5"`` is not an integer, ``true`` is not a number): a client that sends
the wrong type gets a 400 naming the field rather than a silently coerced value. Unknown
fields are ignored, as in vLLM, because OpenAI clients add fields (``user``, metadata) that
change nothing here; fields that *would* change the result but are not supported
(``logit_bias``, ``suffix``, ``best_of`` > n) are rejected explicitly instead of being ignored.
Structured-output fields (``response_format`` and vLLM's ``guided_*`` / ``structured_outputs``)
are read by ``structured.py``.

Every integer a request may carry has a range (``INT_RANGES``), checked in ``validate`` for
every route, so a number is refused with a 400 naming its field before anything else sees it:
nothing past these bounds reaches the sampler, the tokenizer or the engine process's codec
(msgpack carries at most 64 bits; one value beyond that once failed the send and wedged
admission). The ranges are generous where the engine narrows them further with its own facts
(``max_tokens`` against ``max_model_len``, token ids against the vocabulary, ``logprobs``
against ``--max-logprobs``); ``test_integer_bounds.py`` sends the boundary values to every route
on both engine layouts.
"""
from __future__ import annotations

import math
import re
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling_params import SamplingParams
from .errors import bad_request
from .tools import template_tool_calls

MAX_N = 128  # choices per prompt, OpenAI's limit
# Seeds seed torch's 64-bit generator, and choice i of a request uses seed + i: a signed 64-bit
# seed plus at most MAX_N - 1 still fits the unsigned 64 bits torch accepts.
SEED_RANGE = (-2**63, 2**63 - 1)


INT32_MAX = 2**31 - 1
TOKEN_ID_RANGE = (0, INT32_MAX)  # any token id; the engine checks it against the vocabulary

# The inclusive range of every integer request field, by field name, on every route that has
# it (for lists, of every item: stop_token_ids, and token-id prompts, inputs and tokens).
INT_RANGES: dict[str, tuple[int, int]] = {
    "n": (1, MAX_N),
    "best_of": (1, MAX_N),
    "max_tokens": (0, INT32_MAX),  # 0 only with echo; the prompt plus it must fit max_model_len
    "max_completion_tokens": (0, INT32_MAX),
    "max_output_tokens": (1, INT32_MAX),  # /v1/responses
    "min_tokens": (0, INT32_MAX),
    "top_k": (-1, INT32_MAX),  # -1 or 0: off; above the vocabulary size: every token
    "seed": SEED_RANGE,
    "logprobs": (0, INT32_MAX),  # completions; at most --max-logprobs
    "top_logprobs": (0, INT32_MAX),  # chat; at most --max-logprobs
    "stop_token_ids": TOKEN_ID_RANGE,
    "prompt": TOKEN_ID_RANGE,  # /v1/completions token-id prompts
    "input": TOKEN_ID_RANGE,  # /v1/embeddings token-id inputs
    "tokens": TOKEN_ID_RANGE,  # /detokenize
}
_RANGE_NAMES = {SEED_RANGE: "a 64-bit signed integer", TOKEN_ID_RANGE: "a token id"}
# Float fields have their ranges in SamplingParams.validate; all of them must be finite
# (``1e400`` parses as infinity).
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationFields(_Strict):
    """Fields shared by completions and chat: OpenAI's sampling fields plus vLLM's extras."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # Structured outputs (see structured.py): OpenAI's response_format and vLLM's extras.
    response_format: Optional[dict[str, Any]] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (OpenAI accepts one string or a list)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int], max_logprobs: int,
                        field_names: Optional[dict[str, str]] = None,
                        defaults: Optional[Mapping[str, Any]] = None) -> SamplingParams:
        """Builds validated ``SamplingParams``; a bad value is a 400 naming its field.

        ``field_names`` maps SamplingParams fields to this request's names where they differ
        (chat's ``top_logprobs``, ``max_completion_tokens``), so ``param`` names what was sent.
        ``defaults`` (``--generation-config``) fill the sampling settings the request left unset.
        """
        fields: dict[str, Any] = {
            "n": self.n, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids or [],
            "include_stop_str_in_output": self.include_stop_str_in_output, "ignore_eos": self.ignore_eos,
            "max_tokens": max_tokens, "min_tokens": self.min_tokens, "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens}
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                    "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty}
        return make_sampling_params(fields, optional, max_logprobs, field_names, defaults)


def make_sampling_params(fields: dict[str, Any], optional: dict[str, Any], max_logprobs: int,
                         field_names: Optional[dict[str, str]] = None,
                         defaults: Optional[Mapping[str, Any]] = None) -> SamplingParams:
    """Validated ``SamplingParams`` from a route's ``fields`` and its ``optional`` sampling
    settings (those left None take ``defaults``, then SamplingParams' own); one function for
    every generation route, so each gets the same checks and the same 400s naming its fields."""
    merged = {**fields, **(defaults or {}), **{k: v for k, v in optional.items() if v is not None}}
    try:
        params = SamplingParams(**merged)
        params.validate(max_logprobs)
    except ValueError as exc:
        param = param_from_message(str(exc))
        raise bad_request(str(exc), (field_names or {}).get(param or "", param)) from None
    return params


class CompletionRequest(_GenerationFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt field as a list of prompts (a string or token ids each)."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise bad_request("prompt is empty", "prompt")
        for i, prompt in enumerate(prompts):
            if prompt == "":  # token-id prompts are the engine's to check, as offline
                where = "the prompt" if len(prompts) == 1 else f"prompt {i}: the prompt"
                raise bad_request(f"{where} is empty", "prompt")
        return prompts

    def check(self) -> None:
        self.check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1; 0 is only allowed with echo (which then "
                              "returns the prompt alone, with its logprobs when logprobs is set)", "max_tokens")

    @property
    def prompt_logprobs(self) -> Optional[int]:
        """``echo`` with ``logprobs`` scores the prompt too (what evaluation harnesses ask)."""
        return self.logprobs if self.echo else None


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's calls (multi-turn tool use)
    tool_call_id: Optional[str] = None  # a tool message's answer to that call

    def as_template_input(self, index: int) -> dict[str, Any]:
        """``{"role", "content"}`` with text parts joined; other part types are rejected."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{index}]: only text content parts are supported, "
                                      f"got {part.type!r}", "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = template_tool_calls(self.tool_calls, index)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    echo: bool = False  # completions only: refused here
    tools: Optional[list[Any]] = None  # checked and resolved by tools.py
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None

    def check(self) -> None:
        self.check_common()
        check_chat_prefill_fields(self)
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def field_names(self) -> dict[str, str]:
        """Which request field each SamplingParams field came from."""
        names = {"logprobs": "top_logprobs" if self.top_logprobs is not None else "logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


def check_chat_prefill_fields(body: ChatCompletionRequest) -> None:
    """Chat always generates: no ``echo`` (a completions field) and at least one token."""
    if body.echo:
        raise bad_request("echo is not supported in chat completions (use /v1/completions)", "echo")
    if body.max_new_tokens == 0:
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise bad_request(f"{field} must be at least 1 (max_tokens 0 is for /v1/completions with echo)", field)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (see ``ChatMessage.as_template_input``)."""
    return [m.as_template_input(i) for i, m in enumerate(messages)]


def content_parts(messages: list[ChatMessage]) -> int:
    """How many pieces of content the messages hold (a string counts as one)."""
    return sum(len(m.content) if isinstance(m.content, list) else 1 for m in messages)


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a prompt, or chat messages rendered by the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's ``/v1/load_lora_adapter``: serve the PEFT folder ``lora_path`` as ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's ``/v1/unload_lora_adapter`` (``lora_int_id`` is accepted and not needed)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None


# ----------------------------------------------------------------------------- validation


def param_from_message(message: str) -> Optional[str]:
    """SamplingParams messages start with the field name ("top_p must be ..."); return it."""
    match = re.match(r"[a-z_]+", message)
    return match.group(0) if match and match.group(0) in SamplingParams.__dataclass_fields__ else None


def validate(model_cls: type[_Strict], obj: dict[str, Any]) -> Any:
    """``model_cls`` from a JSON object; the first problem becomes a 400 naming its field."""
    try:
        request = model_cls.model_validate(obj)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        param = str(first["loc"][0]) if first["loc"] else None
        where = ".".join(str(x) for x in first["loc"] if not _is_union_tag(x))
        if first["type"] == "missing":
            message = f"'{where}' is required"
        else:
            message = f"invalid value for '{where}': {first['msg']}"
        raise bad_request(message, param) from None
    check_ranges(request)
    return request


def check_ranges(request: BaseModel) -> None:
    """A 400 naming the first number outside its field's range (``INT_RANGES``) or not finite."""
    for name in type(request).model_fields:
        value = getattr(request, name)
        if name in INT_RANGES:
            low, high = INT_RANGES[name]
            bad = next((x for x in _ints(value) if not low <= x <= high), None)
            if bad is not None:
                what = _RANGE_NAMES.get((low, high), "an integer")
                each = " (each item)" if isinstance(value, list) else ""
                raise bad_request(f"{name}{each} must be {what} in [{low}, {high}]; got {bad}", name,
                                  code=f"{name}_out_of_range")
        elif name in FLOAT_FIELDS and isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number; got {value}", name, code=f"{name}_out_of_range")


def _ints(value: Any) -> list[int]:
    """The integers in a field's value: itself, or the items of its (nested) lists."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [x for item in value for x in _ints(item)]
    return []


def _is_union_tag(loc: Any) -> bool:
    """Pydantic names union branches in error locations ('list[int]'); they mean nothing to users."""
    return isinstance(loc, str) and ("[" in loc or loc in {"str", "int", "float", "bool"})
