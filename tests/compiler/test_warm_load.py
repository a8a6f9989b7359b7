"""The warm load's Inductor shortcut (vgraph/compiler/warm_load.py): the vector-ISA probes'
answer is recorded and trusted only when everything it depends on is unchanged and every
candidate passed; and with the real torch, the shortcut picks the same instruction set (and
so the same compiled libraries) as the probes."""
from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from vgraph.compiler import warm_load
from vgraph.compiler.warm_load import VEC_ISA_FILE, WarmLoadSettings

COMPILER = {"path": "/usr/bin/g++-12", "size": 100, "mtime_ns": 1}


class _Isa:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


def _fake_inductor(passed: list[str], flags=("avx2", "avx512", "avx512_vnni")) -> SimpleNamespace:
    """Inductor's cpu_vec_isa as warm_load uses it; ``passed``: what its probes accept."""
    candidates = [_Isa("amx_tile"), _Isa("avx512 avx512_vnni"), _Isa("avx512"), _Isa("avx2")]
    probes = []

    @functools.cache
    def valid_vec_isa_list():
        probes.append(1)
        return [c for c in candidates if str(c) in passed]

    return SimpleNamespace(valid_vec_isa_list=valid_vec_isa_list, supported_vec_isa_list=candidates,
                           x86_isa_checker=lambda: list(flags), probes=probes)


@pytest.fixture
def isa(monkeypatch):
    """A fake Inductor whose three candidates all pass, on an x86 Linux with a known compiler."""
    fake = _fake_inductor(["avx512 avx512_vnni", "avx512", "avx2"])
    monkeypatch.setattr(warm_load, "_vec_isa_module", lambda: fake)
    monkeypatch.setattr(warm_load, "_compiler_identity", lambda: dict(COMPILER))
    monkeypatch.setattr(warm_load.sys, "platform", "linux")
    monkeypatch.setattr(warm_load.platform, "machine", lambda: "x86_64")
    return fake


def _probe_then_remember(root) -> None:
    """A process whose load ran the probes, then recorded them."""
    settings = WarmLoadSettings(root)
    assert settings.patches() == {}, "nothing recorded yet: the probes run"
    warm_load._vec_isa_module().valid_vec_isa_list()
    settings.remember()


def test_a_recorded_answer_skips_the_probes_in_the_next_process(isa, tmp_path):
    _probe_then_remember(tmp_path)
    record = json.loads((tmp_path / VEC_ISA_FILE).read_text())
    assert record["valid"] == ["avx512 avx512_vnni", "avx512", "avx2"]
    assert record["fingerprint"]["candidates"] == record["valid"], "amx_tile is not in the CPU flags"
    isa.valid_vec_isa_list.cache_clear()  # the next process
    assert WarmLoadSettings(tmp_path).patches() == {"cpp.vec_isa_ok": True}


def test_a_process_that_has_its_answer_patches_nothing(isa, tmp_path):
    _probe_then_remember(tmp_path)
    assert WarmLoadSettings(tmp_path).patches() == {}, "the list is computed already in this process"


@pytest.mark.parametrize("change", ["compiler", "cpu", "torch"])
def test_a_changed_fingerprint_means_probing_again(isa, tmp_path, monkeypatch, change):
    _probe_then_remember(tmp_path)
    isa.valid_vec_isa_list.cache_clear()
    if change == "compiler":
        monkeypatch.setattr(warm_load, "_compiler_identity", lambda: {**COMPILER, "mtime_ns": 2})
    elif change == "cpu":
        monkeypatch.setattr(isa, "x86_isa_checker", lambda: ["avx2"])
    else:
        monkeypatch.setattr(warm_load.torch, "__version__", "0.0.0")
    assert WarmLoadSettings(tmp_path).patches() == {}


def test_a_failed_candidate_is_never_skipped(monkeypatch, tmp_path):
    """Where the compiler rejects AVX-512 VNNI, vec_isa_ok=True would pick it anyway: no shortcut."""
    fake = _fake_inductor(["avx512", "avx2"])
    monkeypatch.setattr(warm_load, "_vec_isa_module", lambda: fake)
    monkeypatch.setattr(warm_load, "_compiler_identity", lambda: dict(COMPILER))
    monkeypatch.setattr(warm_load.sys, "platform", "linux")
    monkeypatch.setattr(warm_load.platform, "machine", lambda: "x86_64")
    _probe_then_remember(tmp_path)
    assert json.loads((tmp_path / VEC_ISA_FILE).read_text())["valid"] == ["avx512", "avx2"]
    fake.valid_vec_isa_list.cache_clear()
    assert WarmLoadSettings(tmp_path).patches() == {}


