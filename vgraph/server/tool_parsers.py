"""Tool-call parsers: find the calls a model wrote in its own format, whole or while streaming.

``--tool-call-parser`` picks one:

- ``hermes`` (Hermes, Qwen2.5): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  text outside the tags is content. A last call whose closing tag never came (the model stopped
  at EOS) still counts when its JSON is complete.
- ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole reply is ``{"name": ...,
  "parameters": {...}}`` (several joined by ``;``), optionally after ``<|python_tag|>``.

A malformed call (JSON that does not parse, no name, arguments that are not an object) is
plain content, tags and all: the parser never invents a call. While streaming, a call's name
is sent once its arguments have begun as an object, and cannot be taken back: a call that only
turns out malformed after that (JSON cut off or broken inside the arguments) is reported as
begun, while the non-streamed answer has its text as content. Arguments are returned as the JSON
text the model wrote (validated), so the streamed fragments add up to exactly the same string.

Streaming re-reads the cumulative text at each step (``ToolStreamer.feed``) and sends what is
new: content that can no longer turn into a call (a possible partial ``<tool_call>`` at the end
is held back), each call's name once it is complete, then its arguments as they grow.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class PartialCall:
    """A call as far as the text goes: its name once complete, its arguments' text so far."""

    name: Optional[str] = None
    arguments: str = ""


