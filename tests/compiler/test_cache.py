"""The compile cache: keys, warm loads, corrupt entries, unwritable directories."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from vgraph.compiler import cache as cache_mod
from vgraph.compiler import cache_entries
from vgraph.compiler import cache_key as cache_key_mod
from vgraph.compiler.backend import VgraphBackend
from vgraph.compiler.cache import CompileCache
from vgraph.compiler.compiled_forward import CompiledForward
from vgraph.compiler.build import config_key
from vgraph.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig
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


def _flip_middle(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 8]) + data[middle + 8:]


@pytest.mark.parametrize("damage,why", [(lambda data: data[:100], "truncated"),
                                        (_flip_middle, "does not match its sha256 checksum")],
                         ids=["truncated", "flipped"])
def test_damaged_artifact_is_recompiled_with_one_warning(tmp_path, caplog, damage, why):
    model = Toy(layers=2)
    cold = _run_toy(CompileCache(tmp_path, "k"), model)
    victim = next(cold.cache.folder.glob("*.bin"))
    damaged = damage(victim.read_bytes())
    victim.write_bytes(damaged)
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        again = _run_toy(CompileCache(tmp_path, "k"), model)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert str(victim) in warning and why in warning and "recompiling" in warning, warning
    assert again.counters.inductor_compilations == 1 and again.counters.cache_errors == 1
    assert again.counters.cache_loads == 2
    assert victim.read_bytes() != damaged and cache_mod.unpack_artifact(victim.read_bytes()), "rewritten whole"


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[]"], ids=["not-json", "not-utf8", "list"])
def test_a_damaged_meta_json_is_rewritten_with_one_warning(tmp_path, caplog, content):
    """meta.json is read by every warm start (its last_used) and when an entry is written to;
    garbage there is rewritten, and said once however often it is read."""
    meta = tmp_path / cache_entries.META_FILE
    meta.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        cache_entries.create_meta(tmp_path, {"model": "m"})
        meta.write_bytes(content)  # damaged again under the same name: the same problem, not logged again
        cache_entries.touch_last_used(tmp_path, {"model": "m"})
        cache_entries.touch_last_used(tmp_path, {"model": "m"})
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert str(meta) in warning and "damaged" in warning and "rewritten" in warning, warning
    record = json.loads(meta.read_text())
    assert record["model"] == "m" and isinstance(record["last_used"], float)


def test_a_missing_meta_json_is_written_quietly(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        cache_entries.touch_last_used(tmp_path, {"model": "m"})
    assert caplog.records == [] and cache_entries.read_meta(tmp_path)["model"] == "m"


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
    config = EngineConfig(model=model, compile=compile_config,
                          cache=CacheConfig(kv_cache_dtype=changes.pop("kv_cache_dtype", "auto")))
    return config_key(config, hf, changes.pop("dtype", torch.float32), changes.pop("passes", "p1"),
                      torch.device("cpu"), changes.pop("layout", {"Linear": 4}), **changes)


def test_cache_key_covers_what_changes_the_output(monkeypatch):
    base = _key()
    assert _key() == base, "the key is stable"
    assert _key(hf={"rms_norm_eps": 1e-3}) != base
    assert _key(dtype=torch.bfloat16) != base
    assert _key(quantization="fp8") != base
    assert _key(kv_cache_dtype="fp8") != base, "a graph over a bf16 KV cache never serves an fp8 one"
    assert _key(kv_cache_dtype="fp8_e4m3") == _key(kv_cache_dtype="fp8"), "one setting, two spellings"
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
