"""Issue 19: the compile cache never prevents a start.

A warm entry that does not fit the model as built now (packed vs plain linears, artifact files
swapped between pieces or entries, a record from another entry), a cached entry that fails
while loading or on its first call, and a cache root that cannot be written all start and
generate the same greedy tokens, with a warning, never a crash.

Cold compiles are what cost here: one packed and one plain compile are shared by the module
(fixtures ``packed`` and ``both``); every other test damages its own copy of their cache.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import pytest

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.compiler import captured_graph as captured
from vgraph.compiler.cache import ArtifactTag, CompileCache, unpack_artifact
from vgraph.compiler.captured_graph import STATE, InputSource
from vgraph.config import ModelConfig
from vgraph.models.linear import PackedLinear
from vgraph.models.loader import load_model
from vgraph.ops.linear import ENV_SWITCH

PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 75))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engine(model: Optional[str] = None, **kwargs) -> LLM:
    return LLM(model or tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=64,
               max_num_batched_tokens=64, max_num_seqs=4, **kwargs)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _packed(llm: LLM) -> bool:
    return any(isinstance(m, PackedLinear) for m in llm.engine.runner.model.modules())


def _start(root: Path, plain_linears: bool = False, **kwargs) -> dict:
    """An engine on the cache ``root``: its counters, tokens and whether it packed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VGRAPH_CACHE_DIR", str(root))
        if plain_linears:
            mp.setenv(ENV_SWITCH, "torch")
        else:
            mp.delenv(ENV_SWITCH, raising=False)
        llm = _engine(**kwargs)
        return {"counters": llm.engine.runner.compile_counters, "tokens": _tokens(llm),
                "packed": _packed(llm), "folder": llm.engine.runner.compile_cache.folder}


def _copy(root: Path, tmp_path: Path) -> Path:
    """A copy of a cache without the warm start's fast-path index: these tests are about
    entries loaded through Inductor (test_runnable.py covers the fast path)."""
    copy = tmp_path / "cache"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "warm", ignore_errors=True)
    return copy


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "compile").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A cold start with packed linears (the CPU float32 default) into its own cache."""
    root = tmp_path_factory.mktemp("packed-cache")
    return {"root": root, **_start(root)}


@pytest.fixture(scope="module")
def both(packed, tmp_path_factory):
    """The packed cache, then a start with ``VGRAPH_CPU_LINEAR=torch`` on a copy of it: the
    issue's first report (before: KeyError '...qkv_proj.weight_packed' on every start)."""
    root = _copy(packed["root"], tmp_path_factory.mktemp("both"))
    return {"root": root, **_start(root, plain_linears=True)}


def test_the_packed_cold_start_records_what_its_entry_was_made_for(packed):
    assert packed["packed"] and packed["counters"].captured_graph == "saved"
    (entry,) = _entries(packed["root"])
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["model"] == meta["model_path"] == tiny_checkpoint(arch="llama")
    assert meta["architecture"] == "LlamaForCausalLM" and meta["dtype"] == "float32"
    assert meta["quantization"] is None and meta["linears"] == "packed"
    assert "SiluMulFusionPass" in meta["passes"]
    assert meta["created"] == meta["last_used"]
    for artifact in entry.glob("*.bin"):
        tag, _ = unpack_artifact(artifact.read_bytes())
        piece, size = artifact.stem.rsplit("-", 1)
        assert tag == ArtifactTag(entry.name.split("-")[0], piece, size)


def test_plain_linears_on_a_packed_cache_compile_their_own_entry(packed, both):
    assert not both["packed"]
    assert both["counters"].captured_graph == "saved" and both["counters"].graphs_seen == 1
    assert both["tokens"] == packed["tokens"]
    entries = _entries(both["root"])
    assert len(entries) == 2, "packed and plain linears are two configurations"
    linears = {json.loads((e / "meta.json").read_text())["linears"] for e in entries}
    assert linears == {"packed", "plain"}


def test_packed_linears_on_a_cache_last_written_plain_load_their_own_entry(packed, both, tmp_path):
    """The reverse: the newest record is the plain one; a packed start must not take it."""
    root = _copy(both["root"], tmp_path)
    entry = root / "compile" / packed["folder"].name
    before = json.loads((entry / "meta.json").read_text())["last_used"]
    warm = _start(root)
    assert warm["packed"] and warm["counters"].captured_graph == "loaded"
    assert warm["counters"].inductor_compilations == 0 and warm["counters"].graphs_seen == 0
    assert warm["tokens"] == packed["tokens"]
    assert json.loads((entry / "meta.json").read_text())["last_used"] > before, "a warm load is a use"


