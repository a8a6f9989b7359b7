"""Constraints whose outputs are bounded (enums, bounded integers, maxLength strings, compact
JSON), so a random-weight model finishes every request within max_tokens, and the checks that
an output obeys them. Shared by the offline and server tests."""
from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "admin", "tags"],
    "additionalProperties": False,
}
CODE_REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["yes", "no", "maybe so", 'say "hi"']
MAX_TOKENS = 96  # PERSON takes at most ~60 tokens of the demo tokenizer


def check_person(text: str) -> dict[str, Any]:
    """Parses and validates against PERSON; raises (AssertionError / ValidationError) otherwise."""
    obj = json.loads(text)
    jsonschema.validate(obj, PERSON)
    return obj


def check_code(text: str) -> None:
    assert re.fullmatch(CODE_REGEX, text), text


def check_choice(text: str) -> None:
    assert text in CHOICES, text


def json_prefix_ok(text: str) -> bool:
    """Whether ``text`` is a prefix of some JSON document: it parses, or every error is "the
    input ended" (an open string is closed and tried again). For json_object mode on a random
    model, whose strings rarely end before max_tokens."""
    for _ in range(64):
        try:
            json.loads(text)
            return True
        except json.JSONDecodeError as exc:
            if exc.msg.startswith("Unterminated string"):
                text = text[:-1] if _odd_backslashes(text) else text
                text += '"'
                continue
            rest = text[exc.pos:]
            return exc.pos >= len(text.rstrip()) or _partial_scalar(rest)
    return False


def _partial_scalar(rest: str) -> bool:
    """A literal or number cut short by the end of the input ("tr", "-1.", "2e")."""
    if any(lit.startswith(rest) for lit in ("true", "false", "null")):
        return True
    return re.fullmatch(r"-?\d*\.?\d*(?:[eE][+-]?\d*)?", rest) is not None


def _odd_backslashes(text: str) -> bool:
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1
