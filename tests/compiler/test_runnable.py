"""The warm start's fast path: pieces saved as runnables, run without importing Inductor.

The promise: a warm start on a cache whose runnables a cold start checked runs the same code
(same tokens, equal to transformers) without importing Dynamo or Inductor, and anything wrong
with the runnables (a damaged file, a library that does not match, a first call that fails)
means Inductor's path, never a wrong or crashed engine.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.compiler.tiny_engine import ENGINE, PROMPTS, cold_start, piece_runners
from tests.compiler.tiny_engine import engine as _engine
from tests.compiler.tiny_engine import tokens as _tokens
from vgraph.compiler import runnable as runnables
from vgraph.compiler import torch_range, warm_start
from vgraph.config import CompileConfig, EngineConfig, ModelConfig


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A cold start into its own cache: its tokens, the filled cache dir, and what each
    compiled piece calls (its dynamic-size code)."""
    llm, root = cold_start(tmp_path_factory, "runnable-cold")
    return {"counters": llm.engine.runner.compile_counters, "tokens": _tokens(llm), "root": root,
            "pieces": [runner.dynamic for runner in piece_runners(llm)]}


def _copy(cold, tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    shutil.copytree(cold["root"], root)
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(root))
    return root


def test_cold_start_saves_checked_runnables_and_the_warm_index(cold):
    root = cold["root"]
    runs = list(root.glob("compile/*/*-dynamic.run"))
    assert len(runs) == cold["counters"].unique_piece_graphs == cold["counters"].runnable_saves
    assert list(root.glob("compile/*/kernels/*.so")), "the kernel libraries live in the entry"
    index = json.loads(next(root.glob("warm/*.json")).read_text())
    assert next(root.glob("compile/*")).name.startswith(index["config_key"])
    assert cold["pieces"] and all(isinstance(p, runnables.Runnable) for p in cold["pieces"]), \
        "the cold start serves with the code warm starts will run"
    assert cold["counters"].rung == "full compile"


def test_warm_start_imports_neither_inductor_nor_dynamo_nor_triton_and_gives_the_same_tokens(cold, tmp_path):
    """In a fresh process, as a user starts one (this test process has imported Inductor)."""
    root = tmp_path / "cache"
    shutil.copytree(cold["root"], root)
    script = textwrap.dedent(f"""
        import json, sys
        from vgraph import LLM, SamplingParams
        llm = LLM({str(tiny_checkpoint(arch="llama"))!r}, **{ENGINE!r})
        outs = llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        c = llm.engine.runner.compile_counters
        print(json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in outs],
                          "inductor": "torch._inductor" in sys.modules, "dynamo": "torch._dynamo" in sys.modules,
                          "triton": "triton" in sys.modules,
                          "runnables": c.runnable_loads, "graph": c.captured_graph, "pieces": c.compiled_pieces}}))
    """)
    env = {**_clean_env(), "VGRAPH_CACHE_DIR": str(root)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["graph"] == "loaded" and result["runnables"] == cold["counters"].unique_piece_graphs
    assert result["pieces"] == cold["counters"].compiled_pieces
    assert not result["inductor"] and not result["dynamo"] and not result["triton"]
    assert result["tokens"] == cold["tokens"]


def _clean_env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}


def test_warm_start_in_process_reports_runnables(cold, tmp_path, monkeypatch):
    _copy(cold, tmp_path, monkeypatch)
    llm = _engine()
    c = llm.engine.runner.compile_counters
    assert c.captured_graph == "loaded" and c.runnable_loads == cold["counters"].unique_piece_graphs
    assert c.graphs_seen == 0 and c.inductor_compilations == 0 and c.cache_loads == 0
    assert c.pass_matches == cold["counters"].pass_matches
    assert c.rung == "runnables"
    assert _tokens(llm) == cold["tokens"]


