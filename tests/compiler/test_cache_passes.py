"""Issue 18: the compile cache never serves a user pass the artifacts of another version of it.

Both bugs were found by writing a pass as a user would: in a notebook or ``python -c`` (no
source, hence no uuid: the cache saved the result anyway and loaded it after the pass changed),
and in a package whose helper module held a switch (flipped off, the artifact compiled with it
on still loaded). Each start here is a real engine on the tiny Llama with only the user pass
(``enable_fusion=False``), so the counts are the user pass's own.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.compiler.build import build_pass_manager, config_key
from vgraph.config import CompileConfig, EngineConfig, ModelConfig
from vgraph.models.loader import load_hf_config
from vgraph.passes import as_pass
from vgraph.passes.identity import identity_problem

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PACKAGE = "vgraph_test_switch_passes"

FUSION = '''
from collections import Counter

import torch

from vgraph.passes import VgraphPass

from . import switches


class SwitchPass(VgraphPass):
    """Counts (rewrites nothing) aten.mul calls while the switch is on, aten.add calls when off."""

    def apply(self, graph):
        target = torch.ops.aten.mul.Tensor if switches.COUNT_MULS else torch.ops.aten.add.Tensor
        return Counter(nodes=sum(1 for n in graph.nodes if n.target is target))
'''

NOTEBOOK_CELL = '''
from collections import Counter

from vgraph.passes import VgraphPass


class CellPass(VgraphPass):
    """Returns the same count for every graph: version {version} counts {version}."""

    def apply(self, graph):
        return Counter(nodes={version})
'''


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """``PACKAGE.fusion.SwitchPass``, whose behaviour lives in ``PACKAGE.switches``."""
    folder = tmp_path / "src" / PACKAGE
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "switches.py").write_text("COUNT_MULS = True\n")
    (folder / "fusion.py").write_text(FUSION)
    monkeypatch.syspath_prepend(str(folder.parent))
    yield importlib.import_module(f"{PACKAGE}.fusion"), folder / "switches.py"
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def _flip_switch(switches_file: Path) -> None:
    """The author's edit: the switch off, as a new start of their program would see it."""
    switches_file.write_text("COUNT_MULS = False  # off: count adds\n")
    importlib.reload(sys.modules[f"{PACKAGE}.switches"])


def _cell_pass(version: int) -> object:
    """A pass defined in a notebook cell: its module (``__main__`` there) is imported but has
    no file, so no source to read."""
    module = types.ModuleType("vgraph_test_notebook_cell")
    sys.modules[module.__name__] = module
    exec(compile(textwrap.dedent(NOTEBOOK_CELL.format(version=version)), "<cell>", "exec"), module.__dict__)
    return module.CellPass()


def _start(root: Path, user_pass: object, caplog) -> dict:
    caplog.clear()
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.INFO, logger="vgraph"):
        mp.setenv("VGRAPH_CACHE_DIR", str(root))
        llm = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=64,
                  max_num_batched_tokens=64, max_num_seqs=4, enable_fusion=False, passes=[user_pass])
        out = llm.generate([{"prompt_token_ids": [5, 17, 99, 3]}], PARAMS, use_tqdm=False)
    runner = llm.engine.runner
    return {"counters": runner.compile_counters, "key": runner.compile_cache.config_key,
            "tokens": list(out[0].outputs[0].token_ids), "log": caplog.text,
            "warnings": [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]}


def _entries(root: Path) -> list[Path]:
    base = root / "compile"
    return sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []


