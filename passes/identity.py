"""What decides a pass's behaviour, so that its ``uuid()`` changes whenever the pass does.

A pass's uuid keys Inductor's FX-graph cache and vgraph's compile cache: a uuid that stays the
same while the pass's behaviour changes means a stale compiled graph is loaded (the old
rewrite, the old match counts). The source of the module defining the pass is not enough:
behaviour often lives in a helper the pass imports (a pattern table, a module-level switch).
So a pass's identity covers the modules it imports **from its own package**, found by reading
the import statements of its source (``import pkg.helpers``, ``from . import helpers``,
``from .helpers import SWITCH``, also inside functions), and then theirs, transitively. "Its
own package" is the top-level package of the pass's module (``mypkg`` for
``mypkg.passes.fusion``); for a module outside any package (a script, ``my_pass.py`` on the
path) it is the modules whose files sit in the same directory. Third-party and standard
library modules are left out: their versions are not the pass author's edits.

What imports cannot show must be declared by the author: a module loaded with
``importlib.import_module``, or data files the pass reads (override
``VgraphPass.source_modules()`` to add modules, or ``config()`` for settings).
"""
from __future__ import annotations

import ast
import hashlib
import logging
import sys
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

logger = logging.getLogger("vgraph.passes")

SourceReader = Callable[[ModuleType], Optional[str]]

_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
# (module name, sha256 of its source) -> names it imports: parsing is the costly part, and
# the same modules are read for every pass and every uuid() call.
_IMPORTS: dict[tuple[str, str], frozenset[str]] = {}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def imported_names(module: ModuleType, source: str) -> frozenset[str]:
    """Absolute names of everything the source imports: modules, and ``pkg.name`` for each
    ``from pkg import name`` (which is a module when ``name`` is a submodule)."""
    key = (module.__name__, _sha256(source.encode()))
    if key not in _IMPORTS:
        _IMPORTS[key] = frozenset(_parse_imports(module, source))
    return _IMPORTS[key]


def _parse_imports(module: ModuleType, source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names: set[str] = set()
    package = module.__package__ or ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, package)
            if base:
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _resolve(name: str, level: int, package: str) -> str:
    """``from ..x import y`` in package ``a.b`` -> ``a.x``; '' when it climbs out of it."""
    if level == 0:
        return name
    parts = package.split(".") if package else []
    if level - 1 >= len(parts):
        return ""
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _module_file(module: ModuleType) -> Optional[Path]:
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


def _real_package(module: ModuleType) -> Optional[ModuleType]:
    """The imported top-level package of ``module`` (None for a module outside any package,
    or under a name prefix that is no imported package, as passes loaded from a file are)."""
    if not module.__package__:
        return None
    top = sys.modules.get(module.__name__.split(".")[0])
    return top if top is not None and hasattr(top, "__path__") else None


def _home(module: ModuleType) -> Optional[Path]:
    """The directory a module outside any package sits in, or holding a top-level package;
    None for site-packages and the standard library (neighbours there are other projects,
    not the author's code)."""
    top = _real_package(module)
    file = _module_file(top) if top is not None else _module_file(module)
    if file is None:
        return None
    home = file.parent.parent if top is not None else file.parent
    return None if home.name in ("site-packages", "dist-packages") or home == _STDLIB else home


def _same_package(candidate: ModuleType, origin: ModuleType) -> bool:
    """Whether ``candidate`` belongs to ``origin``'s own code (see the module docstring)."""
    if candidate is origin or candidate.__name__ == "__main__":
        return False
    top = _real_package(origin)
    if top is not None:
        return candidate.__name__ == top.__name__ or candidate.__name__.startswith(top.__name__ + ".")
    home = _home(origin)
    return home is not None and _home(candidate) == home


def package_imports(modules: Iterable[ModuleType], read: SourceReader) -> list[ModuleType]:
    """The modules the given ones import from their own packages, directly or through each
    other, sorted by name; the given modules themselves are not repeated. Only modules already
    imported count (an import that ran is in ``sys.modules``; one that did not cannot have
    shaped the pass)."""
    given = {m.__name__: m for m in modules}
    found: dict[str, ModuleType] = {}
    queue = [(m, m) for m in given.values()]  # (module to read, the pass module it came from)
    while queue:
        module, origin = queue.pop()
        source = read(module)
        if source is None:
            continue
        for name in sorted(imported_names(module, source)):
            candidate = sys.modules.get(name)
            if (isinstance(candidate, ModuleType) and name not in given and name not in found
                    and _same_package(candidate, origin)):
                found[name] = candidate
                queue.append((candidate, origin))
    return [found[name] for name in sorted(found)]


def module_digest(module: ModuleType, read: SourceReader) -> Optional[str]:
    """sha256 of the module's source, else of its file (an extension module), else None."""
    source = read(module)
    if source is not None:
        return _sha256(source.encode())
    path = _module_file(module)
    try:
        return _sha256(path.read_bytes()) if path is not None else None
    except OSError:
        return None


def source_digests(declared: Iterable[ModuleType], read: SourceReader) -> Optional[dict[str, str]]:
    """Module name -> source hash for the declared modules and their package imports; None if
    a declared module has no source (the pass cannot be told apart from an edited version of
    itself). An imported module without any readable file is left out, with a debug line."""
    declared = list(declared)
    digests: dict[str, str] = {}
    for module in declared:
        text = read(module)
        if text is None:
            return None
        digests[module.__name__] = _sha256(text.encode())
    for module in package_imports(declared, read):
        digest = module_digest(module, read)
        if digest is None:
            logger.debug("no source or file for %s, imported by a pass; left out of its uuid", module.__name__)
            continue
        digests[module.__name__] = digest
    return digests


def module_of(cls: type) -> ModuleType:
    """The module defining ``cls``. One that was executed but never registered in
    ``sys.modules`` (``importlib.util.module_from_spec`` without the registration) is stood in
    for by a module object pointing at the file its methods were compiled from, so its source
    still decides the uuid; with no such file the stand-in has no source, and the pass no uuid
    (never a uuid that leaves the pass's own code out)."""
    module = sys.modules.get(cls.__module__)
    if module is not None:
        return module
    stand_in = ModuleType(cls.__module__)
    files = {f.__code__.co_filename for f in vars(cls).values() if hasattr(f, "__code__")}
    real = sorted(f for f in files if Path(f).is_file())
    if len(real) == 1:
        stand_in.__file__ = real[0]
    return stand_in


def missing_sources(p: Any) -> list[str]:
    """Names of the modules a pass declares (``source_modules()``) whose source is unreadable."""
    from .base import source_of
    declared = p.source_modules() if callable(getattr(p, "source_modules", None)) else []
    return [m.__name__ for m in declared if source_of(m) is None]


def identity_problem(p: Any) -> Optional[str]:
    """Why a pass has no reliable identity (no uuid), or None when it has one. vgraph turns
    its compile cache off for a compile with such a pass, and says this once."""
    missing = missing_sources(p)
    if missing:
        return (f"no source for module {', '.join(map(repr, missing))} (defined in `python -c`, a "
                "notebook or a REPL?)")
    if p.uuid() is None:
        return "its uuid() returned None"
    return None
