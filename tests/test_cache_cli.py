"""Issue 19 from the command line: what an operator sees when the compile cache or the
checkpoint is damaged, when processes share or die on a cache, and ``vgraph cache``.

Real processes, real exit codes. Each ``vgraph generate`` here costs a Python + torch start
and, on a cold cache, a compile, so the scenarios share a few cache dirs where they can, and
run ``--no-fusion``: with no pass manager Inductor's own FX-graph cache (shared by processes)
serves pieces another process already compiled, so only the first compile of a graph is slow.
The killed start keeps the passes on, so that its compile takes long enough to be killed in.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checkpoints import tiny_checkpoint
from vgraph import cli
from vgraph.compiler import cache_entries

GENERATE = ["generate", "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos", "--device", "cpu",
            "--kv-cache-gib", "0.01"]
FAST = [*GENERATE, "--no-fusion"]
WARM = "loaded the compiled model from the cache in"  # through Inductor or as runnables


def _env(root: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VGRAPH_CPU_LINEAR")}
    return {**env, "VGRAPH_CACHE_DIR": str(root), **extra}


def _vgraph_args(*args: str) -> list[str]:
    return [sys.executable, "-m", "vgraph.cli", *args]


def vgraph(*args: str, root: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_vgraph_args(*args), capture_output=True, text=True, timeout=600,
                          env=_env(root, **extra))


def _completion(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stdout


def _model() -> str:
    return tiny_checkpoint(arch="llama")


# --- processes sharing, and dying on, one cache -------------------------------------------------

CONCURRENT = 4


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Four cold starts at once on one empty cache dir, then a fifth, warm start."""
    root = tmp_path_factory.mktemp("shared-cache")
    procs = [subprocess.Popen(_vgraph_args(*FAST, "--model", _model()), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(root)) for _ in range(CONCURRENT)]
    results = [subprocess.CompletedProcess(p.args, p.wait(600), *p.communicate()) for p in procs]
    return {"root": root, "concurrent": results, "later": vgraph(*FAST, "--model", _model(), root=root)}


def test_four_cold_starts_at_once_all_succeed_and_leave_a_valid_cache(shared):
    outputs = [_completion(r) for r in shared["concurrent"]]
    assert len(set(outputs)) == 1 and "[length, 6 tokens]" in outputs[0]
    compiled = [r for r in shared["concurrent"] if WARM not in r.stderr]
    assert len(compiled) == 1, "one process compiled under the lock; the others loaded its result"
    assert all("WARNING" not in r.stderr for r in shared["concurrent"])
    later = shared["later"]
    assert _completion(later) == outputs[0]
    assert WARM in later.stderr and "WARNING" not in later.stderr, "the cache they left loads cleanly"
    (entry,) = cache_entries.list_entries(shared["root"])
    assert entry.artifacts > 0 and entry.meta["model"] == _model()
    assert not [p for p in entry.path.iterdir() if p.name.startswith(cache_entries.TEMP_PREFIX)]


def test_a_corrupt_cached_kernel_is_rebuilt_and_the_warm_cache_still_loads(shared, tmp_path):
    """The issue's corrupt ``linear_cpu-*.so``: it did not load, the projections stayed
    unpacked, and the packed warm entry then failed every start (KeyError '...weight_packed').
    Now it is rebuilt, with a warning, before anything loads it (it does not match its digest
    record), and the packed entry loads warm. (A kernel that cannot
    be built at all leaves plain linears, which compile their own entry: see
    tests/compiler/test_cache_startup.py, where ``VGRAPH_CPU_LINEAR=torch`` does the same.)"""
    root = tmp_path / "cache"
    shutil.copytree(shared["root"], root)
    libraries = list((root / "kernels").glob("linear_cpu-*.so"))
    assert libraries
    for library in libraries:
        library.write_bytes(b"not a shared library")
    rebuilt = vgraph(*FAST, "--model", _model(), root=root)
    assert _completion(rebuilt) == _completion(shared["later"])
    assert "building it again, it is never loaded" in rebuilt.stderr and WARM in rebuilt.stderr
    assert rebuilt.stderr.count("building it again") == len(libraries)
    assert len(cache_entries.list_entries(root)) == 1


