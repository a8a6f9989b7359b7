"""The distribution as a user installs it: a built wheel (and ``pip install .``) in a fresh venv.

The project venv imports vgraph from the checkout (an editable install), so a package left
out of the distribution goes unnoticed there; ``vgraph.compiler`` once did, and the wheel
failed with ModuleNotFoundError. Here vgraph comes only from what was installed, run from a
folder outside the checkout.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from vgraph import __version__

REPO = Path(__file__).resolve().parents[1]
# What a build needs; copied so the build's own build/ and *.egg-info stay out of the checkout
# (several builds may share it) and no stale build/lib of an earlier build enters the wheel.
SOURCES = ["pyproject.toml", "README.md", "vgraph", "ops", "passes", "tests", "perf", "examples", "scripts"]

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _copy_sources(dest: Path) -> Path:
    dest.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info", "results")
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


def _fresh_venv(root: Path) -> tuple[Path, Path]:
    """A venv that sees the project venv's dependencies (torch, transformers, pip...) through a
    plain ``.pth`` line, but not its editable vgraph: a directory named in a ``.pth`` file is
    added to sys.path without its own ``.pth`` files being run, so the editable finder
    (``__editable__*vgraph*.pth``) never installs. No pip of its own: the project's runs in it
    and installs into it (pip installs into the running interpreter's prefix). Returns the
    venv's python and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = dict.fromkeys(sysconfig.get_path(kind) for kind in ("purelib", "platlib"))
    (Path(site) / "project_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    return python, Path(site)


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["VGRAPH_CACHE_DIR"] = str(cache)
    return env


def _install(how: str, tmp_path: Path, python: Path, env: dict[str, str]) -> None:
    source = _copy_sources(tmp_path / "src")
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--no-input"]
    if how == "wheel":
        _run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
             tmp_path, env)
        (target,) = (tmp_path / "dist").glob("vgraph-*.whl")
    else:
        target = source
    # --force-reinstall: the project venv's editable vgraph of the same version is visible to pip
    # (it is outside this venv, so pip leaves it alone), which would otherwise count as installed.
    _run(pip + ["install", "--no-deps", "--no-build-isolation", "--force-reinstall", str(target)], tmp_path, env)


@pytest.mark.parametrize("how", ["wheel", "source"])
def test_installed_distribution_runs_generate(tmp_path, how):
    """``pip install vgraph-*.whl`` and ``pip install .`` (non-editable) both give a working
    ``vgraph`` command, with every subpackage and the C++ sources the CPU kernels build from."""
    python, site = _fresh_venv(tmp_path / "venv")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = _env(tmp_path / "cache")
    _install(how, tmp_path, python, env)
    probe = ("import importlib.metadata as m, vgraph, vgraph.compiler, vgraph.ops.kernels, vgraph.passes\n"
             "print(vgraph.__file__); print(vgraph.compiler.__file__)\n"
             "print(sorted({f.parts[0] for f in m.distribution('vgraph').files if f.parts[0] != '..'}))\n"
             "print(sorted(f.name for f in m.distribution('vgraph').files if f.suffix in ('.cpp', '.h')))\n"
             "print(sorted(f.name for f in m.distribution('vgraph').files if 'demo-model-v1' in f.parts))")
    lines = _run([str(python), "-c", probe], work, env).stdout.splitlines()
    vgraph_file, compiler_file, top, cpp, demo_files = lines[:5]
    assert Path(vgraph_file).is_relative_to(site) and Path(compiler_file).is_relative_to(site), \
        f"vgraph must come from the installed distribution in {site}, not {vgraph_file}"
    assert top == str(["vgraph", f"vgraph-{__version__}.dist-info"]), f"only vgraph ships (not tests/, perf/...): {top}"
    for source in ("paged_attention_cpu.cpp", "prefill_attention_cpu.cpp", "paged_attention_common.h"):
        assert source in cpp, f"csrc/*.cpp and csrc/*.h of vgraph.ops must ship, found {cpp}"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert repr(name) in demo_files, f"the demo model's {name} must ship as package data, found {demo_files}"
    result = _run([str(python.parent / "vgraph"), "generate", "--prompt", "Hi", "--max-tokens", "4",
                   "--enforce-eager", "--kv-cache-gib", "0.01"], work, env)
    assert "--- prompt 'Hi'" in result.stdout
    assert not (tmp_path / "cache" / "demo-model-v1").exists(), "the installed demo model runs from the package"