def test_swapped_artifacts_are_recompiled_with_a_warning(packed, tmp_path, caplog):
    root = _copy(packed["root"], tmp_path)
    (entry,) = _entries(root)
    first, second = sorted(entry.glob("*-dynamic.bin"))[:2]
    first_bytes = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(first_bytes)
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        again = _start(root)
    assert again["tokens"] == packed["tokens"]
    assert "compiled for another piece" in caplog.text
    assert again["counters"].inductor_compilations == 2 and again["counters"].cache_errors >= 2
    for artifact in (first, second):
        assert unpack_artifact(artifact.read_bytes())[0].piece_hash == artifact.stem.rsplit("-", 1)[0], \
            "rewritten under the right name"


class _FakeArtifact:
    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def save(self, path: str, format: str) -> None:
        Path(path).write_bytes(self.payload)


def test_an_artifact_under_another_name_or_entry_is_not_loaded(tmp_path, caplog):
    cache = CompileCache(tmp_path, "key1", {"model": "m"})
    cache.bind_graph("g")
    assert cache.save(_FakeArtifact(b"inductor bytes"), "piece1", "dynamic")
    shutil.copy(cache.folder / "piece1-dynamic.bin", cache.folder / "piece2-dynamic.bin")
    other = CompileCache(tmp_path, "key2")
    other.bind_graph("g")
    other.folder = cache.folder  # a file copied into another entry's folder
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        assert cache.load("piece2", "dynamic") is None
        assert other.load("piece1", "dynamic") is None
    assert "piece_hash 'piece1' instead of 'piece2'" in caplog.text
    assert "config_key 'key1' instead of 'key2'" in caplog.text
    assert cache.take_errors() == 1 and other.take_errors() == 1
    assert json.loads((cache.folder / "meta.json").read_text())["model"] == "m"


def test_a_record_for_other_model_state_or_another_entry_does_not_fit(tmp_path, monkeypatch):
    path = tiny_checkpoint(arch="llama")
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    packed_model, _, _ = load_model(ModelConfig(path), "cpu")
    monkeypatch.setenv(ENV_SWITCH, "torch")
    plain_model, _, _ = load_model(ModelConfig(path), "cpu")
    name = "model.layers.0.self_attn.qkv_proj.weight_packed"
    sources = [InputSource(STATE, name), InputSource("input_ids")]
    record = {"config_key": "k", "graph_hash": "g", "sources": sources,
              "state": captured.state_signature(packed_model, sources)}
    folder = tmp_path / "k-g"
    assert captured.record_problem(record, packed_model, folder, "k") is None
    assert "has no 'model.layers.0.self_attn.qkv_proj.weight_packed'" in \
        captured.record_problem(record, plain_model, folder, "k")
    assert "recorded for entry k-g, not k-other" in captured.record_problem(record, packed_model,
                                                                            tmp_path / "k-other", "k")
    record["state"][name][1] = "torch.bfloat16"
    assert "the record has" in captured.record_problem(record, packed_model, folder, "k")


def test_a_warm_entry_that_fails_on_its_first_call_is_compiled_again(packed, tmp_path, monkeypatch, caplog):
    root = _copy(packed["root"], tmp_path)
    real_call = captured.DirectForward.__call__
    calls = {"n": 0}

    def fail_first_call(self, input_ids, positions):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure of a loaded entry")
        return real_call(self, input_ids, positions)

    monkeypatch.setattr(captured.DirectForward, "__call__", fail_first_call)
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        again = _start(root)
    assert "injected failure of a loaded entry" in caplog.text and "compiling the model again" in caplog.text
    c = again["counters"]
    assert c.captured_graph == "saved" and c.cache_loads == c.unique_piece_graphs, "only the warm try read disk"
    assert c.inductor_compilations == c.unique_piece_graphs, "every piece compiled without the cache"
    assert again["tokens"] == packed["tokens"]


def test_a_loaded_artifact_that_fails_while_tracing_means_tracing_again_without_the_cache(
        packed, tmp_path, monkeypatch, caplog):
    """The traced path too: Dynamo's frame is built anew (a fresh backend wrapper) when an
    artifact read from the cache raises on the first call."""
    root = _copy(packed["root"], tmp_path)
    monkeypatch.setattr(captured, "source_fingerprint", lambda model: "edited-source")  # no warm record
    real_load = CompileCache.load

    def broken_load(self, piece_hash, size):
        loaded = real_load(self, piece_hash, size)
        if loaded is None:
            return None

        def fail(*args):
            raise RuntimeError("injected failure of a cached artifact")
        return fail

    monkeypatch.setattr(CompileCache, "load", broken_load)
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        again = _start(root)
    assert "injected failure of a cached artifact" in caplog.text
    assert again["counters"].graphs_seen == 2 and again["counters"].captured_graph == "saved"
    assert again["tokens"] == packed["tokens"]


