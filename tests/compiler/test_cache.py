"""The compile cache: keys, warm loads, corrupt entries, unwritable directories."""
from __future__ import annotations

import logging

import torch

from tests.checkpoints import tiny_checkpoint
from vgraph.compiler import cache as cache_mod
from vgraph.compiler import cache_key as cache_key_mod
from vgraph.compiler.backend import VgraphBackend
from vgraph.compiler.cache import CompileCache
from vgraph.compiler.compiled_forward import CompiledForward
from vgraph.compiler.build import config_key
from vgraph.config import CompileConfig, EngineConfig, ModelConfig
from vgraph.models.checkpoint_record import ModelConfigView
from vgraph.models.loader import load_hf_config

from .test_split_and_counts import Toy

SPLIT = ["vgraph_test::counting_attention"]


def _run_toy(cache: CompileCache, model: Toy) -> VgraphBackend:
    torch._dynamo.reset()
    backend = VgraphBackend(CompileConfig(splitting_ops=SPLIT), None, cache)
    with torch.inference_mode():
        out = CompiledForward(model, backend)(torch.arange(5), torch.arange(5))
        torch.testing.assert_close(out, model(torch.arange(5), torch.arange(5)))
    return backend


def test_second_run_loads_instead_of_compiling(tmp_path):
    model = Toy(layers=2)
    cold = _run_toy(CompileCache(tmp_path, "k"), model)
    warm = _run_toy(CompileCache(tmp_path, "k"), model)
    assert cold.counters.inductor_compilations == 3 and cold.counters.cache_saves == 3
    assert warm.counters.inductor_compilations == 0 and warm.counters.cache_loads == 3


def test_truncated_artifact_is_recompiled_with_a_warning(tmp_path, caplog):
    model = Toy(layers=2)
    cold = _run_toy(CompileCache(tmp_path, "k"), model)
    victim = next(cold.cache.folder.glob("*.bin"))
    victim.write_bytes(victim.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        again = _run_toy(CompileCache(tmp_path, "k"), model)
    assert "unreadable" in caplog.text
    assert again.counters.inductor_compilations == 1 and again.counters.cache_errors == 1
    assert again.counters.cache_loads == 2
    assert victim.stat().st_size > 100, "the entry was rewritten"


def test_unwritable_cache_dir_still_serves(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        backend = _run_toy(CompileCache(blocker / "cache", "k"), Toy(layers=2))
    assert "not writable" in caplog.text
    assert backend.counters.inductor_compilations == 3 and backend.counters.cache_saves == 0


def _key(**changes) -> str:
    path = tiny_checkpoint(arch="llama")
    hf = ModelConfigView({**load_hf_config(path).to_dict(), **changes.pop("hf", {})})
    model = ModelConfig(model=path, quantization=changes.pop("quantization", None))
    compile_config = CompileConfig(**changes.pop("compile", {}))
    config = EngineConfig(model=model, compile=compile_config)
    return config_key(config, hf, changes.pop("dtype", torch.float32), changes.pop("passes", "p1"),
                      torch.device("cpu"), changes.pop("layout", {"Linear": 4}), **changes)


def test_cache_key_covers_what_changes_the_output(monkeypatch):
    base = _key()
    assert _key() == base, "the key is stable"
    assert _key(hf={"rms_norm_eps": 1e-3}) != base
    assert _key(dtype=torch.bfloat16) != base
    assert _key(quantization="fp8") != base
    assert _key(passes="p2") != base
    assert _key(compile={"custom_ops": False}) != base
    assert _key(compile={"compile_sizes": [8]}) != base
    assert _key(layout={"PackedLinear": 4}) != base, "packed and plain linears trace different graphs"
    assert _key(rank=1, world_size=2) != base, "each tensor-parallel rank compiles its own shard"
    assert _key(hf={"_name_or_path": "/elsewhere/llama", "_commit_hash": "abc"}) == base, \
        "where the checkpoint was loaded from is no part of the key"
    real = cache_mod.environment_fingerprint
    monkeypatch.setattr(cache_key_mod, "environment_fingerprint",
                        lambda device: {**real(device), "torch": "9.9.9"})
    assert _key() != base, "a torch upgrade invalidates the cache"
