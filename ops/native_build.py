"""Builds vgraph's C++ CPU kernels (``ops/csrc``) into shared libraries, cached on disk.

Why not ``torch.utils.cpp_extension``: its builds include torch's headers and take about a
minute on a small machine, on the first start of every fresh environment. These kernels use
no torch API (they take raw pointers through ctypes), so a plain compiler call builds one in
about a second. It is the compiler Inductor's CPU backend needs anyway (``$CXX``, else ``c++``).
The one exception is a library of dispatcher kernels (``TORCH_API_LIBRARIES``): it includes
torch's dispatcher headers only and links against the torch this process runs (about five
seconds, once per machine), and its key holds torch's version.

Cache: ``$VGRAPH_CACHE_DIR/kernels`` (default ``~/.cache/vgraph/kernels``), one file per
hash of the source (with the headers beside it), the compiler's version, the flags and this
CPU's feature flags (the build targets ``-march=native``). Builds land in a temporary file
renamed into place, so concurrent first users each end with one complete library; then its
length and sha256 are recorded beside it (``<name>-<key>.so.sha256``, file_digest.py).

Every load checks the library against that record first, because a damaged library cannot
be caught by loading it: it is mapped, so a truncated one kills the process with SIGBUS and a
bit-flipped one with SIGILL, on every start, before Python sees anything. A library that does
not match its record (truncated, bytes flipped) or has none (built by an older vgraph) is
never loaded: it is built again, with one warning naming the file and why. Checking and
building hold an ``flock`` on the kernel directory, so a record always describes the file
beside it, even with several processes starting at once. A cache that cannot be written
(read-only, full, a file in the way) builds into one temporary directory for this process
instead, with one warning for all the kernels; a checked library that still cannot be
loaded is built again once, and if that fails too the caller gets NativeBuildError and uses
its torch implementation.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from . import file_digest

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
# Libraries that register torch dispatcher kernels in C++ (they include torch's headers).
TORCH_API_LIBRARIES = frozenset({"dispatch_cpu"})
_lock = threading.Lock()
# Kernel cache directories this process could not write -> where it builds instead.
_private_dirs: dict[Path, Path] = {}


class NativeBuildError(RuntimeError):
    """The C++ kernel could not be built or loaded (no compiler, or it failed)."""


def compiler() -> str:
    """``$CXX`` when set, else ``c++`` from PATH."""
    name = os.environ.get("CXX") or "c++"
    path = shutil.which(name)
    if path is None:
        raise NativeBuildError(f"no C++ compiler: {name!r} is not on PATH (set $CXX)")
    return path


def kernel_cache_dir() -> Path:
    base = os.environ.get("VGRAPH_CACHE_DIR") or Path.home() / ".cache" / "vgraph"
    return Path(base) / "kernels"


def _run_compiler(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs the compiler; a missing or hung compiler is a NativeBuildError, not a cache problem."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeBuildError(f"cannot run the C++ compiler {args[0]}: {exc}") from exc


@lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    return _run_compiler([cxx, "--version"], timeout=60).stdout


def cpu_features() -> str:
    """The CPU's feature flags: ``-march=native`` code is only valid on a CPU that has them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: the processor name is the best key there is
        lines = []
    flags = [line for line in lines if line.startswith(("flags", "Features"))]
    return flags[0] if flags else platform.processor() or platform.machine()


