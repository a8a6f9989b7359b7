"""The documentation stays true: the feature matrix names tests that exist, the README stays
short and its links resolve, and the generated CLI reference lists every option. (The site
itself is built with ``mkdocs build --strict`` by scripts/test.sh, which fails on a broken
link, anchor or page; the README's and the docs' offline snippets run in test_readme.py.)"""
from __future__ import annotations

import ast
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
COLUMNS = ["feature", "CPU", "CUDA", "compiled", "CUDA graphs", "TP", "DP", "engine process"]
ENTRY = re.compile(r"(tested|gpu|refused): `([^`]+)`")
PLAIN_CELLS = {"untested", "n/a", "refused (the same check)"}


def matrix() -> list[dict[str, str]]:
    """docs/features.md's table, one dict per row, keyed by column name."""
    lines = [line for line in (DOCS / "features.md").read_text(encoding="utf-8").splitlines()
             if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    rows = []
    for line in lines[1:]:
        if set(line.replace("|", "").strip()) <= {"-", " "}:
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), line
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def entries(cell: str) -> list[tuple[str, str]]:
    """A cell's (kind, test) pairs; a cell without any must be one of the plain words."""
    found = ENTRY.findall(cell)
    if not found:
        assert cell in PLAIN_CELLS, f"cell {cell!r}: expected 'tested: `node`', 'gpu: `node`', " \
                                    f"'refused: `node`' or one of {sorted(PLAIN_CELLS)}"
    else:
        rest = ENTRY.sub("", cell).replace(";", "").strip()
        assert not rest, f"cell {cell!r} has text besides its tests: {rest!r}"
    return found


@lru_cache(maxsize=None)
def _module(path: Path) -> tuple[ast.Module, str]:
    source = path.read_text(encoding="utf-8")
    return ast.parse(source), source


def _test_function(node_id: str) -> tuple[ast.Module, str, ast.FunctionDef]:
    file, _, name = node_id.partition("::")
    path = REPO / file
    assert path.is_file(), f"{node_id}: no file {file}"
    assert name, f"{node_id}: name the test function (file::test_name)"
    tree, source = _module(path)
    name = name.split("[")[0]  # a parametrized id names its function
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return tree, source, node
    raise AssertionError(f"{node_id}: no test function {name} in {file}")


def _gpu_marked(tree: ast.Module, source: str, fn: ast.FunctionDef) -> bool:
    """The test carries the gpu mark: on itself, through the module's ``pytestmark``, or
    through a parameter list (a module-level name its decorators use) whose params carry it."""
    texts = [ast.get_source_segment(source, d) or "" for d in fn.decorator_list]
    names = {n.id for d in fn.decorator_list for n in ast.walk(d) if isinstance(n, ast.Name)}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            targets = {t.id for t in stmt.targets if isinstance(t, ast.Name)}
            if targets & (names | {"pytestmark"}):
                texts.append(ast.get_source_segment(source, stmt) or "")
    return any("mark.gpu" in text for text in texts)


def _only_gpu(tree: ast.Module, source: str) -> bool:
    """Every test of the module is gpu-marked (its ``pytestmark`` says so)."""
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in stmt.targets):
            return "mark.gpu" in (ast.get_source_segment(source, stmt) or "")
    return False


ROWS = matrix()


def test_the_matrix_covers_the_columns_and_has_rows():
    assert len(ROWS) >= 10
    assert all(row["feature"] for row in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[row["feature"][:40] for row in ROWS])
def test_every_cell_names_a_test_that_exists(row):
    for column in COLUMNS[1:]:
        for kind, node_id in entries(row[column]):
            tree, source, fn = _test_function(node_id)
            where = f"{row['feature']!r} / {column}: {node_id}"
            if kind == "gpu":
                assert _gpu_marked(tree, source, fn), f"{where} is not marked gpu"
            else:
                assert not _only_gpu(tree, source), f"{where} is a gpu-only test: say 'gpu:'"
            if column == "CUDA" and kind == "tested":
                raise AssertionError(f"{where}: a CUDA cell is 'gpu:' (CI has no GPU) or 'refused:'")


def test_the_cpu_column_never_claims_a_gpu_test():
    for row in ROWS:
        assert all(kind != "gpu" for kind, _ in entries(row["CPU"])), row["feature"]


# ----------------------------------------------------------------------------------- README

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_short_and_keeps_the_two_commands():
    assert len(README.splitlines()) <= 200
    assert "bash scripts/run.sh" in README and "bash scripts/test.sh" in README
    assert "## Two commands" in README


def test_readme_links_resolve():
    """GitHub renders the README with relative links; MkDocs does not check it, so this does."""
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        assert (REPO / path).exists(), f"README links to {target}, which does not exist"


def test_ci_builds_the_docs_strictly():
    script = (REPO / "scripts" / "test.sh").read_text(encoding="utf-8")
    build = [line for line in script.splitlines() if "-m mkdocs build" in line and not line.lstrip().startswith("#")]
    assert len(build) == 1 and "--strict" in build[0], build
    assert "--quiet" not in build[0] and " -q " not in build[0]  # --quiet hides the warnings --strict counts


# ------------------------------------------------------------------------ the CLI reference

def test_the_cli_reference_lists_every_option_of_every_command():
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import generate
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    from vgraph.cli import build_parser
    page = generate.cli_reference()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name, command in commands.items():
        assert f"## vgraph {name}" in page
        command.format_help()  # its deferred options
        for action in command._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in page, f"vgraph {name} {option} is missing from the CLI reference"


# ------------------------------------------------------------------------ coming from vLLM

def test_every_vllm_flag_on_the_compat_page_is_a_serve_flag():
    """docs/vllm-compat.md says what vgraph does with each of vllm serve's flags: each flag its
    table names must be one `vgraph serve` takes (accepted, an alias, or refused by value)."""
    import argparse

    from vgraph.cli import build_parser
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    serve.format_help()  # its deferred options
    known = {option for action in serve._actions for option in action.option_strings}
    page = (DOCS / "vllm-compat.md").read_text(encoding="utf-8")
    table = page.split("## vLLM's serve flags")[1].split("### ")[0]
    flags = {flag for row in table.splitlines() if row.startswith("| `")
             for flag in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", row.split(" | ")[0])}
    assert {"-tp", "-O", "--trust-remote-code", "--kv-cache-dtype"} <= flags, "the table is read"
    assert flags <= known, sorted(flags - known)
