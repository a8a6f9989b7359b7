"""The request body of ``POST /v1/responses`` (OpenAI's Responses API) and the chat messages it
becomes.

The server keeps no state, so a request carries its whole conversation: ``instructions``
become a system message, ``input`` (a string, or a list of messages whose content is a string
or ``input_text`` / ``output_text`` parts) the rest, and from there the request takes the chat
route's path (template, sampling, engine, output). What this server cannot honour is refused
with a 400 naming the field, never ignored: stored responses and ``previous_response_id`` (no
state), tools, reasoning, background runs, image / file / audio inputs, non-text output
formats. Fields that change nothing here (``user``, ``metadata``, ``parallel_tool_calls``,
``service_tier``, ``prompt_cache_key``) are accepted.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from .errors import bad_request
from .protocol import ChatMessage, _Strict

# The SamplingParams field each of this route's fields feeds, where the names differ.
FIELD_NAMES = {"max_tokens": "max_output_tokens"}
TEXT_PARTS = ("input_text", "output_text")


class InputPart(_Strict):
    """One content part of an input message (other part types carry fields ignored here)."""

    type: str
    text: Optional[str] = None


class InputItem(_Strict):
    """An item of ``input``: a message, in the short form (``role`` + ``content``) or the typed
    one (``type: "message"``, which earlier assistant turns use with ``output_text`` parts)."""

    type: Optional[str] = None
    role: Optional[Literal["system", "developer", "user", "assistant"]] = None
    content: Union[str, list[InputPart], None] = None

    def chat_message(self, index: int) -> ChatMessage:
        """This item as a chat message, or a 400 saying what about it is not supported."""
        where = f"input[{index}]"
        if self.type not in (None, "message"):
            why = " (tools are not supported)" if "call" in self.type else ""
            raise bad_request(f"{where}: items of type {self.type!r} are not supported{why}; send messages "
                              "with a role and text content", "input")
        if self.role is None:
            raise bad_request(f"{where}: a message needs a role (system, developer, user or assistant)", "input")
        if self.content is None:
            raise bad_request(f"{where}: a message needs content (a string or a list of text parts)", "input")
        return ChatMessage(role=self.role, content=self._text(where))

    def _text(self, where: str) -> str:
        """The content as one string (text parts joined by newlines, as chat joins them)."""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content or []):
            if part.type not in TEXT_PARTS or part.text is None:
                raise bad_request(f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are supported, "
                                  f"got {part.type!r}; image, file and audio inputs are not", "input")
            texts.append(part.text)
        return "\n".join(texts)


class ResponsesRequest(_Strict):
    model: Optional[str] = None
    input: Union[list[InputItem], str]  # the list first: its errors name the item and field
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    # Accepted in the values that mean "nothing beyond plain text, no state"; refused otherwise.
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    conversation: Union[str, dict[str, Any], None] = None
    background: Optional[bool] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    reasoning: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    text: Optional[dict[str, Any]] = None
    truncation: Optional[str] = None
    top_logprobs: Optional[int] = None
    prompt: Optional[dict[str, Any]] = None

    def check(self) -> None:
        """Refuses what a stateless, text-only server cannot do, naming the field."""
        for refusal in (self._state_refusal(), self._feature_refusal(), self._output_refusal()):
            if refusal is not None:
                raise bad_request(refusal[1], refusal[0], code="unsupported_parameter")
        if self.input == "" or self.input == []:
            raise bad_request("input is empty", "input")

    def _state_refusal(self) -> Optional[tuple[str, str]]:
        if self.store:
            return "store", "store: true is not supported: this server keeps no responses (send store: false)"
        if self.previous_response_id is not None:
            return "previous_response_id", ("previous_response_id is not supported: this server keeps no "
                                            "responses; send the earlier turns in input instead")
        if self.conversation is not None:
            return "conversation", "conversation is not supported: this server keeps no conversations"
        if self.background:
            return "background", "background: true is not supported: responses are answered in the request"
        if self.prompt is not None:
            return "prompt", "prompt (stored prompt templates) is not supported; send instructions and input"
        return None

    def _feature_refusal(self) -> Optional[tuple[str, str]]:
        if self.tools:
            return "tools", "tools are not supported on /v1/responses (use /v1/chat/completions for tool calling)"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool_choice is not supported on /v1/responses (no tools are)"
        if self.reasoning and any(value is not None for value in self.reasoning.values()):
            return "reasoning", "reasoning is not supported: this server has no reasoning settings"
        if self.include:
            return "include", f"include is not supported (asked for {', '.join(self.include)})"
        return None

    def _output_refusal(self) -> Optional[tuple[str, str]]:
        form = (self.text or {}).get("format")
        kind = form.get("type") if isinstance(form, dict) else form
        if kind not in (None, "text"):
            return "text", (f"text.format {kind!r} is not supported on /v1/responses: only plain text "
                            "(use response_format on /v1/chat/completions for structured outputs)")
        if self.truncation not in (None, "disabled"):
            return "truncation", ("truncation 'auto' is not supported: input that does not fit the context "
                                  "is a 400")
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs is not supported on /v1/responses"
        return None

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: instructions first, as a system message."""
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        if isinstance(self.input, str):
            return messages + [ChatMessage(role="user", content=self.input)]
        return messages + [item.chat_message(i) for i, item in enumerate(self.input)]

    # What ServerState.read_generation_request checks of every generation route.
    @property
    def stop_strings(self) -> list[str]:
        return []

    @property
    def stop_token_ids(self) -> None:
        return None
