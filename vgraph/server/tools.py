"""Tool calling in chat completions: the request's ``tools`` and ``tool_choice``, the prompt
(through the chat template's own tool support), and the reply's ``tool_calls``.

- ``auto``: the tools are rendered into the prompt and the reply is read by the server's
  ``--tool-call-parser`` (tool_parsers.py); calls found become ``tool_calls`` (finish_reason
  "tool_calls"), the rest stays content. Without a parser, ``auto`` is a 400 saying so.
- ``required``: the reply is constrained (structured outputs) to a JSON array of
  ``{"name": <one of the tools>, "parameters": <its parameters schema>}`` (one element when
  ``parallel_tool_calls`` is false; bounded as ``required_schema`` says otherwise), so a reply
  that ends is always a valid list of calls.
- a named function: the reply is constrained to that function's parameters schema and is its
  arguments.

A reply cut off by ``max_tokens`` (finish_reason "length") never presents its unfinished call
as a call: only the calls whose JSON is complete are returned (none for a named function whose
arguments were cut). Streaming has already sent the unfinished call's fragments by then; the
"length" finish_reason is what tells the client to drop it.
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
from .tool_parsers import (CallDelta, Plan, PartialCall, ToolCall, ToolParser, get_parser, partial_call, read_calls,
                           skip_ws)

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ANY_OBJECT = {"type": "object"}
# The bounds required_schema puts on parallel calls (see its docstring for why these values).
MAX_PARALLEL_CALLS = 4
MAX_ARGUMENT_STRING = 64


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
    """A JSON array of one or more calls, each naming a tool and giving its parameters.

    With parallel calls the grammar must also end: after each call a model may write ``,`` and
    another call, and inside a string it may go on writing characters, so an unbounded schema
    lets a weak or random model add calls or stretch one string until ``max_tokens`` cuts the
    JSON (15 of 20 seeds on the demo model, temperature 1, max_tokens 256). So the list is
    bounded: at most ``MAX_PARALLEL_CALLS`` calls (4: more in one turn are rare, and a client
    can loop), and, in each call's parameters, strings without a ``maxLength`` get
    ``MAX_ARGUMENT_STRING`` (64 characters: names, places, ids, short queries) and objects
    that list ``properties`` without saying ``additionalProperties`` take no others (as
    OpenAI's strict mode does). The bounds make the list end, not end within any given
    ``max_tokens``: a reply cut anyway returns only its whole calls (``RequiredCalls.parse``).
    Every list the bounded grammar allows is valid against the tools' own schemas; what a
    schema states explicitly is never loosened or tightened. A single call (parallel calls off)
    is left unbounded: it ends on its own, as a named function's arguments do.
    """
    def call(f: FunctionTool) -> dict[str, Any]:
        parameters = bounded_arguments(f.parameters) if parallel else f.parameters
        return {"type": "object", "properties": {"name": {"const": f.name}, "parameters": parameters},
                "required": ["name", "parameters"], "additionalProperties": False}

    calls = [call(f) for f in functions]
    return {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def bounded_arguments(schema: Any) -> Any:
    """A copy of a parameters schema with the bounds ``required_schema`` explains: unbounded
    strings get ``maxLength``, objects with ``properties`` and no ``additionalProperties`` get
    false. Anything that is not a schema object (``true``, a malformed value) is returned as
    is, so the structured-output compiler still reports it as the client wrote it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if is_string and not {"maxLength", "enum", "const", "pattern", "format"} & out.keys():
        out["maxLength"] = MAX_ARGUMENT_STRING
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_arguments(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_arguments(s) for name, s in out[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = bounded_arguments(out[key])
    return out


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
        """The call, or none when the arguments are not a whole JSON object (cut by max_tokens)."""
        arguments = text.strip()
        return None, [ToolCall(self.function, arguments)] if _is_object(arguments) else []

    def plan(self, text: str, finished: bool) -> Plan:
        return Plan(calls=[PartialCall(self.function, text)])


class RequiredCalls(ToolParser):
    """The reply is a JSON array of ``{"name", "parameters"}`` (constrained by ``required_schema``)."""

    ARGS = ("parameters",)

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """The calls whose JSON object is complete; one cut off by max_tokens is not a call."""
        calls: list[ToolCall] = []
        pos = skip_ws(text, 0)
        if not text.startswith("[", pos):
            return None, calls
        pos = skip_ws(text, pos + 1)
        while text.startswith("{", pos):
            call, end = partial_call(text, pos, self.ARGS)
            if end is None:
                break
            if call.name is not None and _is_object(call.arguments):
                calls.append(ToolCall(call.name, call.arguments))
            pos = skip_ws(text, end)
            if text.startswith(",", pos):
                pos = skip_ws(text, pos + 1)
        return None, calls

    def plan(self, text: str, finished: bool) -> Plan:
        plan = Plan()
        pos = skip_ws(text, 0)
        if not text.startswith("[", pos):
            return plan
        read_calls(text, skip_ws(text, pos + 1), self.ARGS, ",", plan)
        return plan


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


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
