"""The compiler's modules import each other without a circle (issue 39: ``backend ->
warm_start -> build -> backend`` made the warm path hard to follow), and building the
compiled forward imports neither Dynamo nor Inductor until a rung below the runnables needs
them.

Every import counts, including those inside functions (a lazy import is still a dependency);
only ``if TYPE_CHECKING:`` blocks, which never run, are left out."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import vgraph.compiler

PACKAGE = "vgraph.compiler"
FOLDER = Path(vgraph.compiler.__file__).parent


def _imports(path: Path) -> set[str]:
    """The vgraph.compiler modules ``path`` imports."""
    module = f"{PACKAGE}.{path.stem}"
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
               for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = _absolute(module, node.module, node.level)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
            found.update(n for n in names if n.startswith(PACKAGE + ".") and (FOLDER / f"{n.split('.')[-1]}.py").exists()
                         and n.count(".") == 2)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE + "."))
    return found - {module}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _absolute(module: str, name: str | None, level: int) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")[:-level]
    return ".".join(base + ([name] if name else []))


def _graph() -> dict[str, set[str]]:
    return {f"{PACKAGE}.{p.stem}": _imports(p) for p in FOLDER.glob("*.py") if p.stem != "__init__"}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle, as the modules along it, or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_compiler_modules_import_each_other_without_a_circle():
    graph = _graph()
    assert f"{PACKAGE}.backend" in graph[f"{PACKAGE}.compiled_forward"], "the graph is read at all"
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def test_the_circle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_building_the_compiled_forward_imports_neither_dynamo_nor_inductor():
    """In a fresh interpreter: the ladder's module and every rung's, as a warm start imports them."""
    script = ("import sys, vgraph.compiler.build, vgraph.compiler.loaders, vgraph.compiler.ladder; "
              "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'triton') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