def _file_root(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return blocker


def _under_file_root(tmp_path: Path) -> Path:
    return _file_root(tmp_path) / "cache"


def _read_only_root(tmp_path: Path) -> Path:
    root = tmp_path / "read-only"
    root.mkdir()
    root.chmod(0o500)
    if os.access(root, os.W_OK):
        pytest.skip("chmod does not make the directory read-only here (running as root)")
    return root


@pytest.mark.parametrize("make_root", [_file_root, _under_file_root, _read_only_root])
def test_an_unusable_cache_root_compiles_in_memory_with_one_warning(packed, tmp_path, make_root, caplog):
    root = make_root(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="vgraph"):
            run = _start(root)
    finally:
        if root.is_dir():
            root.chmod(0o700)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "not writable" in warnings[0], warnings
    assert run["counters"].cache_saves == 0 and run["tokens"] == packed["tokens"]


# --- issue 18: damaged entries, checkpoints elsewhere, graph dumps ------------------------------

def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


def _damage(entry: Path, how: str) -> int:
    """Damages the entry; returns how many artifacts must be compiled again."""
    artifact = sorted(entry.glob("*-dynamic.bin"))[0]
    if how == "truncate an artifact":
        artifact.write_bytes(artifact.read_bytes()[: artifact.stat().st_size // 2])
        return 1
    if how == "flip bytes in an artifact":
        _flip_middle(artifact)
        return 1
    if how == "flip bytes in the captured record":
        _flip_middle(next(entry.glob("captured-*.pkl")))
        return 0
    files = sorted(p for p in entry.iterdir() if p.is_file())
    for victim in files[::2]:
        victim.unlink()
    return sum(1 for p in files[::2] if p.suffix == ".bin")


@pytest.mark.parametrize("how", ["truncate an artifact", "flip bytes in an artifact",
                                 "flip bytes in the captured record", "delete half the files"])
def test_a_damaged_entry_is_detected_removed_and_recompiled_never_loaded(packed, tmp_path, caplog, how):
    root = _copy(packed["root"], tmp_path)
    (entry,) = _entries(root)
    recompile = _damage(entry, how)
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        repaired = _start(root)
    c = repaired["counters"]
    assert repaired["tokens"] == packed["tokens"]
    assert c.inductor_compilations == recompile, "only what was damaged or missing is compiled"
    assert c.cache_loads == c.unique_piece_graphs - recompile, "the damaged artifact was not loaded"
    assert c.pass_matches == packed["counters"].pass_matches != {}, "match counts survive any loss"
    if how != "delete half the files":
        (warning,) = _warnings(caplog)
        assert "removed" in warning and ("checksum" in warning or "truncated" in warning), warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        warm = _start(root)
    assert warm["counters"].captured_graph == "loaded" and warm["counters"].inductor_compilations == 0
    assert warm["counters"].pass_matches == packed["counters"].pass_matches
    assert _warnings(caplog) == [], "the repaired entry loads cleanly"


def test_the_same_checkpoint_at_another_path_loads_warm(packed, tmp_path):
    """The key is the checkpoint's content (config, dtype, ...), not where it lies."""
    root = _copy(packed["root"], tmp_path)
    moved = shutil.copytree(tiny_checkpoint(arch="llama"), tmp_path / "elsewhere" / "renamed-model")
    warm = _start(root, model=str(moved))
    assert warm["counters"].captured_graph == "loaded" and warm["counters"].inductor_compilations == 0
    assert warm["tokens"] == packed["tokens"] and len(_entries(root)) == 1


def test_dumping_graphs_on_a_warm_cache_compiles_and_dumps_every_piece(packed, tmp_path, caplog):
    """Before: a warm start loaded every piece and dumped nothing, silently."""
    root = _copy(packed["root"], tmp_path)
    dumps = tmp_path / "dumps"
    with caplog.at_level(logging.INFO, logger="vgraph"):
        run = _start(root, dump_graphs_dir=str(dumps))
    c = run["counters"]
    assert "without reading the compile cache" in caplog.text
    assert c.captured_graph != "loaded" and c.cache_loads == 0
    assert c.inductor_compilations == c.unique_piece_graphs
    names = sorted(p.name for p in dumps.iterdir())
    pieces = {n.split("_piece-")[1].split("_")[0] for n in names}
    assert len(pieces) == c.unique_piece_graphs, names
    assert all("_size-dynamic_" in n for n in names), "each name carries the piece and the compile size"
    assert run["tokens"] == packed["tokens"]
