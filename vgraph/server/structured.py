"""Structured outputs on the HTTP API: which request field asks for which constraint, and the
check that compiles it before the engine sees the request.

OpenAI's ``response_format`` (``{"type": "json_object"}`` or ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}``) and vLLM's extras (``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, and ``structured_outputs``, an object
with json / regex / choice / grammar / json_object) all become one ``StructuredOutputsParams``.
Two of them in one request is a 400: there is no sensible way to combine constraints.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from ..structured.params import StructuredOutputsParams
from .errors import bad_request

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def requested_constraint(body: Any) -> Optional[tuple[StructuredOutputsParams, str]]:
    """The constraint a request asks for and the field it came from; None for free text."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        spec = from_response_format(response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((_build({kind: value}, name), name))
    if getattr(body, "structured_outputs", None) is not None:
        found.append((_build(body.structured_outputs, "structured_outputs"), "structured_outputs"))
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise bad_request(f"give at most one structured-output constraint; this request has {names}", found[1][1])
    return found[0] if found else None


def from_response_format(value: Any) -> Optional[StructuredOutputsParams]:
    """OpenAI's ``response_format`` as a constraint (None for ``{"type": "text"}``)."""
    if not isinstance(value, dict) or not isinstance(value.get("type", "text"), str):
        raise bad_request("response_format must be an object with a string 'type'", "response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build({"json_object": True}, "response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                          "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format of type json_schema needs a 'json_schema' object", "response_format")
    schema = spec.get("schema")
    if schema is None:
        raise bad_request("response_format.json_schema needs a 'schema'", "response_format")
    return _build({"json": schema}, "response_format")


def _build(fields: Any, param: str) -> StructuredOutputsParams:
    if not isinstance(fields, dict):
        raise bad_request(f"{param} must be an object", param)
    try:
        return StructuredOutputsParams.from_dict(fields)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"{param}: {exc}", param) from None


async def compile_or_400(compiler: Any, spec: StructuredOutputsParams, param: str) -> None:
    """Compiles (or finds in the cache) the grammar on a worker thread; an invalid schema, regex or
    grammar is a 400 naming it. The engine's own compile at add_request is then a cache hit."""
    try:
        await asyncio.to_thread(compiler.compile, spec)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param, code="invalid_structured_output") from None
