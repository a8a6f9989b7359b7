"""``vgraph_op``: defines a ``torch.ops.vgraph`` op straight on the dispatcher.

Why not ``torch.library.custom_op``: each call through it runs a Python wrapper that leaves
and re-enters Dynamo and checks the outputs for aliasing, about 40-70 us on the CPUs
measured, against about 6 us for a kernel registered with ``Library.impl``. A decode step
calls some ten ops per layer, so on CPU that wrapper alone cost several milliseconds per
step. The decorator keeps ``custom_op``'s shape (``register_fake``, ``register_kernel``) so
the op modules read the same, and the schema is still inferred from the type hints.

The decorated function is the op's default implementation for every device
(``CompositeExplicitAutograd``); a device kernel registered for ``"cpu"`` or ``"cuda"`` takes
precedence on that device. These ops are for inference: none has an autograd formula.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch

NAMESPACE = "vgraph"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_DEFINED: list[str] = []


def defined_ops() -> list[str]:
    """Names of every op defined here so far (``torch.ops.vgraph`` lists only those used)."""
    return sorted(_DEFINED)


class VgraphOp:
    """A defined op: call it like the function, or use ``torch.ops.vgraph.<name>``."""

    def __init__(self, name: str, fn: Callable, mutates_args: Iterable[str]) -> None:
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        _DEFINED.append(name)
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        self._default: torch._ops.OpOverload | None = None
        functools.update_wrapper(self, fn)

    @property
    def default(self) -> torch._ops.OpOverload:
        if self._default is None:  # resolved once: the lookup is a chain of getattrs
            self._default = getattr(getattr(torch.ops, NAMESPACE), self.name).default
        return self._default

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fn, lib=_LIBRARY)
        return fn

    def register_kernel(self, device: str) -> Callable[[Callable], Callable]:
        if device not in _DISPATCH_KEYS:
            raise ValueError(f"no dispatch key for device {device!r}; known: {sorted(_DISPATCH_KEYS)}")

        def register(fn: Callable) -> Callable:
            _LIBRARY.impl(self.name, fn, _DISPATCH_KEYS[device])
            return fn
        return register


def vgraph_op(qualname: str, mutates_args: Iterable[str]) -> Callable[[Callable], VgraphOp]:
    """``@vgraph_op("vgraph::name", mutates_args=(...))`` over the default implementation."""
    namespace, _, name = qualname.partition("::")
    if namespace != NAMESPACE or not name:
        raise ValueError(f"vgraph ops live in {NAMESPACE}::, got {qualname!r}")
    return lambda fn: VgraphOp(name, fn, mutates_args)
