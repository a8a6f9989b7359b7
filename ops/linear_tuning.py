"""Which GEMM serves prefill-sized calls of each CPU projection, chosen by measuring once.

Decode calls (a few rows) always take the packed kernel: that is what it is for, and BLAS
runs far below bandwidth there. At prefill sizes both are compute-bound and which is faster
depends on the shape, the CPU and the thread count: on the 2-core Zen 4 development VM the
packed kernel and torch's BLAS (``F.linear``) were within 0.9-1.1x of each other, each ahead
on some shapes. So at startup every distinct ``(out_features, in_features)`` of the model is
timed both ways at ``TUNING_ROWS`` rows, interleaved (fastest of ``REPEATS``), and BLAS is chosen only when it is at
least ``MARGIN`` faster: it then needs an unpacked copy of those weights kept alongside the
packed ones, which costs memory. Choices are cached per machine (CPU flags, thread count,
torch version) in the kernel cache directory, so a warm start does not measure again.

``VGRAPH_CPU_PREFILL_GEMM`` = ``packed`` or ``blas`` forces one for every shape; ``auto``
(the default) measures.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from .linear import pack_weight
from .native_build import NativeBuildError, build_name, cpu_features, kernel_cache_dir

logger = logging.getLogger(__name__)

ENV_SWITCH = "VGRAPH_CPU_PREFILL_GEMM"
TUNING_ROWS = 512   # a prefill step's rows: large enough to be compute-bound for both
MIN_TUNING_ROWS = 128  # big weights (a 7B model's MLP) are timed at fewer rows, bounding startup
TUNING_MACS = 1 << 31  # most multiply-adds per timed call (~20 ms on one core)
MARGIN = 1.05      # BLAS must be this much faster to be worth a second copy of the weight
REPEATS = 5


@dataclass(frozen=True)
class ShapeChoice:
    """The measured prefill GEMM of one weight shape: ``kernel`` is "packed" or "blas"."""

    out_features: int
    in_features: int
    packed_ms: float
    blas_ms: float
    kernel: str

    @property
    def speedup(self) -> float:
        """The chosen kernel's speed over the packed kernel's (1.0 when packed is chosen)."""
        return self.packed_ms / self.blas_ms if self.kernel == "blas" else 1.0


def _fastest_ms(fn: Callable[[], object], others: list[Callable[[], object]]) -> list[float]:
    """Fastest ms per call of ``fn`` and each of ``others``, timed in rotating order. The
    minimum, not the median: another process can only slow a sample down, and a choice that
    is cached for every later start must not record a moment of contention."""
    fns = [fn, *others]
    for f in fns:
        f()  # warm: first-touch pages, thread team start
    samples: list[list[float]] = [[] for _ in fns]
    for rep in range(REPEATS):
        for i in (list(range(len(fns)))[rep % len(fns):] + list(range(len(fns)))[:rep % len(fns)]):
            start = time.perf_counter()
            fns[i]()
            samples[i].append((time.perf_counter() - start) * 1e3)
    return [min(s) for s in samples]


def tuning_rows(out_features: int, in_features: int) -> int:
    """Rows a shape is timed at: TUNING_ROWS, fewer (down to MIN_TUNING_ROWS) for big weights."""
    return max(MIN_TUNING_ROWS, min(TUNING_ROWS, TUNING_MACS // (out_features * in_features)))


def measure_shape(out_features: int, in_features: int) -> ShapeChoice:
    """Times the packed kernel and ``F.linear`` on a random weight of this shape."""
    rows = tuning_rows(out_features, in_features)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    packed = pack_weight(weight)
    packed_ms, blas_ms = _fastest_ms(
        lambda: torch.ops.vgraph.packed_linear(x, packed, None, out_features),
        [lambda: F.linear(x, weight)])
    kernel = "blas" if packed_ms >= blas_ms * MARGIN else "packed"
    return ShapeChoice(out_features, in_features, packed_ms, blas_ms, kernel)


def forced_kernel() -> str | None:
    value = os.environ.get(ENV_SWITCH, "auto").lower()
    if value not in ("auto", "packed", "blas"):
        raise ValueError(f"{ENV_SWITCH} must be auto, packed or blas, got {value!r}")
    return None if value == "auto" else value


def _kernel_version() -> str:
    """The packed kernel's build (source, compiler, flags, CPU: ``native_build.build_name``): a
    choice measured against one build says nothing about another (the AVX-512 tiles changed
    which shapes BLAS wins)."""
    try:
        return build_name("linear_cpu")
    except (OSError, NativeBuildError):  # no compiler or no source: nothing was measured either
        return "unavailable"


def _cache_file() -> Path:
    machine = "\0".join([cpu_features(), str(torch.get_num_threads()), torch.__version__,
                         str(TUNING_ROWS), str(MARGIN), _kernel_version()])
    return kernel_cache_dir() / f"prefill-gemm-{hashlib.sha256(machine.encode()).hexdigest()[:20]}.json"


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, entries: dict[str, dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:  # a read-only cache only costs the measurement next time
        logger.debug("could not cache the prefill GEMM choice in %s: %s", path, exc)


@contextmanager
def _machine_lock(path: Path) -> Iterator[None]:
    """One process at a time measures: processes starting together (a server's replicas, a
    test's concurrent starts) then share one choice, so they build the same model and the
    same compiled graph, instead of each timing the GEMMs while the others load the cores."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a+")
    except OSError:  # an unwritable cache: measure unlocked, as the write will fail anyway
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def choose_prefill_kernels(shapes: Iterable[tuple[int, int]]) -> dict[tuple[int, int], ShapeChoice]:
    """The prefill GEMM for each ``(out_features, in_features)``: cached, forced, or measured."""
    forced = forced_kernel()
    shapes = sorted(set(shapes))
    if forced is not None:
        return {s: ShapeChoice(*s, float("nan"), float("nan"), forced) for s in shapes}
    path = _cache_file()
    keys = {shape: f"{shape[0]}x{shape[1]}" for shape in shapes}
    cached = _read_cache(path)
    if any(key not in cached for key in keys.values()):
        with _machine_lock(path):
            cached = _read_cache(path)  # another process may have measured while we waited
            missing = [shape for shape, key in keys.items() if key not in cached]
            for shape in missing:
                cached[keys[shape]] = asdict(measure_shape(*shape))
            if missing:
                _write_cache(path, cached)
    return {shape: ShapeChoice(**cached[key]) for shape, key in keys.items()}


def describe(choices: dict[tuple[int, int], ShapeChoice]) -> str:
    """One log line: what each shape takes and by how much."""
    parts = []
    for (n, k), c in choices.items():
        ratio = "" if c.packed_ms != c.packed_ms else f" (packed {c.packed_ms:.2f} ms, BLAS {c.blas_ms:.2f} ms)"
        parts.append(f"{n}x{k}: {c.kernel}{ratio}")
    return "; ".join(parts)
