"""Reading a request body: content type, size, UTF-8, nesting depth, JSON syntax and the
request model, each checked before anything acts on what the body says.

The hostile bodies this stops, each with a 400 in OpenAI's error shape (413 for size):

- Deep nesting. ``json.loads`` recurses once per level, so ``[[[...]]]`` 1,000 or 100,000 deep
  raised ``RecursionError`` (a 500). A byte scan measures the bracket depth outside string
  literals before parsing: one regex pass to drop the strings and a running sum computed by
  C-level iterators, stopping at the first level over the limit. Bodies with fewer brackets
  than the limit skip it. Real requests nest about 5 deep (messages[i].content[j].text).
- Text that is not Unicode. JSON lets a string hold a lone UTF-16 surrogate as an escape
  (``"\\ud800"``), and the body may carry one UTF-8-encoded (bytes ``ED A0 80``, which Python's
  ``json`` passes through). Such a string cannot be encoded as UTF-8, so a tokenizer, a log
  line or a response raised on it. Every string of the parsed body, keys included, is
  checked, and the 400 names the field. Bytes that are not UTF-8 at all are a 400 too: JSON
  between systems is UTF-8 (RFC 8259); a leading UTF-8 byte order mark is ignored.
- Large bodies are parsed and validated on a worker thread (``asyncio.to_thread``), so a
  16 MiB body does not hold the event loop (``/health``, other streams) while it is parsed.
  The raw bytes and the decoded text are dropped as soon as the parsed object exists.
"""
from __future__ import annotations

import asyncio
import json
import operator
import re
from itertools import accumulate, repeat
from typing import Any, Optional

from fastapi import Request

from .errors import APIError, bad_request
from .protocol import validate

# Bodies above this size are parsed off the event loop; below it a thread hop costs more than
# the parse (a 64 KiB body parses in well under a millisecond).
OFFLOAD_BYTES = 64 * 1024

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# Brackets become 2 (openers) or 0 (closers), everything else is deleted: minus one, a +1/-1 step.
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# A lone surrogate can only come from a \uD800-\uDFFF escape or UTF-8-encoded bytes ED A0-BF:
# bodies with neither (nearly all) skip the walk over the parsed object.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89abAB]|\\u[dD][c-fC-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_BOM = b"\xef\xbb\xbf"


async def read_request(request: Request, schema: type, *, max_bytes: int, max_depth: int) -> Any:
    """The body as an instance of ``schema`` (a pydantic model), every check above applied."""
    raw = await read_body(request, max_bytes)
    if len(raw) > OFFLOAD_BYTES:
        return await asyncio.to_thread(parse_request, raw, schema, max_depth)
    return parse_request(raw, schema, max_depth)


async def read_body(request: Request, max_bytes: int) -> bytearray:
    """The raw body, after the content type and size checks (the size as it arrives, so an
    oversized body is refused without being buffered whole)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise bad_request(f"Content-Type must be application/json, got {content_type or 'none'!r}",
                          code="invalid_content_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return body


def parse_request(raw: bytearray, schema: type, max_depth: int) -> Any:
    """``parse_json_object`` then ``validate``: the synchronous part, run off the loop when large."""
    return validate(schema, parse_json_object(raw, max_depth))


def parse_json_object(raw: bytes | bytearray, max_depth: int) -> dict[str, Any]:
    """A JSON object from UTF-8 bytes, refusing deep nesting, bad UTF-8 and lone surrogates."""
    if nested_deeper_than(raw, max_depth):
        raise _too_deep(max_depth)
    obj = _loads(raw, max_depth)
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}",
                          code="invalid_json")
    if _MAYBE_SURROGATE.search(raw):
        _check_unicode(obj)
    return obj


def nested_deeper_than(raw: bytes | bytearray, limit: int) -> bool:
    """Whether brackets outside string literals nest more than ``limit`` deep.

    Malformed input is not judged here (``json.loads`` reports it); an unterminated string
    only makes the scan count its brackets too, which can refuse a body that was broken anyway.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    steps = _STRING.sub(b"", raw).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    depths = accumulate(map(operator.sub, steps, repeat(1)))
    return next(filter(limit.__lt__, depths), None) is not None


def _loads(raw: bytes | bytearray, max_depth: int) -> Any:
    start = len(_BOM) if raw.startswith(_BOM) else 0
    try:
        # surrogatepass: UTF-8-encoded surrogates decode, so the check below can name the field.
        # (Sliced only when there is a BOM: a slice copies the whole body.)
        text = (raw[start:] if start else raw).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise bad_request(f"malformed JSON body: it is not UTF-8 ({exc.reason} at byte {exc.start + start})",
                          code="invalid_json") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # the scan bounds depth; this is the backstop should the two disagree
        raise _too_deep(max_depth) from None
    except ValueError as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _check_unicode(obj: Any) -> None:
    """Raises a 400 naming the first string (or key) that holds a lone surrogate."""
    found = _lone_surrogate(obj)
    if found is None:
        return
    reversed_path, match, in_key = found
    where = _format_path(reversed_path[::-1])
    what = f"a key of {where}" if in_key else where
    param = reversed_path[-1] if reversed_path and isinstance(reversed_path[-1], str) else None
    raise bad_request(f"{what} is not valid Unicode: it holds a lone UTF-16 surrogate "
                      f"(U+{ord(match.group()):04X} at character {match.start()}); send well-formed text",
                      param, code="invalid_unicode")


def _lone_surrogate(value: Any) -> Optional[tuple[list[Any], re.Match, bool]]:
    """The first lone surrogate under ``value``: (its path, innermost first; the match; whether
    it is in a key, the path then naming the key's object). Recursion is bounded by the depth
    check that ran before parsing."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        return ([], match, False) if match else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and (match := _SURROGATE.search(key)):
            return [], match, True
        if isinstance(item, (str, dict, list)) and (found := _lone_surrogate(item)):
            found[0].append(key)
            return found
    return None


def _format_path(path: list[Any]) -> str:
    """``messages[0].content`` from ``["messages", 0, "content"]`` (long keys shortened)."""
    out = ""
    for part in path:
        name = part if len(str(part)) <= 40 else str(part)[:40] + "..."
        out += f"[{name}]" if isinstance(part, int) else (f".{name}" if out else str(name))
    return out or "the body"


def _too_deep(limit: int) -> APIError:
    return bad_request(f"the JSON body is nested more than {limit} levels deep, over the limit "
                       f"(--max-json-depth {limit})", code="json_too_deep")


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")
