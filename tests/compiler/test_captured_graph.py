"""Warm starts without Dynamo: the captured graph saved by a cold start, loaded by the next one.

The promise is that a warm start runs the same code as a cold one (same tokens) without
tracing, and that anything wrong with the record (edited model code, a corrupt file, a missing
artifact) means tracing again, never a wrong or crashed engine.
"""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from tests.compiler.tiny_engine import cold_start
from tests.compiler.tiny_engine import engine as _engine
from tests.compiler.tiny_engine import tokens as _tokens
from vgraph.compiler import captured_graph as captured


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A cold start into its own cache: its counters, tokens and the filled cache dir."""
    llm, root = cold_start(tmp_path_factory, "captured-cold")
    return {"counters": llm.engine.runner.compile_counters, "tokens": _tokens(llm), "root": root}


def _warm_from_copy(cold, tmp_path, monkeypatch):
    """A cache dir copied from the cold one (each test may damage its own copy), without the
    fast path's index: these tests are about loading through Inductor (see test_runnable.py)."""
    root = tmp_path / "cache"
    shutil.copytree(cold["root"], root)
    shutil.rmtree(root / "warm", ignore_errors=True)
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(root))
    return root


def test_cold_start_traces_once_and_saves_the_captured_graph(cold):
    c = cold["counters"]
    assert c.captured_graph == "saved" and c.graphs_seen == 1 and c.inductor_compilations > 0
    assert len(list(cold["root"].glob("compile/*/captured-*.pkl"))) == 1


def test_warm_start_runs_no_dynamo_and_gives_the_same_tokens(cold, tmp_path, monkeypatch):
    _warm_from_copy(cold, tmp_path, monkeypatch)
    llm = _engine()
    c = llm.engine.runner.compile_counters
    assert c.captured_graph == "loaded"
    assert c.graphs_seen == 0 and c.dynamo_seconds == 0.0 and c.inductor_compilations == 0
    assert c.pieces == cold["counters"].pieces and c.compiled_pieces == cold["counters"].compiled_pieces
    assert c.cache_loads == cold["counters"].unique_piece_graphs
    assert _tokens(llm) == cold["tokens"]


def test_edited_model_code_traces_again(cold, tmp_path, monkeypatch):
    root = _warm_from_copy(cold, tmp_path, monkeypatch)
    monkeypatch.setattr(captured, "source_fingerprint", lambda model: "edited-source")
    llm = _engine()
    c = llm.engine.runner.compile_counters
    assert c.graphs_seen == 1 and c.captured_graph == "saved"
    assert c.inductor_compilations == 0, "the pieces themselves are unchanged: loaded, not compiled"
    assert len(list(root.glob("compile/*/captured-*.pkl"))) == 2
    assert _tokens(llm) == cold["tokens"]


def test_corrupt_record_means_tracing_again_with_a_warning(cold, tmp_path, monkeypatch, caplog):
    root = _warm_from_copy(cold, tmp_path, monkeypatch)
    record = next(root.glob("compile/*/captured-*.pkl"))
    record.write_bytes(record.read_bytes()[:50])
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        llm = _engine()
    assert "captured graph" in caplog.text and "unreadable" in caplog.text
    assert llm.engine.runner.compile_counters.graphs_seen == 1
    assert _tokens(llm) == cold["tokens"]


def test_missing_artifact_means_tracing_and_compiling_it(cold, tmp_path, monkeypatch):
    root = _warm_from_copy(cold, tmp_path, monkeypatch)
    next(root.glob("compile/*/*-dynamic.bin")).unlink()
    llm = _engine()
    c = llm.engine.runner.compile_counters
    assert c.graphs_seen == 1 and c.inductor_compilations == 1
    assert _tokens(llm) == cold["tokens"]


def test_an_input_that_is_neither_state_nor_argument_is_not_bound():
    model = torch.nn.Linear(2, 2)
    ids, pos = torch.arange(3), torch.arange(3)
    inputs = {"input_ids": ids, "positions": pos}
    bound = captured.bind_inputs([model.weight, ids, pos, 3], model, inputs, None)
    assert [s.kind for s in bound] == ["state", "input_ids", "positions", "num_tokens"]
    assert bound[0].name == "weight"
    assert captured.bind_inputs([torch.zeros(2)], model, inputs, None) is None
    assert captured.bind_inputs([4], model, inputs, None) is None, "an int that is not the token count"
