"""A compiled piece that runs without importing Inductor: the warm start's fast path.

Why: on a warm start every piece's code is already on disk, yet loading it through Inductor
imports Dynamo and Inductor (about 2.5 s on a 2-core machine, more than the rest of a demo
model's start together) and runs Inductor's loader (about 0.2 s per artifact). What Inductor
produced for a CPU piece is plain: a Python wrapper of straight-line code that calls C++
kernels (each compiled into a small Python extension module), ATen and vgraph's ops. For
vgraph's pieces the layers Inductor and AOTAutograd put around that wrapper only turn grad
mode off and mark dynamic dimensions for Dynamo: no input is mutated outside the graph (the
attention op, which writes the KV cache, is split off) and no input is realigned.

A runnable is that wrapper's source, run with its kernel libraries and nothing else from
Inductor. ``make_runnable`` takes it from a piece Inductor compiled or loaded in this process
(Inductor imported), and only where everything the wrapper takes from Inductor has a stand-in
here: ``AsyncCompile``, whose ``cpp_pybinding`` becomes a lookup of the recorded library, and
``extern_kernels``, whose functions are torch's own. The backend then checks the forward built
from runnables against Inductor's, bit for bit, before it saves any (backend.py).

Files, next to the entry's artifacts: ``<piece hash>-<size>.run`` (a JSON header with the
sha256 of the source and of each kernel library, then the source) and ``kernels/<sha256>.so``,
shared by the entry's pieces. A file that is missing, damaged or from another torch version
makes the warm start take Inductor's path, which is always there.
"""
from __future__ import annotations

import ast
import builtins
import hashlib
import importlib.util
import json
import linecache
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from . import cache_entries

RUNNABLE_FORMAT = 1
RUNNABLE_MAGIC = b"vgraph-runnable\n"
KERNEL_FOLDER = "kernels"
_INDUCTOR_PACKAGES = ("torch._inductor", "torch._dynamo")
# What a wrapper may take from Inductor; anything else it uses means no runnable.
_KERNELS, _EXTERN = "AsyncCompile", "extern_kernels"
_HARNESS = {"get_args", "benchmark_compiled_module"}  # the wrapper's benchmark, never called here
_LOADED_LIBRARIES: dict[str, Any] = {}  # library sha256 -> its module, once per process


@dataclass(frozen=True)
class RunnableParts:
    """What a runnable is made of, as ``make_runnable`` found it."""

    source: str
    libraries: dict[str, str]  # kernel key -> path of the library Inductor built for it
    extern: dict[str, str]  # extern_kernels attribute -> the torch function of that name


def kernel_key(argtypes: Sequence[str], source: str) -> str:
    """Names one ``cpp_pybinding`` call of a wrapper: its argument types and C++ source."""
    return hashlib.sha256(json.dumps([list(argtypes), source]).encode()).hexdigest()


# ---------------------------------------------------------------------------- the wrapper's source

def _from_inductor(module: Optional[str]) -> bool:
    return module is not None and any(module == p or module.startswith(p + ".") for p in _INDUCTOR_PACKAGES)


def _is_harness(node: ast.stmt) -> bool:
    """The benchmark helpers and the ``if __name__ == "__main__":`` block at the wrapper's end."""
    if isinstance(node, ast.FunctionDef):
        return node.name in _HARNESS
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


def parse_wrapper(source: str) -> tuple[Optional[ast.Module], str]:
    """The wrapper without its benchmark harness and its imports from Inductor, or None and
    why it cannot run without Inductor."""
    tree = ast.parse(source)
    imported: dict[str, str] = {}
    body = []
    for node in tree.body:
        if _is_harness(node):
            continue
        if isinstance(node, ast.ImportFrom) and _from_inductor(node.module):
            imported.update({a.asname or a.name: a.name for a in node.names})
            continue
        body.append(node)
    tree.body = body
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if any(_from_inductor(n) for n in names) or (isinstance(node, ast.ImportFrom) and _from_inductor(node.module)):
            return None, f"it imports from Inductor at line {node.lineno}"
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    missing = sorted(f"{alias} ({name})" for alias, name in imported.items()
                     if alias in used and (alias, name) not in ((_KERNELS, _KERNELS), (_EXTERN, _EXTERN)))
    if missing:
        return None, f"it uses {', '.join(missing)} from Inductor"
    return tree, ""


def extern_names(tree: ast.Module) -> set[str]:
    """The ``extern_kernels.<name>`` functions the wrapper calls."""
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == _EXTERN}


def _execute(tree: ast.Module, label: str, source: str, kernels: Any, extern: Any) -> Callable:
    """Runs the wrapper's module code with the stand-ins; its ``call``. The source is put in
    linecache under ``label``, so a traceback through a runnable shows the generated line."""
    filename = f"<vgraph runnable {label}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": f"vgraph_runnable_{label}", "__builtins__": builtins,
                 _KERNELS: lambda: kernels, _EXTERN: extern}
    exec(compile(tree, filename, "exec"), namespace)
    call = namespace.get("call")
    if not callable(call):
        raise ValueError("the wrapper defines no call()")
    return call


