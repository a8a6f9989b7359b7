"""The C++ kernel cache's digest records (``ops/native_build.py``, ``ops/file_digest.py``).

The issue: a kernel library truncated to half its size in ``$VGRAPH_CACHE_DIR/kernels`` killed
the engine process with SIGBUS at every start (flipped bytes: SIGILL), because a shared
library is mapped, not read, and the cache reused any file under the right name. Now each
library has a ``.sha256`` record written after it, and a library that does not match it, or
has none, is rebuilt with one warning and never handed to ``ctypes.CDLL``.

Every library of ``ops/csrc`` is damaged in both ways the issue names; a spy on
``ctypes.CDLL`` proves the damaged bytes are never loaded (a load of them could kill this
test process, which is why the spy checks the file before delegating). Each test copies a
pristine build made once per module, so a test compiles only the rebuild it checks.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import multiprocessing
import os
import shutil
import types
from pathlib import Path

import pytest

from vgraph.ops import cpu_attention_native, file_digest, linear, lora, native_build

requires_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX") or "c++") is None,
    reason="no C++ compiler: the kernels cannot be built here")

# The ctypes libraries. A dispatcher library registers kernels as it loads, so it is only ever
# loaded by its op module; its cache is checked without loading it (the last test).
LIBRARIES = sorted(p.stem for p in native_build.CSRC.glob("*.cpp") if p.stem not in native_build.TORCH_API_LIBRARIES)


def _works(name: str, lib: ctypes.CDLL) -> None:
    """Calls one function of the loaded library and checks its answer."""
    if name == "linear_cpu":
        assert lib.vgraph_linear_panel_width() == linear.PANEL
    elif name in ("paged_attention_cpu", "prefill_attention_cpu"):
        size = getattr(lib, f"vgraph_{name.removesuffix('_cpu')}_args_size")()
        assert size == ctypes.sizeof(cpu_attention_native._Args)
    elif name == "kv_cache_cpu":
        function = lib.vgraph_reshape_and_cache
        function.restype = ctypes.c_int64
        slots = (ctypes.c_int64 * 1)(5)  # outside an empty cache: reported, nothing written
        args = [None, None, 0, 0, 0, 0, None, None, 0, 0, 0, slots, 1, 1, 1, 1, 4, 16, 0]
        function.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2 + \
            [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int32] + [ctypes.c_int64] * 6
        assert function(*args) == 1
    elif name == "lora_cpu":
        assert lib.vgraph_lora_add_args_size() == ctypes.sizeof(lora._Args)
        assert lib.vgraph_lora_add_max_rank() == lora.MAX_RANK
    else:
        raise AssertionError(f"no check for the kernel library {name}: add one to _works")


def test_every_library_has_a_check():
    assert LIBRARIES == ["kv_cache_cpu", "linear_cpu", "lora_cpu", "paged_attention_cpu", "prefill_attention_cpu"]
    assert native_build.TORCH_API_LIBRARIES == {"dispatch_cpu"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Every library built once, with its record, into a cache dir nothing loads from."""
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("no C++ compiler")
    root = tmp_path_factory.mktemp("pristine-kernels")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VGRAPH_CACHE_DIR", str(root))
        for name in LIBRARIES:
            _build(name)
    return root / "kernels"


def _build(name: str) -> Path:
    return native_build._build(name, native_build.compiler(), native_build.CSRC / f"{name}.cpp",
                               native_build.source_text(name))


@pytest.fixture
def cache(pristine, tmp_path, monkeypatch):
    """A private kernel cache holding a copy of the pristine builds; ``load_library`` forgets
    what it loaded before and after."""
    shutil.copytree(pristine, tmp_path / "kernels")
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path))
    native_build.load_library.cache_clear()
    yield tmp_path / "kernels"
    native_build.load_library.cache_clear()


@pytest.fixture
def cdll(monkeypatch):
    """Every ``ctypes.CDLL`` call of native_build, as (path, sha256 of the file then); a file
    that does not match its record fails the test instead of being loaded."""
    loads = []

    def spy(path, *args, **kwargs):
        problem = file_digest.problem(Path(path))
        assert problem is None, f"ctypes.CDLL was called on {path}, which is {problem}"
        loads.append((path, hashlib.sha256(Path(path).read_bytes()).hexdigest()))
        return ctypes.CDLL(path, *args, **kwargs)

    monkeypatch.setattr(native_build, "ctypes", types.SimpleNamespace(CDLL=spy))
    return loads


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)  # in place, as a full disk or a cut copy leaves it


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def _drop_record(path: Path) -> None:
    file_digest.record_path(path).unlink()


def _garble_record(path: Path) -> None:
    file_digest.record_path(path).write_text("{not json")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _library(cache: Path, name: str) -> Path:
    (path,) = cache.glob(f"{name}-*.so")
    return path