def test_a_helper_modules_switch_is_part_of_the_key(user_package, tmp_path, caplog):
    fusion, switches_file = user_package
    root = tmp_path / "cache"
    cold = _start(root, fusion.SwitchPass(), caplog)
    uuid = fusion.SwitchPass().uuid()
    assert f"compile cache key {cold['key']}; user passes: SwitchPass uuid {uuid[:16]}" in cold["log"]
    muls = cold["counters"].pass_matches["SwitchPass"]
    assert muls > 0 and cold["counters"].captured_graph == "saved"

    warm = _start(root, fusion.SwitchPass(), caplog)
    assert warm["counters"].captured_graph == "loaded", "a pass with an identity keeps the cache on"
    assert warm["counters"].pass_matches["SwitchPass"] == muls and warm["key"] == cold["key"]

    _flip_switch(switches_file)
    flipped = _start(root, fusion.SwitchPass(), caplog)
    assert flipped["key"] != cold["key"] and flipped["counters"].inductor_compilations > 0
    adds = flipped["counters"].pass_matches["SwitchPass"]
    assert 0 < adds != muls, "the switched-off pass ran: before, the old artifact and count came back"
    assert len(_entries(root)) == 2 and flipped["warnings"] == []


def test_a_pass_without_source_turns_the_cache_off_with_one_warning(tmp_path, caplog):
    root = tmp_path / "cache"
    first = _start(root, _cell_pass(1), caplog)
    (warning,) = first["warnings"]
    assert "compile cache is off for this compile" in warning and "CellPass" in warning
    assert "no source for module 'vgraph_test_notebook_cell'" in warning
    assert "(cache not used)" in first["log"] and "CellPass uuid none" in first["log"]
    per_piece = first["counters"].pass_matches["CellPass"]
    assert per_piece > 0 and _entries(root) == [], "nothing saved that a later start could load"

    second = _start(root, _cell_pass(2), caplog)
    assert second["counters"].inductor_compilations > 0 and second["counters"].captured_graph != "loaded"
    assert second["counters"].pass_matches["CellPass"] == 2 * per_piece, "the changed pass's count, not the old"
    assert len(second["warnings"]) == 1 and second["tokens"] == first["tokens"]


def _key(user_pass: object) -> str:
    path = tiny_checkpoint(arch="llama")
    config = EngineConfig(model=ModelConfig(model=path), compile=CompileConfig(passes=[user_pass]))
    manager = build_pass_manager(config)
    return config_key(config, load_hf_config(path), torch.float32, manager.uuid(), torch.device("cpu"), {})


def test_an_edited_user_pass_gets_a_new_key(user_package):
    fusion, _ = user_package
    before = _key(fusion.SwitchPass())
    assert _key(fusion.SwitchPass()) == before
    source = Path(fusion.__file__)
    source.write_text(source.read_text() + "\n# the author changed a comment: another source, another key\n")
    assert _key(fusion.SwitchPass()) != before


def test_a_function_pass_is_keyed_by_its_source_too(tmp_path, monkeypatch):
    """A hand-written uuid the author forgot to bump no longer hides an edited function."""
    module_file = tmp_path / "vgraph_test_function_pass.py"
    module_file.write_text("def count(graph):\n    return 1\n\ncount.uuid = lambda: 'count/1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("vgraph_test_function_pass")
    try:
        before = _key(module.count)
        module_file.write_text("def count(graph):\n    return 2\n\ncount.uuid = lambda: 'count/1'\n")
        assert _key(module.count) != before
    finally:
        del sys.modules["vgraph_test_function_pass"]


def test_identity_problems_name_the_cause():
    assert "no source for module 'vgraph_test_notebook_cell'" in identity_problem(_cell_pass(1))

    def no_uuid(graph):
        return 0

    no_uuid.uuid = lambda: None
    assert identity_problem(as_pass(no_uuid)) == "its uuid() returned None"


def test_a_pass_from_a_module_never_registered_is_keyed_by_its_file(tmp_path):
    """``module_from_spec`` + ``exec_module`` without ``sys.modules``: before, a KeyError at
    startup; now the file its methods came from is the pass's source."""
    path = tmp_path / "unregistered_pass.py"
    path.write_text(textwrap.dedent(NOTEBOOK_CELL.format(version=1)))
    spec = importlib.util.spec_from_file_location("vgraph_test_unregistered", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert "vgraph_test_unregistered" not in sys.modules
    before = module.CellPass().uuid()
    assert before is not None and identity_problem(module.CellPass()) is None
    path.write_text(textwrap.dedent(NOTEBOOK_CELL.format(version=2)))
    assert module.CellPass().uuid() != before