def test_a_start_killed_during_its_cold_compile_leaves_a_cache_the_next_start_uses(tmp_path):
    root = tmp_path / "cache"
    proc = subprocess.Popen(_vgraph_args(*GENERATE, "--model", _model()), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=_env(root))
    try:
        deadline = time.monotonic() + 300
        while not list(root.glob("compile/*/*.bin")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the process ended before its first artifact was saved"
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list(root.glob("compile/*/captured-*.pkl")), "killed before its compile finished"
    restart = vgraph(*GENERATE, "--model", _model(), root=root)
    assert "[length, 6 tokens]" in _completion(restart)
    assert list(root.glob("compile/*/captured-*.pkl")), "the restart completed the entry"


# --- unusable cache roots ----------------------------------------------------------------------

def test_a_cache_root_that_is_a_file_serves_the_demo_model(tmp_path):
    """The C++ kernels and the compiled pieces live under the root (the demo model ships in
    the package): each goes to a temporary place with a warning, and generation goes on
    (before: exit 1)."""
    root = tmp_path / "a-file"
    root.write_text("not a directory")
    result = vgraph(*FAST, root=root)
    assert "[length, 6 tokens]" in _completion(result)
    for what in ("cannot write the kernel cache", "is not writable"):
        assert what in result.stderr
    assert result.stderr.count("cannot write the kernel cache") == 1, "one warning for all kernels"


# --- damaged checkpoints -----------------------------------------------------------------------

def _damaged_checkpoint(tmp_path: Path, damage: str) -> Path:
    path = tmp_path / "model"
    shutil.copytree(_model(), path)
    weights = path / "model.safetensors"
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "config not JSON":
        (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    elif damage == "no weights":
        weights.unlink()
    return path


@pytest.mark.parametrize("damage,file", [("truncated weights", "model.safetensors"),
                                         ("config not JSON", "config.json"),
                                         ("no weights", "*.safetensors")])
def test_a_damaged_checkpoint_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, damage, file):
    """In process (``cli.main`` is what the script runs; the serve test below is a real one)."""
    path = _damaged_checkpoint(tmp_path, damage)
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["--log-level", "ERROR", *GENERATE, "--model", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vgraph generate: error:"), lines
    assert file in lines[0]


def test_serve_with_truncated_weights_exits_2_with_one_line(tmp_path):
    path = _damaged_checkpoint(tmp_path, "truncated weights")
    result = vgraph("serve", str(path), "--port", "0", "--host", "127.0.0.1", "--device", "cpu",
                    "--enforce-eager", root=tmp_path / "cache")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [e for e in errors if e.startswith("vgraph serve: error:")] and len(errors) == 1
    assert "model.safetensors" in errors[0] and "Traceback" not in result.stderr


# --- vgraph cache list / clear -----------------------------------------------------------------

DAY = 86400.0


KEY = {"vgraph": "0.1.0", "torch": "2.13.0+cpu", "triton": "3.9.0", "python": "3.11.9", "device": "cpu",
       "machine": "x86_64", "model_type": "llama", "model_config": "3f2a9c1b7d4e", "dtype": "bfloat16",
       "quantization": "fp8", "layout": "9a8b7c6d5e4f", "rank": 0, "world_size": 1,
       "compile": {"splitting_ops": ["vgraph::unified_attention"], "compile_sizes": [8], "custom_ops": None,
                   "enable_fusion": True},
       "pass_uuids": {"RMSNormQuantFusionPass": "0123456789abcdef"}}


def _fake_entry(root: Path, name: str, model: str, last_used: float, artifacts: int = 2) -> None:
    folder = root / "compile" / name
    folder.mkdir(parents=True)
    for i in range(artifacts):
        (folder / f"piece{i}-dynamic.bin").write_bytes(b"x" * 1000)
    meta = {"model": model, "model_path": model, "architecture": "LlamaForCausalLM",
            "dtype": "bfloat16", "quantization": "fp8", "passes": ["RMSNormQuantFusionPass"],
            "linears": "plain", "created": last_used - DAY, "last_used": last_used, "key": KEY}
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def entries(tmp_path, monkeypatch):
    root = tmp_path / "root"
    now = time.time()
    _fake_entry(root, "aaaa1111-g1", "/models/llama", now - 10 * DAY)
    _fake_entry(root, "aaaa2222-g2", "/models/llama", now - 60)
    _fake_entry(root, "bbbb3333-g3", "/models/qwen", now - 3 * DAY, artifacts=1)
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(root))
    return root


def _cache(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["cache", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def _left(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "compile").iterdir())


def test_cache_list_shows_what_each_entry_was_made_for(entries, capsys):
    code, out = _cache(capsys, "list")
    assert code == 0 and "(3 entries)" in out
    for text in ("aaaa1111-g1", "/models/llama (LlamaForCausalLM)", "dtype:        bfloat16",
                 "quantization: fp8", "RMSNormQuantFusionPass", "artifacts:    2", "(10d ago)",
                 "(1m ago)", "last used:"):
        assert text in out, text
    code, out = _cache(capsys, "list", "--model", "/models/qwen")
    assert "(1 entries)" in out and "bbbb3333-g3" in out


def test_cache_ls_shows_the_key_fields_size_age_and_last_use(entries, capsys):
    code, out = _cache(capsys, "ls", "bbbb")
    assert code == 0 and "(1 entries)" in out
    for text in ("RMSNormQuantFusionPass (uuid 0123456789abcdef)",
                 "key:          vgraph 0.1.0, torch 2.13.0+cpu, triton 3.9.0, python 3.11.9, cpu x86_64, rank 0 of 1",
                 "model config: llama 3f2a9c1b7d4e, layout 9a8b7c6d5e4f",
                 "compile:      sizes [8], custom ops None, fusion True, split at vgraph::unified_attention",
                 "artifacts:    1 (", "KiB in all)", "created:", "(4d ago)", "last used:", "(3d ago)"):
        assert text in out, text


def _sizes(root: Path) -> dict[str, int]:
    return {e.name: e.bytes for e in cache_entries.list_entries(root)}


def test_cache_prune_by_size_removes_the_least_recently_used_first(entries, capsys):
    sizes = _sizes(entries)
    budget = sizes["aaaa2222-g2"] + sizes["bbbb3333-g3"]
    code, out = _cache(capsys, "prune", "--max-size", str(budget))
    assert code == 0 and "removed 1 compile cache entries" in out and "2 left" in out
    assert _left(entries) == ["aaaa2222-g2", "bbbb3333-g3"], "the entry unused for 10 days went first"
    assert "removed 0" in _cache(capsys, "prune", "--max-size", str(budget))[1], "already within the budget"
    assert "removed 1" in _cache(capsys, "prune", "--max-size", f"{budget / 1024 - 0.1}K")[1]
    assert _left(entries) == ["aaaa2222-g2"]


def test_cache_prune_by_age_keeps_an_entry_being_compiled_and_cleans_strays(entries, capsys):
    from vgraph.compiler.cache_lock import compile_lock, lock_path
    base = entries / "compile"
    stray = base / "aaaa2222-g2" / f"{cache_entries.TEMP_PREFIX}dead-writer.bin"
    stray.write_bytes(b"half")
    os.utime(stray, (time.time() - 2 * 3600,) * 2)
    fresh = base / "aaaa2222-g2" / f"{cache_entries.TEMP_PREFIX}live-writer.bin"
    fresh.write_bytes(b"half")
    (base / "cccc.lock").touch()  # the lock of a key whose entries are gone: nobody holds it
    with compile_lock(lock_path(entries, "aaaa1111")):
        code, out = _cache(capsys, "prune", "--older-than", "2d")
    assert code == 0 and "removed 1" in out and "kept aaaa1111-g1: a process is compiling into it now" in out
    assert _left(entries) == ["aaaa1111-g1", "aaaa1111.lock", "aaaa2222-g2"]
    assert not stray.exists() and fresh.exists(), "only temporary files of dead writers go"


@pytest.mark.parametrize("args,message", [
    ((), "prune needs --older-than AGE and/or --max-size SIZE"),
    (("--max-size", "lots"), "expected a number and an optional unit"),
    (("aaaa", "--max-size", "1G"), "to remove chosen entries use `vgraph cache clear`"),
])
def test_cache_prune_errors_are_one_line_and_remove_nothing(entries, capsys, args, message):
    code, out = _cache(capsys, "prune", *args)
    assert code == 2 and message in out
    assert len(_left(entries)) == 3


def test_cache_clear_by_entry_prefix(entries, capsys):
    assert _cache(capsys, "clear", "bbbb")[0] == 0
    assert _left(entries) == ["aaaa1111-g1", "aaaa2222-g2"]
    code, out = _cache(capsys, "clear", "aaaa")
    assert code == 2 and "matches 2 compile cache entries" in out, "an ambiguous prefix removes nothing"
    code, out = _cache(capsys, "clear", "zzzz")
    assert code == 2 and "no compile cache entry named 'zzzz'" in out
    assert _cache(capsys, "clear", "aaaa2222-g2")[0] == 0
    assert _left(entries) == ["aaaa1111-g1"]


def test_cache_clear_by_model_and_age(entries, capsys):
    code, out = _cache(capsys, "clear", "--model", "/models/llama", "--older-than", "7d")
    assert code == 0 and "removed 1" in out
    assert _left(entries) == ["aaaa2222-g2", "bbbb3333-g3"]
    assert "removed 1" in _cache(capsys, "clear", "--older-than", "2d")[1]
    assert _left(entries) == ["aaaa2222-g2"]
    assert "removed 1" in _cache(capsys, "clear", "--model", "/models/llama")[1]
    assert _left(entries) == []


def test_cache_clear_without_a_selector_removes_everything(entries, capsys):
    code, out = _cache(capsys, "clear")
    assert code == 0 and "removed 3" in out and not (entries / "compile").exists()


def test_a_bad_age_is_a_one_line_error(entries, capsys):
    code, out = _cache(capsys, "clear", "--older-than", "soon")
    assert code == 2 and "expected a number and a unit" in out
    assert len(_left(entries)) == 3


def test_entries_made_for_a_hub_model_match_its_id():
    entry = cache_entries.CacheEntry("k-g", Path("/x"), 0, 0, {
        "model": "/hf/hub/models--Qwen--Qwen2.5-0.5B/snapshots/abc", "model_path": None})
    assert entry.made_for("Qwen/Qwen2.5-0.5B") and not entry.made_for("Qwen/Qwen2.5-1.5B")
    assert cache_entries.parse_duration("90m") == 5400 and cache_entries.parse_duration("1.5h") == 5400
