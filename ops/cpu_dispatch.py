"""Who serves the CPU calls of the hot ops (``packed_linear``, ``rowmajor_linear``,
``reshape_and_cache``, ``paged_attention``): their Python kernels, registered here by their
modules at import, or, once ``install`` ran, the C++ dispatcher kernels of
``csrc/dispatch_cpu.cpp``.

Why: through a Python kernel a one-row projection cost ~15 us (dispatcher -> Python -> checks,
reshape, allocation -> ctypes) for 3-6 us of tiles, and an attention call more (its Python
plans the batch); a decode step of a small model makes dozens of such calls. The C++ kernels
dispatch in under a microsecond and pass every call they do not take (another dtype, a
prefill, a dense copy in use, a bad shape) to the Python kernel through the private op
``<op>_python`` defined here, so the fallbacks and the error messages stay with each op's
module. The C++ library registers its kernels when it loads, so the Python registrations go
first (``Library._destroy``) and come back if it fails to load.

Installed at a CPU runner's startup (``build_cpu_kernels``), not at import: building the library
against the running torch takes seconds, once per machine (``native_build``).
"""
from __future__ import annotations

import ctypes
import logging
import threading
from typing import Callable, Optional

import torch

from .native_build import NativeBuildError, build_library, open_library
from .registration import NAMESPACE

logger = logging.getLogger(__name__)

LIBRARY = "dispatch_cpu"


class _Dispatch:
    """The Python CPU kernels (``python_kernel``) and, once installed, the C++ library."""

    def __init__(self) -> None:
        self.kernels: dict[str, Callable] = {}
        self._python = torch.library.Library(NAMESPACE, "IMPL")
        self.fallbacks = torch.library.Library(NAMESPACE, "FRAGMENT")
        self.library: Optional[ctypes.CDLL] = None
        self.unavailable: Optional[str] = None
        self._lock = threading.Lock()

    def python_kernel(self, op: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
        """Registers the decorated function as ``op``'s CPU kernel and as ``<op>_python``."""
        def register(kernel: Callable) -> Callable:
            self.kernels[op] = kernel
            self._python.impl(op, kernel, "CPU")
            schema = torch.library.infer_schema(kernel, mutates_args=mutates_args).replace("SymInt", "int")
            self.fallbacks.define(f"{op}_python{schema}")
            self.fallbacks.impl(f"{op}_python", kernel, "CompositeExplicitAutograd")
            return kernel
        return register

    def install(self) -> bool:
        with self._lock:
            if self.library is None and self.unavailable is None:
                try:
                    self.library = self._load()
                except NativeBuildError as exc:
                    self.unavailable = str(exc)
                    logger.warning("the CPU ops stay on their Python kernels: %s", exc)
        return self.library is not None

    def _load(self) -> ctypes.CDLL:
        from . import cpu_attention_native, kv_cache, linear
        entries = {"linear": linear._KERNEL.load(), "rows": linear._ROWS_KERNEL.load(),
                   "cache_write": kv_cache._NATIVE.load(), "attention": cpu_attention_native._KERNEL.load()}
        missing = [name for name, entry in entries.items() if entry is None]
        if missing:  # each op keeps to its Python kernel, which has a torch path
            raise NativeBuildError(f"the C++ kernels {', '.join(missing)} are not loaded")
        path = build_library(LIBRARY)
        self._python._destroy()  # the C++ kernels register for the same ops as they load
        try:
            library = open_library(path)
        except NativeBuildError:
            self._python = torch.library.Library(NAMESPACE, "IMPL")
            for op, kernel in self.kernels.items():
                self._python.impl(op, kernel, "CPU")
            raise
        configure = library.vgraph_dispatch_configure
        configure.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        configure(*(ctypes.cast(entry, ctypes.c_void_p) for entry in entries.values()), linear.PANEL,
                  linear.DENSE_MIN_ROWS, cpu_attention_native.MAX_HEAD_DIM)
        return library


_DISPATCH = _Dispatch()
python_kernel = _DISPATCH.python_kernel


def install() -> bool:
    """Moves the ops' CPU calls to the C++ kernels (built on first use); False, with one
    warning, where they cannot be built (the Python kernels go on serving). Idempotent and
    thread-safe."""
    return _DISPATCH.install()


def installed() -> bool:
    return _DISPATCH.library is not None


def unavailable() -> Optional[str]:
    """Why ``install`` could not move the calls (None: it did, or was not asked yet)."""
    return _DISPATCH.unavailable
