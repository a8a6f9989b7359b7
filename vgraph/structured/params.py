"""``StructuredOutputsParams``: what output a request is constrained to, in vLLM's shape.

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (a Lark grammar in
llguidance's dialect) is given. Validation here is structural and cheap (which field, the
right types, a parseable schema); whether the schema, regex or grammar itself is valid is
decided when it is compiled (``compiler.GrammarCompiler``), which names the problem.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Union[None, str, dict[str, Any]] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    # JSON only. False (the default): compact JSON without optional whitespace, which keeps
    # small or weak models from spending their tokens on spaces and newlines; True lets the
    # model place whitespace wherever JSON allows it.
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            which = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {which}")
        self._check(given[0])

    def _check(self, kind: str) -> None:
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(schema).__name__}")
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError("structured_outputs.json_object must be true when given")
        elif kind == "choice":
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which of the constraints this is ("json", "json_object", "regex", "choice", "grammar")."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> Any:
        """The JSON schema of a "json" or "json_object" constraint, as an object."""
        if self.kind == "json_object":
            return {"type": "object"}
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: equal keys compile to the same grammar."""
        kind = self.kind
        if kind in ("json", "json_object"):
            spec = json.dumps(self.schema, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            spec = json.dumps(list(self.choice or []))
        else:
            spec = getattr(self, kind)
        return kind, spec, self.whitespace_flexible

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "StructuredOutputsParams":
        """From a JSON object (vLLM's ``structured_outputs`` request field); unknown keys are errors."""
        unknown = set(obj) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields: {', '.join(sorted(unknown))}")
        return cls(**obj)


# vLLM's older name for the same thing (``SamplingParams(guided_decoding=...)``).
GuidedDecodingParams = StructuredOutputsParams
