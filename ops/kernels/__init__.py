"""Triton kernels behind the CUDA implementations of the vgraph ops.

Each launcher takes torch tensors on any device Triton can run on: CUDA normally, or CPU
tensors when ``TRITON_INTERPRET=1`` was set before triton was imported (how the kernels are
tested on machines without a GPU).
"""
from __future__ import annotations

import importlib
from typing import Any


class _Lazy:
    """Stands in for a kernel module until something of it is used, then imports it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: Any = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


def lazy(name: str) -> Any:
    """Kernel module ``name`` (say ``"norm"``), imported on its first use.

    Why: every kernel module imports Triton (~0.2 s), and the ops name their kernel modules at
    import time, yet only CUDA calls (and the interpreter tests) ever launch a kernel. A CPU
    process, a warm start above all, then never imports Triton. What the kernels share with
    Triton-free code lives in ``host``. Not a module in ``sys.modules`` (as importlib's
    LazyLoader would make it): ``inspect.getmodule``, which torch.library runs on every op
    registration, touches every module there and would load it at once.
    """
    return _Lazy(f"{__name__}.{name}")
