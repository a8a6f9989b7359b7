"""Naming a pass without editing vgraph: specs, and where a pass runs.

A spec is the text a user types after ``--pass`` (or puts in ``CompileConfig(passes=[...])``)::

    my_passes:MyPass                  the attribute MyPass of the importable module my_passes
    path/to/my_passes.py:MyPass       the same from a file (no package, no sys.path entry needed)
    before:my_passes:MyPass           run it before vgraph's own passes (default: after)

A class is instantiated without arguments, since a pass class is what a user module usually
defines; anything else (a function with a ``uuid``, an instance) is used as it is.

Position matters when a user pass prepares the graph for vgraph's passes: a pass that lifts a
plain-torch RMSNorm into ``vgraph::rms_norm`` must run *before* the RMSNorm+quant fusion for
the fusion to see the op. A pass says where it runs with a ``position`` attribute ("before"
or "after"), or the caller decides with ``before:``/``after:`` in the spec or ``PlacedPass``.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterable

POSITIONS = ("before", "after")
DEFAULT_POSITION = "after"
# Modules loaded from a file path live in sys.modules under this prefix: a pass's uuid reads
# its module's source through sys.modules, and a second load of the same file reuses it.
FILE_MODULE_PREFIX = "vgraph_user_passes"


class PassSpecError(ValueError):
    """A spec that names no usable pass; ``reason`` says why in one line."""

    def __init__(self, spec: str, reason: str) -> None:
        super().__init__(f"pass {spec!r}: {reason}")
        self.spec, self.reason = spec, reason


@dataclass(frozen=True)
class PlacedPass:
    """A pass with the position the caller chose for it, which wins over the pass's own."""

    pass_: Any
    position: str = DEFAULT_POSITION

    def __post_init__(self) -> None:
        _check_position(self.position, self.pass_)


def _check_position(position: Any, owner: Any) -> str:
    if position not in POSITIONS:
        raise ValueError(f"pass {owner!r}: position must be one of {', '.join(POSITIONS)}, "
                         f"got {position!r}")
    return position


def position_of(p: Any) -> str:
    """Where ``p`` runs relative to vgraph's own passes: a PlacedPass's position, else the
    pass's ``position`` attribute, else "after"."""
    if isinstance(p, PlacedPass):
        return p.position
    return _check_position(getattr(p, "position", DEFAULT_POSITION), p)


def unplaced(p: Any) -> Any:
    """The pass itself, without its PlacedPass wrapper."""
    return p.pass_ if isinstance(p, PlacedPass) else p


def arrange(own: Iterable[Any], user: Iterable[Any]) -> list[Any]:
    """The run order: user passes placed "before", vgraph's own, then the rest of the user's,
    each group in the order given. Strings are loaded as specs."""
    user = [load_pass(p) if isinstance(p, str) else p for p in user]
    before = [unplaced(p) for p in user if position_of(p) == "before"]
    after = [unplaced(p) for p in user if position_of(p) == "after"]
    return [*before, *own, *after]


def load_pass(spec: str) -> Any:
    """The pass a spec names (see the module docstring); a PlacedPass when the spec carries a
    position. Raises PassSpecError (a ValueError) with a one-line reason."""
    position, rest = _split_position(spec)
    source, sep, attr = rest.rpartition(":")
    if not (sep and source and attr):
        raise PassSpecError(spec, "expected MODULE:NAME or path/to/file.py:NAME, e.g. my_passes:MyPass")
    module = _module_from(spec, source)
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise PassSpecError(spec, f"module {source!r} has no attribute {attr!r}") from None
    made = found() if isinstance(found, type) else found
    if not callable(made):
        raise PassSpecError(spec, f"{type(made).__name__} is not callable on an FX graph")
    return PlacedPass(made, position) if position else made


def _split_position(spec: str) -> tuple[str, str]:
    head, sep, rest = spec.partition(":")
    if sep and head in POSITIONS:
        return head, rest
    return "", spec


def _module_from(spec: str, source: str) -> ModuleType:
    if source.endswith(".py") or os.sep in source:
        return _load_file(spec, source)
    try:
        return importlib.import_module(source)
    except ImportError as exc:
        raise PassSpecError(spec, f"cannot import {source!r} ({exc})") from None


def _load_file(spec: str, source: str) -> ModuleType:
    """Imports a .py file under a name unique to its absolute path (so two files called
    passes.py do not collide), once per process."""
    path = os.path.abspath(os.path.expanduser(source))
    if not os.path.isfile(path):
        raise PassSpecError(spec, f"no such file {source!r}")
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0])
    name = f"{FILE_MODULE_PREFIX}.{stem}_{hashlib.sha256(path.encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise PassSpecError(spec, f"cannot load {source!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before running it: dataclasses and inspect look it up
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise PassSpecError(spec, f"importing {source!r} failed ({type(exc).__name__}: {exc})") from None
    return module