def test_a_torch_outside_the_checked_range_is_served_by_the_captured_graph(cold, tmp_path, monkeypatch, caplog):
    """Torch-version safety: the runnables read Inductor internals, so they decline (one log
    line) on a torch they were not checked on; the next rung loads through Inductor."""
    _copy(cold, tmp_path, monkeypatch)
    monkeypatch.setattr(torch_range, "running_torch", lambda: "2.99.0")
    with caplog.at_level(logging.INFO, logger="vgraph"):
        llm = _engine()
    declined = [r.getMessage() for r in caplog.records if "runnables rung declined" in r.getMessage()]
    assert len(declined) == 1 and "2.99.0" in declined[0]
    c = llm.engine.runner.compile_counters
    assert c.rung == "captured graph" and c.runnable_loads == 0 and c.inductor_compilations == 0
    assert "served by the captured graph rung" in caplog.text
    assert _tokens(llm) == cold["tokens"]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_damaged_runnable_loads_through_inductor_and_is_saved_again(cold, tmp_path, monkeypatch, caplog):
    root = _copy(cold, tmp_path, monkeypatch)
    run = next(root.glob("compile/*/*-dynamic.run"))
    run.write_bytes(run.read_bytes()[:-10] + b"0123456789")
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        llm = _engine()
    (warning,) = _warnings(caplog)
    assert str(run) in warning and "sha256" in warning and "saves it again" in warning, warning
    c = llm.engine.runner.compile_counters
    assert c.runnable_loads == 0 and c.cache_loads == cold["counters"].unique_piece_graphs
    assert _tokens(llm) == cold["tokens"]
    runnables.read_runnable(run, *run.stem.rsplit("-", 1))  # rewritten whole
    assert _engine().engine.runner.compile_counters.runnable_loads > 0


def test_kernel_library_that_does_not_match_its_checksum_is_not_loaded_and_is_rewritten(cold, tmp_path,
                                                                                        monkeypatch, caplog):
    """Each damaged library is one warning, and the Inductor path writes it again: before, a
    damaged copy was kept because a file by that name existed, and every start missed the
    fast path."""
    root = _copy(cold, tmp_path, monkeypatch)
    libraries = sorted(root.glob("compile/*/kernels/*.so"))
    for library in libraries:
        library.write_bytes(library.read_bytes() + b"\0")
    monkeypatch.setattr(runnables, "_LOADED_LIBRARIES", {})  # as a fresh process would
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        llm = _engine()
    assert llm.engine.runner.compile_counters.runnable_loads == 0
    assert _tokens(llm) == cold["tokens"]
    warnings = _warnings(caplog)
    assert len(warnings) == len(libraries), warnings
    for library in libraries:
        assert sum(str(library) in w and "sha256" in w for w in warnings) == 1, warnings
        assert library.name == hashlib.sha256(library.read_bytes()).hexdigest() + ".so", "rewritten whole"
    caplog.clear()
    monkeypatch.setattr(runnables, "_LOADED_LIBRARIES", {})
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        again = _engine()
    assert again.engine.runner.compile_counters.runnable_loads > 0 and _warnings(caplog) == []


@pytest.mark.parametrize("content", [b"{not json", b"\xff", b'{"config_key": 3}'], ids=["not-json", "not-utf8",
                                                                                     "wrong-fields"])
def test_a_damaged_warm_index_is_one_warning_and_written_again(cold, tmp_path, monkeypatch, caplog, content):
    root = _copy(cold, tmp_path, monkeypatch)
    index = next(root.glob("warm/*.json"))
    good = json.loads(index.read_text())
    index.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        llm = _engine()
    (warning,) = _warnings(caplog)
    assert str(index) in warning and "damaged" in warning and "writes it again" in warning, warning
    assert llm.engine.runner.compile_counters.runnable_loads == 0 and _tokens(llm) == cold["tokens"]
    assert json.loads(index.read_text()) == good
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        again = _engine()
    assert again.engine.runner.compile_counters.runnable_loads > 0 and _warnings(caplog) == []


