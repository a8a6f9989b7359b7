"""``vgraph`` with ``ServerSettings`` overridden and faults injected, from the environment.

Run as a script by test_hostile_input.py, like fail_engine.py: it reaches settings that have
no flag yet and failures that no well-formed server produces, in a real process, without any
hook in the product code.

- ``VGRAPH_TEST_SETTINGS``: a JSON object of ``ServerSettings`` fields to replace.
- ``VGRAPH_TEST_TOKENIZER_FAULT``: text that makes the tokenizer's ``encode`` raise a
  ``RuntimeError`` (an unexpected tokenizer failure) for any input that contains it. The
  tokenizer class is patched when a tokenizer is loaded, in the server process (its own
  copies, with the engine out of process) and in the engine's (in process); the engine-core
  process imports this module too (spawn re-imports the main module), where it changes nothing
  that matters, since prompts reach it as token ids.
- ``VGRAPH_TEST_BREAK_VERSION``: ``/version`` returns a value FastAPI cannot serialize, so
  the exception escapes every route handler (the last-resort path).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from vgraph.models import loader
from vgraph.server import lifecycle, routes_misc

_SETTINGS = json.loads(os.environ.get("VGRAPH_TEST_SETTINGS", "{}"))
_FAULT = os.environ.get("VGRAPH_TEST_TOKENIZER_FAULT")
_build_app = lifecycle.build_app
_load_tokenizer = loader.load_tokenizer


class _Unserializable:
    __slots__ = ()


def _faulty_tokenizer_class(cls: type) -> None:
    encode = cls.encode

    def faulty_encode(self: Any, text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str) and _FAULT and _FAULT in text:
            raise RuntimeError("injected tokenizer failure")
        return encode(self, text, *args, **kwargs)

    cls.encode = faulty_encode


def _build(settings: Any, engine: Any, **kwargs: Any) -> Any:
    return _build_app(dataclasses.replace(settings, **_SETTINGS), engine, **kwargs)


def _load_faulty_tokenizer(*args: Any, **kwargs: Any) -> Any:
    tokenizer = _load_tokenizer(*args, **kwargs)
    if _FAULT:  # class-level, so every copy made of the tokenizer fails too
        _faulty_tokenizer_class(type(tokenizer))
    return tokenizer


lifecycle.build_app = _build
loader.load_tokenizer = _load_faulty_tokenizer
if os.environ.get("VGRAPH_TEST_BREAK_VERSION"):
    routes_misc.__version__ = _Unserializable()  # type: ignore[assignment]

if __name__ == "__main__":
    from vgraph.cli import main
    sys.exit(main())
