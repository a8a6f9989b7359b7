"""Tool calling in chat completions: the request's ``tools`` and ``tool_choice``, the prompt
(through the chat template's own tool support), and the reply's ``tool_calls``.

- ``auto``: the tools are rendered into the prompt and the reply is read by the server's
  ``--tool-call-parser`` (tool_parsers.py); calls found become ``tool_calls`` (finish_reason
  "tool_calls"), the rest stays content. Without a parser, ``auto`` is a 400 saying so.
- ``required``: the reply is constrained (structured outputs) to a JSON array of
  ``{"name": <one of the tools>, "parameters": <its parameters schema>}`` (one element when
  ``parallel_tool_calls`` is false), so it is always a valid list of calls.
- a named function: the reply is constrained to that function's parameters schema and is its
  arguments.
- ``none``: the tools are neither offered to the template nor parsed.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from ..structured.params import StructuredOutputsParams
from .errors import bad_request
from .tool_parsers import CallDelta, Plan, PartialCall, ToolCall, ToolParser, get_parser, read_calls, skip_ws

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: Optional[str]
    parameters: dict[str, Any]

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass
class ToolSetup:
    """What a chat request asks of tools: those offered to the template, how to read the reply,
    and the structured-output constraint that enforces required / named calls."""

    tools: list[FunctionTool] = field(default_factory=list)
    parser: Optional[ToolParser] = None
    constraint: Optional[StructuredOutputsParams] = None

    @property
    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        return [t.template_entry() for t in self.tools] or None

    def choice_tools(self) -> Optional["ChoiceTools"]:
        """A fresh reader for one choice, or None when replies are plain content."""
        return None if self.parser is None else ChoiceTools(self.parser)


def tool_setup(tools: Optional[list[Any]], tool_choice: Any, parallel_tool_calls: Optional[bool],
               parser_name: Optional[str]) -> ToolSetup:
    """Validates ``tools`` / ``tool_choice`` (400s naming the field) and resolves them."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolSetup()
    functions = [_function_tool(t, i) for i, t in enumerate(tools)]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolSetup()
    if choice == "auto":
        if parser_name is None:
            raise bad_request('tool_choice "auto" needs a tool-call parser: start the server with '
                              "--tool-call-parser (hermes or llama3_json), or use tool_choice "
                              '"required" or a named function', "tool_choice")
        return ToolSetup(functions, get_parser(parser_name))
    if choice == "required":
        schema = required_schema(functions, parallel_tool_calls is not False)
        return ToolSetup(functions, RequiredCalls(), StructuredOutputsParams(json=schema))
    name = _named_choice(choice)
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"({', '.join(names)})", "tool_choice")
    tool = functions[names.index(name)]
    return ToolSetup(functions, NamedCall(name), StructuredOutputsParams(json=tool.parameters))


def _function_tool(tool: Any, index: int) -> FunctionTool:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}} (only function tools '
                          "are supported)", "tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters", _ANY_OBJECT)
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
    return FunctionTool(name, description, parameters)


def _named_choice(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if isinstance(name, str):
            return name
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', "tool_choice")


def required_schema(functions: list[FunctionTool], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each naming a tool and giving its parameters."""
    calls = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def template_tool_calls(tool_calls: list[Any], index: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates take them: arguments as an object
    (templates write them with ``tojson``), or as given when they are not JSON."""
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"messages[{index}].tool_calls: each call needs function.name", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# ----------------------------------------------------------------------------- forced replies


class NamedCall(ToolParser):
    """The reply is the named function's arguments (constrained to its parameters schema)."""

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        return None, [ToolCall(self.function, text.strip())]

    def plan(self, text: str, finished: bool) -> Plan:
        return Plan(calls=[PartialCall(self.function, text)])


class RequiredCalls(ToolParser):
    """The reply is a JSON array of ``{"name", "parameters"}`` (constrained by ``required_schema``)."""

    ARGS = ("parameters",)

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        plan = self.plan(text, True)
        return None, [ToolCall(c.name, c.arguments) for c in plan.calls if c.name is not None]

    def plan(self, text: str, finished: bool) -> Plan:
        plan = Plan()
        pos = skip_ws(text, 0)
        if not text.startswith("[", pos):
            return plan
        read_calls(text, skip_ws(text, pos + 1), self.ARGS, ",", plan)
        return plan


# ----------------------------------------------------------------------------- replies


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceTools:
    """One choice's tool calls: the whole reply's message, or its stream of deltas (with the
    call ids fixed at each call's first delta)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.streamer = parser.streamer()
        self.ids: list[str] = []

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """The assistant message of a finished reply and its finish_reason."""
        content, calls = self.parser.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            return message, finish_reason
        message["tool_calls"] = [{"id": call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The delta for the reply's cumulative ``text``: new content and new call pieces."""
        content, calls = self.streamer.feed(text, finished)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [self._call_delta(d) for d in calls]
        return delta

    def _call_delta(self, d: CallDelta) -> dict[str, Any]:
        if d.name is None:
            return {"index": d.index, "function": {"arguments": d.arguments}}
        self.ids.append(call_id())
        return {"index": d.index, "id": self.ids[d.index], "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}

    def finish_reason(self, finish_reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if finish_reason == "stop" and self.streamer.sent_calls else finish_reason