def test_a_runnable_failing_on_its_first_call_falls_back_to_inductor(cold, tmp_path, monkeypatch, caplog):
    _copy(cold, tmp_path, monkeypatch)

    def broken(self, *args):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(runnables.Runnable, "__call__", broken)
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        llm = _engine()
    assert "runnables failed" in caplog.text and "simulated kernel failure" in caplog.text
    c = llm.engine.runner.compile_counters
    assert c.runnable_loads == 0 and c.captured_graph == "loaded" and c.cache_loads > 0
    assert c.rung == "captured graph"
    assert _tokens(llm) == cold["tokens"]


def test_no_fast_path_where_the_warm_key_cannot_cover_the_compile():
    config = EngineConfig(model=ModelConfig(model="m"))
    model = torch.nn.Linear(2, 2)
    model.dtype = torch.float32  # what the key reads of vgraph's models
    hf = type("Config", (), {"to_dict": lambda self: {"model_type": "llama"}})()
    cpu = torch.device("cpu")
    assert warm_start.warm_key(config, hf, model, cpu) is not None
    assert warm_start.warm_key(config, hf, model, cpu) == warm_start.warm_key(config, hf, model, cpu)
    for compile_ in (CompileConfig(compile_sizes=[4]), CompileConfig(use_cache=False),
                     CompileConfig(dump_graphs_dir="/tmp/x"), CompileConfig(level="none")):
        other = EngineConfig(model=ModelConfig(model="m"), compile=compile_)
        assert warm_start.warm_key(other, hf, model, cpu) is None, compile_
    off = EngineConfig(model=ModelConfig(model="m"), compile=CompileConfig(enable_fusion=False))
    assert warm_start.warm_key(off, hf, model, cpu) != warm_start.warm_key(config, hf, model, cpu)
    assert warm_start.warm_key(config, hf, model, torch.device("meta")) is None


WRAPPER = '''
import torch
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels
from torch._inductor.utils import maybe_profile
async_compile = AsyncCompile()
async_compile.wait(globals())
del async_compile

def call(args):
    a, b = args
    args.clear()
    return (extern_kernels.mm(a, b), )

def get_args():
    from torch._dynamo.testing import rand_strided
    return [rand_strided((2, 2), (2, 1))]

if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
'''


def test_wrapper_parsing_keeps_only_what_runs_without_inductor():
    tree, why = runnables.parse_wrapper(WRAPPER)
    assert tree is not None and why == ""
    assert runnables.extern_names(tree) == {"mm"}
    run = runnables.build_runnable(WRAPPER, {}, {"mm": "mm"}, "test")
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    assert torch.equal(run(a, b)[0], a @ b)
    uses_hooks = WRAPPER.replace("return (", "maybe_profile(); return (")
    assert runnables.parse_wrapper(uses_hooks) == (None, "it uses maybe_profile (maybe_profile) from Inductor")
    nested = WRAPPER.replace("    a, b = args\n", "    from torch._inductor import config\n    a, b = args\n")
    assert runnables.parse_wrapper(nested)[0] is None


def test_runnable_file_checks(tmp_path):
    parts = runnables.RunnableParts(WRAPPER, {}, {"mm": "mm"})
    runnables.save_runnable(tmp_path, "abc", "dynamic", parts, {}, {"P": 2})
    run, matches = runnables.load_runnable(tmp_path, "abc", "dynamic")
    assert matches == {"P": 2}
    path = runnables.runnable_path(tmp_path, "abc", "dynamic")
    with pytest.raises(ValueError, match="made for"):
        runnables.read_runnable(path, "other", "dynamic")
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])
    with pytest.raises(ValueError, match="truncated"):
        runnables.read_runnable(path, "abc", "dynamic")
    path.write_bytes(whole[:-3] + b"xyz")
    with pytest.raises(ValueError, match="damaged"):
        runnables.read_runnable(path, "abc", "dynamic")
    path.write_bytes(b"something else")
    with pytest.raises(ValueError, match="not a vgraph runnable"):
        runnables.read_runnable(path, "abc", "dynamic")
