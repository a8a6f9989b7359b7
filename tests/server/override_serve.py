"""``vgraph`` with ``ServerSettings`` overridden and faults injected, from the environment.

Run as a script by test_hostile_input.py, like fail_engine.py: it reaches settings that have
no flag yet and failures that no well-formed server produces, in a real process, without any
hook in the product code.

- ``VGRAPH_TEST_SETTINGS``: a JSON object of ``ServerSettings`` fields to replace.
- ``VGRAPH_TEST_TOKENIZER_FAULT``: text that makes the tokenizer's ``encode`` raise a
  ``RuntimeError`` (an unexpected tokenizer failure) for any input that contains it.
- ``VGRAPH_TEST_BREAK_VERSION``: ``/version`` returns a value FastAPI cannot serialize, so
  the exception escapes every route handler (the last-resort path).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from vgraph import cli
from vgraph.server import routes_misc

_SETTINGS = json.loads(os.environ.get("VGRAPH_TEST_SETTINGS", "{}"))
_FAULT = os.environ.get("VGRAPH_TEST_TOKENIZER_FAULT")
_server_settings = cli._server_settings
_llm_from_args = cli._llm_from_args


class _Unserializable:
    __slots__ = ()


def _faulty_tokenizer_class(cls: type) -> None:
    encode = cls.encode

    def faulty_encode(self: Any, text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str) and _FAULT and _FAULT in text:
            raise RuntimeError("injected tokenizer failure")
        return encode(self, text, *args, **kwargs)

    cls.encode = faulty_encode


def _settings(*args: Any, **kwargs: Any) -> Any:
    return dataclasses.replace(_server_settings(*args, **kwargs), **_SETTINGS)


def _llm(*args: Any, **kwargs: Any) -> Any:
    llm = _llm_from_args(*args, **kwargs)
    if _FAULT:  # class-level, so the copies AsyncEngine makes of the tokenizer fail too
        _faulty_tokenizer_class(type(llm.engine.tokenizer))
    return llm


cli._server_settings = _settings
cli._llm_from_args = _llm
if os.environ.get("VGRAPH_TEST_BREAK_VERSION"):
    routes_misc.__version__ = _Unserializable()  # type: ignore[assignment]

if __name__ == "__main__":
    from vgraph.cli import main
    sys.exit(main())