@pytest.mark.parametrize("content,damaged", [("", True), ("{not json", True), ("\udcff", True),
                                             ("[1, 2]", True), ('{"fingerprint": null}', False)],
                         ids=["empty", "not-json", "not-utf8", "list", "stale"])
def test_an_unreadable_record_means_probing_again(isa, tmp_path, content, damaged, caplog):
    """Garbage (not a JSON object) is repaired with one warning naming the file, though it is
    read twice; a readable record that no longer fits (stale) is replaced quietly."""
    (tmp_path / VEC_ISA_FILE).write_bytes(content.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        settings = WarmLoadSettings(tmp_path)
        assert settings.patches() == {}
        isa.valid_vec_isa_list()
        settings.remember()
    assert json.loads((tmp_path / VEC_ISA_FILE).read_text())["valid"], "the record is written anew"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if damaged:
        (warning,) = warnings
        assert str(tmp_path / VEC_ISA_FILE) in warning and "damaged" in warning and "rewritten" in warning
    else:
        assert warnings == []


def test_no_record_without_a_cache_or_on_another_machine(isa, tmp_path, monkeypatch):
    assert WarmLoadSettings(None).patches() == {}
    monkeypatch.setattr(warm_load.platform, "machine", lambda: "aarch64")  # Inductor does not probe there
    _probe_then_remember(tmp_path)
    assert not (tmp_path / VEC_ISA_FILE).exists()


def test_a_users_own_vec_isa_ok_is_left_alone(isa, tmp_path):
    from torch._inductor import config
    _probe_then_remember(tmp_path)
    isa.valid_vec_isa_list.cache_clear()
    with config.patch({"cpp.vec_isa_ok": False}):
        assert WarmLoadSettings(tmp_path).patches() == {}


def test_an_unwritable_cache_is_not_an_error(isa, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    settings = WarmLoadSettings(blocker / "root")  # a file where the root's parent should be
    isa.valid_vec_isa_list()
    settings.remember()  # no exception: the next start probes again


def test_a_list_that_differs_after_the_load_is_a_warning_and_dropped(isa, tmp_path, caplog):
    _probe_then_remember(tmp_path)
    isa.valid_vec_isa_list.cache_clear()
    settings = WarmLoadSettings(tmp_path)
    assert settings.skip_vec_isa_probe
    isa.supported_vec_isa_list.pop(1)  # this torch's list lacks a candidate the record has
    isa.valid_vec_isa_list()
    with caplog.at_level(logging.WARNING, logger="vgraph"):
        settings.check_vec_isa()
    assert "differs" in caplog.text and not settings.skip_vec_isa_probe
    assert isa.valid_vec_isa_list.cache_info().currsize == 0, "later compiles probe again"


_PICK = """
import json, sys
from torch._inductor import config, cpu_vec_isa
with config.patch({"cpp.vec_isa_ok": True} if sys.argv[1] == "skip" else {}):
    isa = cpu_vec_isa.pick_vec_isa()
print(json.dumps([str(isa), isa.build_arch_flags(), [str(v) for v in cpu_vec_isa.valid_vec_isa_list()]]))
"""


def _pick(mode: str, env: dict) -> list:
    result = subprocess.run([sys.executable, "-c", _PICK, mode], capture_output=True, text=True,
                            timeout=300, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_with_the_real_inductor_the_shortcut_picks_what_the_probes_pick(tmp_path):
    """What names the compiled libraries (the ISA and its flags) is the same either way, so a
    warm load finds the libraries the cold compile built. Fresh processes: the answer is cached
    per process."""
    fingerprint = warm_load.vec_isa_fingerprint(warm_load._vec_isa_module())
    if fingerprint is None:
        pytest.skip("Inductor does not probe on this machine (not x86 Linux, or no compiler)")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    probed = _pick("probe", env)
    if probed[2] != fingerprint["candidates"]:
        pytest.skip("a candidate fails its probe here: the shortcut is never used on this machine")
    assert _pick("skip", env) == probed