@dataclass
class Plan:
    """What the text so far says: content that is settled, and the calls begun."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


# ----------------------------------------------------------------------------- JSON scanning


def scan_object(text: str, start: int) -> tuple[dict[str, tuple[int, Optional[int]]], Optional[int]]:
    """The top-level keys of the JSON object at ``text[start]`` (``{``) with each value's span
    (end None while it is cut off), and the object's end (None while unclosed). Tolerant of a
    cut-off input; does not validate (json.loads does that once a span is complete)."""
    keys: dict[str, tuple[int, Optional[int]]] = {}
    i, n, depth = start + 1, len(text), 1
    key: Optional[str] = None
    value_start: Optional[int] = None
    expecting_key = True
    while i < n:
        ch = text[i]
        if ch == '"':
            end = _string_end(text, i)
            if end is None:
                break
            if depth == 1 and expecting_key:
                try:
                    key = json.loads(text[i:end])
                except ValueError:
                    key = None
            i = end
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                if key is not None and value_start is not None:
                    keys[key] = (value_start, _rstrip_to(text, value_start, i))
                return keys, i + 1
        elif depth == 1 and ch == ":":
            expecting_key = False
            value_start = skip_ws(text, i + 1)
            if key is not None:
                keys[key] = (value_start, None)
        elif depth == 1 and ch == ",":
            if key is not None and value_start is not None:
                keys[key] = (value_start, _rstrip_to(text, value_start, i))
            key, value_start, expecting_key = None, None, True
        i += 1
    return keys, None


def _string_end(text: str, i: int) -> Optional[int]:
    """Index after the closing quote of the string starting at ``text[i]``; None if cut off."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _rstrip_to(text: str, start: int, end: int) -> int:
    while end > start and text[end - 1] in " \t\r\n":
        end -= 1
    return end


def partial_call(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[PartialCall, Optional[int]]:
    """The call object at ``text[start]``: its name when complete and its arguments' text so
    far (only once the value is seen to be an object); and the object's end."""
    keys, end = scan_object(text, start)
    call = PartialCall()
    span = keys.get("name")
    if span is not None and span[1] is not None:
        try:
            name = json.loads(text[span[0]:span[1]])
            call.name = name if isinstance(name, str) else None
        except ValueError:
            pass
    for key in args_keys:
        span = keys.get(key)
        if span is not None and text[span[0]:span[0] + 1] == "{":
            call.arguments = text[span[0]:span[1] if span[1] is not None else len(text)]
            break
    return call, end


def read_calls(text: str, pos: int, args_keys: tuple[str, ...], separator: str, plan: "Plan") -> None:
    """Appends to ``plan`` the JSON calls from ``pos`` on, ``separator`` between them, the last
    possibly still being written: the one reading both parsers' lists and the required list."""
    while pos < len(text) and text[pos] == "{":
        call, end = partial_call(text, pos, args_keys)
        plan.calls.append(call)
        if end is None:
            return
        pos = skip_ws(text, end)
        if pos < len(text) and text[pos] == separator:
            pos = skip_ws(text, pos + 1)


def complete_call(obj_text: str, args_keys: tuple[str, ...]) -> Optional[ToolCall]:
    """A finished call from the text of one JSON object, or None when it is malformed."""
    try:
        obj = json.loads(obj_text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            call, _ = partial_call(obj_text, skip_ws(obj_text, 0), args_keys)
            text = call.arguments if call.arguments else json.dumps(args)
            return ToolCall(obj["name"], text)
    return ToolCall(obj["name"], "{}")


# ----------------------------------------------------------------------------- parsers


class ToolParser(ABC):
    """A model family's tool-call format: ``parse`` for a whole reply, ``plan`` for a reply
    still being written (what can be streamed so far)."""

    name = ""

    @abstractmethod
    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content or None, calls); a malformed call makes the whole reply content."""

    @abstractmethod
    def plan(self, text: str, finished: bool) -> Plan:
        """The calls (possibly partial) and content readable from ``text`` so far."""

    def streamer(self) -> "ToolStreamer":
        return ToolStreamer(self)


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    ARGS = ("arguments", "parameters")

    def _regions(self, text: str) -> list[tuple[int, int, Optional[int]]]:
        """(open tag start, body start, close tag end or None) of each call region."""
        regions = []
        pos = 0
        while True:
            begin = text.find(self.OPEN, pos)
            if begin < 0:
                return regions
            body = begin + len(self.OPEN)
            close = text.find(self.CLOSE, body)
            if close < 0:
                regions.append((begin, body, None))
                return regions
            regions.append((begin, body, close + len(self.CLOSE)))
            pos = close + len(self.CLOSE)

    def _region_call(self, text: str, body: int, end: Optional[int]) -> Optional[ToolCall]:
        inner = text[body:end - len(self.CLOSE)] if end is not None else text[body:]
        return complete_call(inner.strip(), self.ARGS)

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """Each well-formed region is a call; a malformed one stays in the content verbatim."""
        calls, content, pos = [], [], 0
        for begin, body, end in self._regions(text):
            stop = end if end is not None else len(text)
            call = self._region_call(text, body, end)
            content.append(text[pos:begin] if call is not None else text[pos:stop])
            if call is not None:
                calls.append(call)
            pos = stop
        if not calls:
            return text, []
        content.append(text[pos:])
        joined = "".join(content)
        return (joined if joined.strip() else None), calls

    def plan(self, text: str, finished: bool) -> Plan:
        plan = Plan()
        pos = 0
        for begin, body, end in self._regions(text):
            stop = end if end is not None else len(text)
            start = skip_ws(text, body)
            closed = end is not None or finished
            whole = self._region_call(text, body, end) if closed else None
            if closed and whole is None:
                plan.content += text[pos:stop]  # malformed: it was content after all
            else:
                plan.content += text[pos:begin]
                if whole is not None:
                    plan.calls.append(PartialCall(whole.name, whole.arguments))
                elif start < len(text) and text[start] == "{":
                    seen = text[:len(text) - _partial_tag(text, self.CLOSE)]  # not a half-written close tag
                    call, _ = partial_call(seen, start, self.ARGS)
                    plan.calls.append(call)
            pos = stop
        tail = text[pos:]
        if not finished:
            tail = tail[:len(tail) - _partial_tag(tail, self.OPEN)]
        plan.content += tail
        return plan


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    ARGS = ("parameters", "arguments")

    def _body_start(self, text: str) -> int:
        start = skip_ws(text, 0)
        if text.startswith(self.TAG, start):
            start = skip_ws(text, start + len(self.TAG))
        return start

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        pos = self._body_start(text)
        if not text.startswith("{", pos):
            return text, []
        decoder, calls = json.JSONDecoder(), []
        while pos < len(text):
            try:
                _, end = decoder.raw_decode(text, pos)
            except ValueError:
                return text, []
            call = complete_call(text[pos:end], self.ARGS)
            if call is None:
                return text, []
            calls.append(call)
            pos = skip_ws(text, end)
            if pos < len(text):
                if text[pos] != ";":
                    return text, []
                pos = skip_ws(text, pos + 1)
        return None, calls

    def plan(self, text: str, finished: bool) -> Plan:
        pos = self._body_start(text)
        rest = text[skip_ws(text, 0):]
        if not finished and (self.TAG.startswith(rest) or (rest.startswith(self.TAG) and pos >= len(text))):
            return Plan()  # nothing yet, or a (partial) python tag: wait
        if not text.startswith("{", pos) or (finished and not self.parse(text)[1]):
            return Plan(content=text)
        plan = Plan()
        read_calls(text, pos, self.ARGS, ";", plan)
        return plan


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()


# ----------------------------------------------------------------------------- streaming


@dataclass
class CallDelta:
    """One tool-call delta: the first of a call carries its name (and id), later ones
    argument fragments."""

    index: int
    name: Optional[str] = None
    arguments: str = ""


class ToolStreamer:
    """Turns a growing reply into content deltas and tool-call deltas, each sent once."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.names_sent = 0  # calls whose name has been sent
        self.args_sent: list[int] = []

    @property
    def sent_calls(self) -> bool:
        return self.names_sent > 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[CallDelta]]:
        """New content and call deltas given the cumulative ``text``."""
        plan = self.parser.plan(text, finished)
        # Whitespace is held until something follows it: a reply of calls separated by
        # newlines has no content, as in the non-streamed answer.
        if finished:
            ready = len(plan.content) if plan.content.strip() or not plan.calls else 0
        else:
            ready = len(plan.content.rstrip())
        content = plan.content[self.content_sent:ready]
        self.content_sent = max(self.content_sent, ready)
        deltas = []
        for i, call in enumerate(plan.calls):
            if i >= self.names_sent:
                # The name goes out once the arguments have begun as an object: a call whose
                # arguments turn out not to be one is then still plain content.
                if call.name is None or not call.arguments or i > self.names_sent:
                    break
                deltas.append(CallDelta(i, name=call.name))
                self.names_sent += 1
                self.args_sent.append(0)
            fragment = call.arguments[self.args_sent[i]:]
            if fragment:
                if deltas and deltas[-1].index == i:
                    deltas[-1].arguments += fragment
                else:
                    deltas.append(CallDelta(i, arguments=fragment))
                self.args_sent[i] = len(call.arguments)
        return content, deltas