# ---------------------------------------------------------------------------- running

class _KernelLibraries:
    """Stands in for Inductor's ``AsyncCompile`` in a runnable: the C++ kernels are compiled
    already, so naming one loads its library."""

    def __init__(self, libraries: dict[str, tuple[Path, str]]) -> None:
        self.libraries = libraries  # kernel key -> (path, sha256)

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable:
        path, sha = self.libraries[kernel_key(argtypes, source_code)]
        return load_library(path, sha).kernel

    def wait(self, scope: dict[str, Any]) -> None:
        """Inductor resolves kernels compiled in the background here; a runnable's are loaded
        when named, so there is nothing left to wait for."""
        return None


def load_library(path: Path, sha: str) -> Any:
    """A kernel's Python extension module, loaded as Inductor loads it: the module finds the
    tensor data-pointer helper of this torch through the environment variable Inductor sets."""
    module = _LOADED_LIBRARIES.get(sha)
    if module is not None:
        return module
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
        torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
    spec = importlib.util.spec_from_file_location(f"vgraph_kernel_{sha[:20]}.kernel", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the kernel library {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _LOADED_LIBRARIES[sha] = module
    return module


class Runnable:
    """Called as Inductor's loaded artifact is: ``runnable(*args)``, the outputs as a tuple.
    Grad mode is off during the call, as Inductor's runtime wrapper turns it off."""

    def __init__(self, call: Callable[[list], Any]) -> None:
        self._call = call

    def __call__(self, *args: Any) -> Any:
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._call(list(args))
        return self._call(list(args))


def build_runnable(source: str, libraries: dict[str, tuple[Path, str]], extern: dict[str, str],
                   label: str) -> Runnable:
    """The runnable for a wrapper source whose kernels are in ``libraries``; raises if the
    source needs anything else from Inductor or a library is not there."""
    tree, why = parse_wrapper(source)
    if tree is None:
        raise ValueError(f"the wrapper cannot run without Inductor: {why}")
    stand_in = SimpleNamespace(**{name: getattr(torch, target) for name, target in extern.items()})
    return Runnable(_execute(tree, label, source, _KernelLibraries(libraries), stand_in))


# ---------------------------------------------------------------------------- making (Inductor imported)

def find_compiled_graph(artifact: Any, depth: int = 8) -> Optional[Any]:
    """Inductor's ``CompiledFxGraph`` inside a compiled artifact: the object holding the
    wrapper's ``source_code`` and ``current_callable``, found through the closures of the
    runtime wrappers around it (their shape differs between torch versions)."""
    seen: set[int] = set()
    frontier = [getattr(artifact, "_compiled_fn", artifact)]
    for _ in range(depth):
        found, frontier = _graph_in(frontier, seen)
        if found is not None:
            return found
    return None


def _graph_in(frontier: list, seen: set[int]) -> tuple[Optional[Any], list]:
    following = []
    for obj in frontier:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(getattr(obj, "source_code", None), str) and hasattr(obj, "current_callable"):
            return obj, []
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                following.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        following.extend(v for v in (getattr(obj, "__wrapped__", None), getattr(obj, "__self__", None)) if v is not None)
    return None, following


def make_runnable(artifact: Any) -> tuple[Optional[RunnableParts], str]:
    """The runnable's parts for a CPU piece Inductor compiled or loaded in this process, or
    None and why there is none. Runs the wrapper's module code once with Inductor's own
    loader behind the stand-in, to learn which library each kernel is."""
    graph = find_compiled_graph(artifact)
    if graph is None:
        return None, "Inductor's compiled graph was not found in the artifact"
    unsupported = _unsupported(graph)
    if unsupported:
        return None, unsupported
    tree, why = parse_wrapper(graph.source_code)
    if tree is None:
        return None, why
    from torch._inductor.select_algorithm import extern_kernels as inductor_extern
    extern = {}
    for name in extern_names(tree):
        fn = getattr(inductor_extern, name, None)
        if fn is None or getattr(torch, getattr(fn, "__name__", ""), None) is not fn:
            return None, f"extern_kernels.{name} is not a torch function"
        extern[name] = fn.__name__
    recorder = _RecordingLibraries()
    _execute(tree, "recording", graph.source_code, recorder, SimpleNamespace(**{n: getattr(torch, t) for n, t in extern.items()}))
    return RunnableParts(graph.source_code, recorder.paths, extern), ""


def _unsupported(graph: Any) -> str:
    """Why Inductor's runtime does more around this wrapper than call it, or ''."""
    if set(getattr(graph, "device_types", ())) - {"cpu"}:
        return f"it runs on {sorted(graph.device_types)}, not only the CPU"
    for attribute in ("mutated_input_idxs", "inputs_to_check", "constants", "torchbind_constants"):
        if getattr(graph, attribute, None):
            return f"its {attribute} is not empty"
    return ""


class _RecordingLibraries:
    """``AsyncCompile`` while a runnable is made: Inductor's loader builds (or finds) each
    kernel, and the library it loaded is recorded under the kernel's key."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable:
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        kernel = CppPythonBindingsCodeCache.load_pybinding(argtypes, source_code)
        path = getattr(getattr(kernel, "__self__", None), "__file__", None)
        if not path:
            raise ValueError("a kernel's library has no file")
        self.paths[kernel_key(argtypes, source_code)] = path
        return kernel

    def wait(self, scope: dict[str, Any]) -> None:
        """Kernels are loaded synchronously here; nothing to wait for."""
        return None


# ---------------------------------------------------------------------------- files

def stage_libraries(folder: Path, parts: RunnableParts) -> dict[str, tuple[Path, str]]:
    """Copies the kernel libraries into the entry (by content: pieces share them), so a later
    start needs nothing from Inductor's own cache; kernel key -> (path, sha256)."""
    kernels = folder / KERNEL_FOLDER
    kernels.mkdir(parents=True, exist_ok=True)
    staged = {}
    for key, source_path in parts.libraries.items():
        data = Path(source_path).read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        target = kernels / f"{sha}.so"
        if not _matches(target, sha):
            cache_entries.write_atomic(target, data)
        staged[key] = (target, sha)
    return staged


def _matches(library: Path, sha: str) -> bool:
    """Whether the entry's copy of a kernel library is there and whole. A damaged copy (its
    name is its sha256) is reported and then overwritten by the caller: skipping every file
    that merely exists would leave it damaged, and every later start off the fast path."""
    try:
        data = library.read_bytes()
    except OSError:
        return False
    if hashlib.sha256(data).hexdigest() == sha:
        return True
    cache_entries.report_damaged(library, _LIBRARY_MISMATCH, "written again from Inductor's cache")
    return False


_LIBRARY_MISMATCH = "the kernel library does not match its sha256 checksum"


def runnable_path(folder: Path, piece_hash: str, size: str) -> Path:
    return folder / f"{piece_hash}-{size}.run"


def save_runnable(folder: Path, piece_hash: str, size: str, parts: RunnableParts,
                  staged: dict[str, tuple[Path, str]], pass_matches: dict[str, int]) -> None:
    """Writes the runnable file (atomically); its libraries were staged before the check."""
    header = {"format": RUNNABLE_FORMAT, "torch": torch.__version__, "piece_hash": piece_hash, "size": size,
              "kernels": {k: sha for k, (_, sha) in staged.items()}, "extern": parts.extern,
              "pass_matches": pass_matches}
    cache_entries.write_atomic(runnable_path(folder, piece_hash, size),
                               cache_entries.pack_framed(RUNNABLE_MAGIC, header, parts.source.encode()))


def read_runnable(path: Path, piece_hash: str, size: str) -> tuple[dict, str]:
    """The header and source of a runnable file, checked; ValueError for a file that is
    truncated, damaged (DamagedFile, naming ``path``), from another format or torch, or made
    for another piece."""
    try:
        header, source = cache_entries.unpack_framed(path.read_bytes(), RUNNABLE_MAGIC, "vgraph runnable")
    except cache_entries.DamagedFile as exc:
        raise cache_entries.DamagedFile(str(exc), path) from None
    if header.get("format") != RUNNABLE_FORMAT or header.get("torch") != torch.__version__:
        raise ValueError(f"format {header.get('format')} for torch {header.get('torch')}")
    if (header.get("piece_hash"), header.get("size")) != (piece_hash, size):
        raise ValueError(f"made for {header.get('piece_hash')}-{header.get('size')}")
    return header, source.decode()


def load_runnable(folder: Path, piece_hash: str, size: str) -> tuple[Runnable, dict[str, int]]:
    """The runnable saved for this piece and its pass matches; raises (OSError, ValueError,
    ImportError, ...) when it is missing or unusable, DamagedFile (naming the file) when the
    runnable or one of its libraries is damaged."""
    header, source = read_runnable(runnable_path(folder, piece_hash, size), piece_hash, size)
    libraries = {}
    for key, sha in header["kernels"].items():
        path = folder / KERNEL_FOLDER / f"{sha}.so"
        if sha not in _LOADED_LIBRARIES and hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            raise cache_entries.DamagedFile(_LIBRARY_MISMATCH, path)
        libraries[key] = (path, sha)
    runnable = build_runnable(source, libraries, header["extern"], f"{piece_hash}-{size}")
    return runnable, dict(header.get("pass_matches") or {})
