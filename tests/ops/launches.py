"""Recording Triton launches without running them, and Triton's view of a launch.

Used by the launch checks (test_kernel_launch.py) and the sm_90 compile check
(sm90_compile.py): a launcher runs as usual, but its kernels are swapped for recorders that
keep each launch's grid and arguments, so grids, specialization keys and compiled code can
be examined for any shape without a GPU (or, under the interpreter, without the wait).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature


@dataclass
class Launch:
    grid: tuple
    args: tuple
    kwargs: dict[str, Any]


class LaunchRecorder:
    """Stands in for a Triton kernel (``kernel[grid](*args, **kwargs)``): records, runs nothing."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches: list[Launch] = []

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append(Launch(tuple(grid), args, kwargs))


@contextlib.contextmanager
def recording(module: ModuleType, *names: str) -> Iterator[dict[str, LaunchRecorder]]:
    """Swaps ``module``'s kernels ``names`` for recorders while the block runs."""
    originals = {name: getattr(module, name) for name in names}
    recorders = {name: LaunchRecorder(kernel) for name, kernel in originals.items()}
    for name, recorder in recorders.items():
        setattr(module, name, recorder)
    try:
        yield recorders
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)


def as_jit_function(kernel: Any) -> JITFunction:
    """The compiled-mode JITFunction of a kernel, also when the interpreter is on."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)


def specialization_key(kernel: Any, launch: Launch, backend: Any = BaseBackend) -> list:
    """What Triton keys the compiled kernel on for this launch: each argument's type and value
    class (1, a multiple of 16, other; or none when not specialized), constexprs, options."""
    jit = as_jit_function(kernel)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    _, specialization, options = binder(*launch.args, **launch.kwargs)
    return [specialization, sorted(options.items())]