def library_key(source: str, cxx: str, name: str = "") -> str:
    compile_flags, link_flags = build_flags(name)
    parts = [source, cxx, _compiler_version(cxx), " ".join(compile_flags + link_flags), cpu_features()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def build_flags(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The compiler's flags for ``ops/csrc/<name>.cpp``, and its link flags (after the source).
    A dispatcher library adds torch's headers and libraries (found again at load time through
    the rpath: the very files this process has loaded) and torch's C++ ABI; torch's headers
    want C++20. The torch version enters the key through these flags: its path and a define
    naming ``torch.__version__`` (an upgrade in place keeps the path)."""
    if name not in TORCH_API_LIBRARIES:
        return FLAGS, ()
    import torch
    root = Path(torch.__file__).resolve().parent
    compile_flags = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-w",
                     f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     f"-DVGRAPH_TORCH_VERSION=\"{torch.__version__}\"",
                     f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}")
    link_flags = (f"-L{root / 'lib'}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{root / 'lib'}")
    return compile_flags, link_flags


def source_text(name: str) -> str:
    """What a build of ``ops/csrc/<name>.cpp`` depends on: its text and that of every header
    beside it (the kernels share some), so editing a header rebuilds its users."""
    parts = [(CSRC / f"{name}.cpp").read_text(encoding="utf-8")]
    parts += [header.read_text(encoding="utf-8") for header in sorted(CSRC.glob("*.h"))]
    return "\0".join(parts)


def build_name(name: str) -> str:
    """What ``ops/csrc/<name>.cpp`` builds to here, ``<name>-<key>``: the key covers the source,
    compiler, flags and CPU, so a measurement made against one build can be keyed by it."""
    return f"{name}-{library_key(source_text(name), compiler(), name)}"


def _compile(cxx: str, source_file: Path, target: Path, name: str = "") -> None:
    """Compiles into a temporary file next to ``target``, renames it into place, then records
    its digest (file_digest.py): a crash in between leaves a library without a record, which
    the next load rebuilds rather than trusts."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    compile_flags, link_flags = build_flags(name)
    try:
        result = _run_compiler([cxx, *compile_flags, str(source_file), "-o", tmp, *link_flags], timeout=600)
        if result.returncode != 0:
            raise NativeBuildError(f"{cxx} failed to build {source_file.name}:\n"
                                   f"{result.stderr.strip()[-2000:]}")
        file_digest.fsync_file(Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    file_digest.write_record(target)


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the kernel directory (created if missing) while a library is
    checked and, if need be, built and recorded: another process never sees a library
    renamed into place whose record is still the previous one's. Where the directory cannot
    be locked (a filesystem without flock), building goes on unlocked: the record check
    still keeps a mismatched pair from being loaded, at the cost of a rebuild."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            logger.debug("cannot lock the kernel cache %s (%s); building unlocked", directory, exc)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def _private_build_dir(unusable: Path, exc: OSError) -> Path:
    """This process's build directory (removed at exit) in place of a kernel cache it could
    not write; the warning comes once per such cache, not once per kernel."""
    if unusable not in _private_dirs:
        _private_dirs[unusable] = Path(tempfile.mkdtemp(prefix="vgraph-kernels-"))
        atexit.register(shutil.rmtree, _private_dirs[unusable], ignore_errors=True)
        logger.warning("cannot write the kernel cache %s (%s); building the C++ kernels in a "
                       "temporary directory for this process", unusable, exc)
    return _private_dirs[unusable]


def _build(name: str, cxx: str, source_file: Path, source: str, reuse: bool = True) -> Path:
    """The library's path, built unless already cached and matching its digest record;
    ``reuse=False`` builds it even over a cached file (one that failed to load)."""
    key = library_key(source, cxx, name)
    cache = kernel_cache_dir()
    directory = _private_dirs.get(cache, cache)
    while True:
        target = directory / f"{name}-{key}.so"
        try:
            with _directory_lock(directory):
                if reuse and _verified(target):
                    return target
                start = time.perf_counter()
                _compile(cxx, source_file, target, name)
        except OSError as exc:  # read-only, full, or not a directory: build privately instead
            if directory != cache:
                raise NativeBuildError(f"could not write {name} anywhere ({exc})") from exc
            directory = _private_build_dir(cache, exc)
            continue
        logger.info("built the C++ kernel %s in %.1f s (%s)", name, time.perf_counter() - start,
                    target)
        return target


def _verified(target: Path) -> bool:
    """Whether ``target`` is there and matches its digest record. A file that is there but
    does not match (or has no record) is one warning naming it: the caller builds it again."""
    if not target.is_file():
        return False
    problem = file_digest.problem(target)
    if problem is None:
        return True
    logger.warning("the cached C++ kernel %s is %s; building it again, it is never loaded",
                   target, problem)
    return False


def _load(path: Path) -> ctypes.CDLL:
    """Loads a library ``_build`` returned: checked against its digest record first (again,
    since a file can change between the build and the load), so a damaged file is never
    mapped into the process."""
    problem = file_digest.problem(path)
    if problem is not None:
        raise NativeBuildError(f"{path} is {problem}")
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {path}: {exc}") from exc


def build_library(name: str) -> Path:
    """``ops/csrc/<name>.cpp`` built in this cache (or found built and intact), not loaded: for
    a library whose loading does something the caller prepares for (registers dispatcher
    kernels). Raises NativeBuildError as ``load_library`` does."""
    with _lock:
        return _build(name, compiler(), CSRC / f"{name}.cpp", source_text(name))


def open_library(path: Path) -> ctypes.CDLL:
    """Loads a library ``build_library`` returned, checked against its digest record first."""
    return _load(path)


@lru_cache(maxsize=None)
def load_library(name: str) -> ctypes.CDLL:
    """``ops/csrc/<name>.cpp`` as a loaded library, built on first use in this cache.

    A cached library that does not match its digest record is built again before anything
    loads it (``_build``); one that matches but still does not load is built again, once,
    with a warning. Raises NativeBuildError when there is no compiler or the build fails; callers
    fall back to their torch implementation.
    """
    path = build_library(name)
    try:
        return _load(path)
    except NativeBuildError as exc:
        logger.warning("the cached C++ kernel %s does not load (%s); building it again", path,
                       exc.__cause__ or exc)
    with _lock:
        return _load(_build(name, compiler(), CSRC / f"{name}.cpp", source_text(name), reuse=False))


class NativeKernel:
    """One function of a kernel library, loaded on first use; ``load()`` returns it, or None
    when the library cannot be built here (logged once, so callers use their torch path)."""

    def __init__(self, library: str, function: str, argtypes: list, restype: Any,
                 purpose: str, check: Optional[Callable[[ctypes.CDLL], Optional[str]]] = None) -> None:
        self.library, self.function_name = library, function
        self.argtypes, self.restype = argtypes, restype
        self.purpose, self.check = purpose, check
        self.function: Optional[Callable] = None
        self.unavailable: Optional[str] = None
        self._lock = threading.Lock()

    def load(self) -> Optional[Callable]:
        if self.function is not None or self.unavailable is not None:
            return self.function
        with self._lock:  # one build attempt and at most one warning, whatever the threads
            if self.function is None and self.unavailable is None:
                self._load_locked()
        return self.function

    def _load_locked(self) -> None:
        try:
            lib = load_library(self.library)
            problem = self.check(lib) if self.check is not None else None
            if problem:
                raise NativeBuildError(problem)
            function = getattr(lib, self.function_name)
            function.argtypes, function.restype = self.argtypes, self.restype
            self.function = function
        except NativeBuildError as exc:
            self.unavailable = str(exc)
            logger.warning("%s falls back to its torch implementation: %s", self.purpose, exc)
