"""What a pass is: ``VgraphPass`` for vgraph's own passes, ``CallablePass`` for user callables.

Passes run as Inductor's ``post_grad_custom_post_pass``, so each must have a ``uuid()``: it
enters Inductor's FX-graph cache key, and a pass whose code or settings changed must not be
served a graph compiled by its previous version. ``VgraphPass.uuid()`` therefore hashes the
source of the modules the pass lives in together with its ``config()``.

Match counts are the research interface: every pass exposes ``matched_count`` (matches in
its last call), ``total_matched`` (all calls so far) and ``last_pattern_counts`` (its last
call's matches per pattern). A pass is called once per graph Inductor compiles: once per
*distinct* piece graph and compile size, not once per layer (identical layers compile once).

``position`` ("before" or "after", default "after") says where a pass given to
``CompileConfig(passes=[...])`` runs relative to vgraph's own passes (``loading.py``).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import sys
from abc import abstractmethod
from collections import Counter
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Callable, Optional, Union

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import fx_utils
from .identity import identity_problem, module_of, source_digests

logger = logging.getLogger("vgraph.passes")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def source_of(module: ModuleType) -> Optional[str]:
    """The module's source text, or None where there is none (a REPL, a frozen module)."""
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return None


class VgraphPass(CustomGraphPass):
    """Base of vgraph's passes: counting, and a uuid over source code and config.

    Subclasses implement ``apply(graph)``, which rewrites the graph in place and returns the
    number of matches per pattern name; and ``config()`` if they have settings. Calling the
    pass runs ``apply`` and updates the counters.
    """

    #: Name in match-count dicts and logs; defaults to the class name.
    name: str = ""
    #: Matches in the most recent call.
    matched_count: int = 0
    #: Matches over all calls since construction (or ``reset_counts``).
    total_matched: int = 0
    #: Where the pass runs when given to the engine: "before" or "after" vgraph's own passes.
    position: str = "after"

    @abstractmethod
    def apply(self, graph: torch.fx.Graph) -> Mapping[str, int]:
        """Rewrites ``graph`` in place; returns matches per pattern (zeros may be left out)."""

    def config(self) -> dict[str, Any]:
        """Settings that change what the pass does; they enter the uuid. JSON-able values."""
        return {}

    def __call__(self, graph: torch.fx.Graph) -> None:
        counts = self.apply(graph)
        self.matched_count = sum(counts.values())
        self.total_matched += self.matched_count
        self.last_pattern_counts = {k: v for k, v in counts.items() if v}
        self.pattern_counts.update(self.last_pattern_counts)

    @property
    def pattern_counts(self) -> Counter:
        """Cumulative matches per pattern, e.g. ``{"rms_norm_static_fp8_quant": 2}``."""
        return self.__dict__.setdefault("_pattern_counts", Counter())

    @property
    def last_pattern_counts(self) -> dict[str, int]:
        """Matches per pattern in the most recent call (patterns without a match left out)."""
        return self.__dict__.get("_last_pattern_counts", {})

    @last_pattern_counts.setter
    def last_pattern_counts(self, counts: dict[str, int]) -> None:
        self.__dict__["_last_pattern_counts"] = counts

    def reset_counts(self) -> None:
        self.matched_count = 0
        self.total_matched = 0
        self.last_pattern_counts = {}
        self.pattern_counts.clear()

    @property
    def pass_name(self) -> str:
        return self.name or type(self).__name__

    def source_modules(self) -> list[ModuleType]:
        """Modules whose code decides what this pass does: each VgraphPass class in its MRO,
        plus the shared FX helpers. Override to add modules a pass also depends on."""
        modules = {module_of(cls) for cls in type(self).__mro__
                   if isinstance(cls, type) and issubclass(cls, VgraphPass)}
        modules.add(fx_utils)
        return sorted(modules, key=lambda m: m.__name__)

    def uuid(self) -> Optional[str]:
        """Hash of the pass's class, config and source: its ``source_modules()`` and the
        modules they import from their own package (``identity.py``: a helper module holding
        a switch changes the uuid too); None if a declared module has no source.

        None makes Inductor bypass its FX-graph cache for the compile, and vgraph's compile
        cache turns itself off (with one warning, ``identity_problem``): the safe answer when
        we cannot tell two versions of the pass apart.
        """
        sources = source_digests(self.source_modules(), source_of)
        if sources is None:
            logger.debug("pass %s has no uuid: %s", self.pass_name, identity_problem(self))
            return None
        key = {"class": f"{type(self).__module__}.{type(self).__qualname__}",
               "config": self.config(), "sources": sources}
        return _sha256(json.dumps(key, sort_keys=True, default=repr))

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({settings})"


class CallablePass(CustomGraphPass):
    """Adapts a user pass, any ``callable(graph)`` with a ``uuid()``, to the manager.

    The callable reports matches either by returning an int or by setting its own
    ``matched_count`` to the number of matches of the call (as ``VgraphPass`` does); without
    either, its count stays 0. Its one pattern is its own name.
    """

    def __init__(self, fn: Callable[[torch.fx.Graph], Any], name: Optional[str] = None) -> None:
        if not callable(fn) or not callable(getattr(fn, "uuid", None)):
            raise TypeError(
                f"a pass is a callable on a torch.fx.Graph with a uuid() method (the uuid "
                f"keys Inductor's compile cache); got {fn!r}")
        self.fn = fn
        self.pass_name = (name or getattr(fn, "name", None) or getattr(fn, "__name__", None)
                          or type(fn).__name__)
        self.matched_count = 0
        self.total_matched = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        result = self.fn(graph)
        if isinstance(result, int) and not isinstance(result, bool):
            count = result
        else:
            count = getattr(self.fn, "matched_count", 0)
        self.matched_count = int(count)
        self.total_matched += self.matched_count

    @property
    def last_pattern_counts(self) -> dict[str, int]:
        return {self.pass_name: self.matched_count} if self.matched_count else {}

    @property
    def position(self) -> str:
        return getattr(self.fn, "position", "after")

    def reset_counts(self) -> None:
        self.matched_count = 0
        self.total_matched = 0

    def uuid(self) -> Optional[Any]:
        """The callable's own uuid, combined with the source of its module and of the modules
        that module imports from its package, when readable: editing the function changes the
        uuid even if its author forgot to. Unreadable (a notebook, ``python -c``): the declared
        uuid alone, which its author must change with the pass."""
        declared = self.fn.uuid()
        module = sys.modules.get(getattr(self.fn, "__module__", None) or "")
        sources = source_digests([module], source_of) if module is not None else None
        if declared is None or not sources:
            return declared
        return _sha256(json.dumps({"uuid": declared, "sources": sources}, sort_keys=True, default=repr))

    def __repr__(self) -> str:
        return f"CallablePass({self.fn!r})"


AnyPass = Union[VgraphPass, CallablePass]


def as_pass(obj: Any) -> AnyPass:
    """``obj`` itself if it is a VgraphPass or CallablePass, else ``CallablePass(obj)``."""
    return obj if isinstance(obj, (VgraphPass, CallablePass)) else CallablePass(obj)