def _check_rebuilt(name: str, path: Path, damaged: bytes, why: str, compiles, cdll, caplog) -> None:
    """The next load rebuilds the file (one compile, one warning naming it and ``why``), loads
    only the rebuilt bytes, and the library works."""
    caplog.set_level(logging.WARNING, logger=native_build.__name__)
    lib = native_build.load_library(name)
    (warning,) = _warnings(caplog)
    assert str(path) in warning and why in warning and "building it again" in warning, warning
    assert len(compiles) == 1
    rebuilt = path.read_bytes()
    assert rebuilt != damaged and file_digest.problem(path) is None
    assert cdll == [(str(path), hashlib.sha256(rebuilt).hexdigest())]
    _works(name, lib)
    native_build.load_library.cache_clear()
    caplog.clear()
    assert native_build.load_library(name) is not None
    assert len(compiles) == 1 and _warnings(caplog) == [], "the repaired file is reused quietly"


@requires_compiler
@pytest.mark.parametrize("damage,why", [(_truncate, "truncated"), (_flip, "damaged")],
                         ids=["truncated", "flipped"])
@pytest.mark.parametrize("name", LIBRARIES)
def test_a_damaged_library_is_rebuilt_with_one_warning_and_never_loaded(name, damage, why, cache, compiles,
                                                                        cdll, caplog):
    path = _library(cache, name)
    damage(path)
    _check_rebuilt(name, path, path.read_bytes(), why, compiles, cdll, caplog)


@requires_compiler
@pytest.mark.parametrize("damage,why", [(_drop_record, "without a sha256 record"),
                                        (_garble_record, "unreadable sha256 record")],
                         ids=["no-record", "garbled-record"])
def test_a_library_without_a_readable_record_is_rebuilt_not_trusted(damage, why, cache, compiles, cdll,
                                                                    caplog):
    """A cache from before the records (or a damaged record): the library may be whole, but
    nothing says so; it is rebuilt rather than mapped on trust."""
    path = _library(cache, "kv_cache_cpu")
    damage(path)
    _check_rebuilt("kv_cache_cpu", path, b"", why, compiles, cdll, caplog)


@requires_compiler
def test_a_whole_library_loads_without_a_compile_or_a_warning(cache, compiles, cdll, caplog):
    caplog.set_level(logging.WARNING, logger=native_build.__name__)
    for name in LIBRARIES:
        _works(name, native_build.load_library(name))
    assert compiles == [] and _warnings(caplog) == []
    assert sorted(path for path, _ in cdll) == sorted(str(_library(cache, n)) for n in LIBRARIES)


@requires_compiler
def test_a_fresh_build_records_its_digest_and_leaves_no_temporary_file(tmp_path, monkeypatch, compiles):
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path))
    path = _build("kv_cache_cpu")
    assert sorted(os.listdir(path.parent)) == [path.name, path.name + ".sha256"]
    assert file_digest.problem(path) is None and len(compiles) == 1


@requires_compiler
def test_a_library_damaged_after_the_build_is_not_loaded(cache, cdll):
    """``_load`` checks again right before ``ctypes.CDLL``: the file may change after
    ``_build`` returned it."""
    path = _library(cache, "kv_cache_cpu")
    _flip(path)
    with pytest.raises(native_build.NativeBuildError, match=r"damaged"):
        native_build._load(path)
    assert cdll == []


def _build_and_check(name: str, queue) -> None:
    """A forked first user: builds (or finds) the library, reports its compiles and whether
    the file it got matches its record."""
    calls = []
    real_run = native_build.subprocess.run

    def run(argv, *args, **kwargs):
        if "-o" in argv:
            calls.append(argv)
        return real_run(argv, *args, **kwargs)

    native_build.subprocess = types.SimpleNamespace(run=run)
    path = _build(name)
    queue.put((len(calls), file_digest.problem(path)))


@requires_compiler
def test_concurrent_first_users_compile_once_and_each_get_a_recorded_library(tmp_path, monkeypatch):
    """Three processes start on an empty cache at once: the directory lock lets one build and
    record the library; the others wait and find it whole."""
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path))
    native_build.compiler(), native_build._compiler_version(native_build.compiler())  # cached before forking
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    procs = [context.Process(target=_build_and_check, args=("kv_cache_cpu", queue)) for _ in range(3)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    assert sorted(compiled for compiled, _ in results) == [0, 0, 1]
    assert all(problem is None for _, problem in results)
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1


@requires_compiler
@pytest.mark.parametrize("damage,why", [(_truncate, "truncated"), (_flip, "damaged")], ids=["truncated", "flipped"])
def test_a_damaged_dispatcher_library_is_rebuilt_before_anything_loads_it(damage, why, tmp_path, monkeypatch,
                                                                         compiles, caplog):
    """``build_library`` (what ``cpu_dispatch.install`` loads from) repairs the file first."""
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path))
    path = native_build.build_library("dispatch_cpu")
    assert file_digest.problem(path) is None and len(compiles) == 1
    damage(path)
    caplog.set_level(logging.WARNING, logger=native_build.__name__)
    assert native_build.build_library("dispatch_cpu") == path
    (warning,) = _warnings(caplog)
    assert str(path) in warning and why in warning, warning
    assert len(compiles) == 2 and file_digest.problem(path) is None
