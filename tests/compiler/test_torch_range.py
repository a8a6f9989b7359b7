"""Torch-version safety of the warm path (vgraph/compiler/torch_range.py): whatever reads
Inductor's internals declines, with one line in the log, on a torch outside the range it was
checked on, and the ladder's next rung serves instead."""
from __future__ import annotations

import logging

import pytest
import torch

from vgraph.compiler import torch_range, warm_load
from vgraph.compiler.cache import CompileCache
from vgraph.compiler.cache_writer import CacheWriter
from vgraph.compiler.counters import CompileCounters
from vgraph.compiler.loaders import RunnablesLoader
from vgraph.config import EngineConfig, ModelConfig

OUTSIDE = ["2.10.1", "2.14.0", "3.0.0a0+git1234", "nightly"]


@pytest.fixture(params=OUTSIDE)
def outside(request, monkeypatch):
    monkeypatch.setattr(torch_range, "running_torch", lambda: request.param)
    return request.param


def test_the_range_covers_its_releases_only():
    r = torch_range.TorchRange(oldest=(2, 11), newest=(2, 13))
    assert all(r.covers(torch_range.release(v)) for v in ("2.11.0", "2.12.1", "2.13.0+cpu", "2.13.0a0+gitabc"))
    assert not any(r.covers(torch_range.release(v)) for v in ("2.10.9", "2.14.0", "1.13.1", "nightly"))
    assert torch_range.release(str(torch.__version__)) is not None


def test_this_torch_is_in_range():
    """If this fails, tests/compiler passed on a new torch: widen INDUCTOR_INTERNALS."""
    assert torch_range.unsupported_torch("runnables") is None


def test_outside_the_range_the_reason_names_both(outside):
    why = torch_range.unsupported_torch("runnables")
    assert why is not None and outside in why and "2.11 to 2.13" in why


def test_the_runnables_rung_declines(outside):
    config = EngineConfig(model=ModelConfig(model="m"))
    loader = RunnablesLoader(torch.nn.Linear(2, 2), config, None, torch.device("cpu"), CompileCounters())
    assert loader.load(torch.zeros(4, dtype=torch.long), torch.arange(4)) is None
    assert outside in loader.reason and "runnables" in loader.reason


def test_no_runnables_are_saved(outside, tmp_path, caplog):
    cache = CompileCache(tmp_path, "k", warm_key="w")
    cache.bind_graph("g")
    writer = CacheWriter(cache, CompileCounters(), use_cache=True)
    with caplog.at_level(logging.INFO, logger="vgraph"):
        assert writer.runnables(torch.nn.Linear(2, 2), {}, {}, lambda f: f(), torch.zeros(1)) is None
    (line,) = [r.getMessage() for r in caplog.records if "no runnables" in r.getMessage()]
    assert outside in line


def test_the_vector_isa_shortcut_is_not_taken(outside, caplog):
    with caplog.at_level(logging.INFO, logger="vgraph"):
        assert warm_load._vec_isa_module() is None
        assert warm_load.WarmLoadSettings(None).patches() == {}
    assert sum("vector-ISA shortcut" in r.getMessage() for r in caplog.records) == 2, "one line per look"
