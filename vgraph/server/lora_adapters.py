"""The LoRA adapters a server serves by name: ``--lora-modules`` at startup, then
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` at run time (vLLM's routes, behind
the API key like every ``/v1`` route).

A request selects an adapter with its ``model`` field, as with vLLM; ``/v1/models`` lists each
adapter with the base model as its parent. Names map to ``LoRARequest``s whose integer ids
this registry hands out, once per name and never reused, so the engine's host cache and
prefix cache (keyed by id) never mistake one adapter for another, even after an unload.
"""
from __future__ import annotations

import itertools
import json
from typing import Optional

from ..lora.request import LoRARequest


def parse_lora_module(spec: str) -> tuple[str, str]:
    """``name=path``, or vLLM's JSON form ``{"name": ..., "path": ...}``: (name, path)."""
    text = spec.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {spec!r}: not valid JSON ({exc.msg})") from None
        name, path = data.get("name"), data.get("path")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {spec!r}: expected name=path or a JSON object with name and path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {spec!r}: both a name and a path are needed")
    return name, path


class LoRAAdapters:
    """Served adapter names -> ``LoRARequest``."""

    def __init__(self, modules: list[str], base_names: list[str]) -> None:
        self._base_names = list(base_names)
        self._ids = itertools.count(1)
        self._by_name: dict[str, LoRARequest] = {}
        for spec in modules:
            self.add(*parse_lora_module(spec))

    def get(self, name: Optional[str]) -> Optional[LoRARequest]:
        return None if name is None else self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def all(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def new(self, name: str, path: str) -> LoRARequest:
        """The request an adapter would be served as, not yet registered (``add`` does that
        once the engine has checked it)."""
        if name in self._base_names:
            raise ValueError(f"{name!r} is the base model's served name; choose another adapter name")
        if name in self._by_name:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded; unload it first")
        return LoRARequest(name, next(self._ids), path)

    def add(self, name: str, path: str) -> LoRARequest:
        request = self.new(name, path)
        self.register(request)
        return request

    def register(self, request: LoRARequest) -> None:
        if request.lora_name in self._by_name:
            raise ValueError(f"the LoRA adapter {request.lora_name!r} is already loaded; unload it first")
        self._by_name[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        request = self._by_name.pop(name, None)
        if request is None:
            raise KeyError(name)
        return request
