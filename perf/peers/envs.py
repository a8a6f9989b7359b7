"""The peer engines' virtual environments, the benchmark checkpoints and their conversions, each
made on first use and cached under ``~/.cache/vgraph/perf-peers`` (``VGRAPH_PERF_PEERS_DIR``).

Why their own environments: the peers pin their own transformers (optimum-intel wants an older
one than vgraph), bring native libraries of their own, and are no dependency of vgraph. Each
install is pinned to the versions the committed figures were measured with, and uses
``constraints/cpu.txt`` so the converters' torch is the CPU wheel (not GBs of CUDA ones).
Conversions are keyed by a hash of the checkpoint's files and of the conversion command, so a
rerun neither reinstalls nor reconverts. Anything that fails raises ``PeerUnavailable`` with the
reason; the suite records it and goes on without that engine.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints" / "cpu.txt"
INSTALL_TIMEOUT_S = 1800
CONVERT_TIMEOUT_S = 1800


def cache_root() -> Path:
    return Path(os.environ.get("VGRAPH_PERF_PEERS_DIR", Path.home() / ".cache" / "vgraph" / "perf-peers"))


class PeerUnavailable(Exception):
    """A peer that cannot be installed or cannot convert the checkpoint; the message says why."""


Command = Callable[[Path, str, str], list[str]]  # (venv bin folder, checkpoint, output) -> argv


def _optimum_export(bin_dir: Path, src: str, out: str) -> list[str]:
    # --weight-format fp32: no int8 weight compression (optimum applies it to models > 1B
    # parameters by default; explicit here so both model sizes are exported alike).
    return [str(bin_dir / "optimum-cli"), "export", "openvino", "--model", src,
            "--task", "text-generation-with-past", "--weight-format", "fp32", out]


def _ort_builder(bin_dir: Path, src: str, out: str) -> list[str]:
    # perf/peers/ort_build.py: the builder with its LM-head detection corrected (see there).
    return [str(bin_dir / "python"), "-m", "perf.peers.ort_build", "-i", src, "-o", out,
            "-p", "fp32", "-e", "cpu", "-c", out + ".hf-cache"]


def _ct2_converter(bin_dir: Path, src: str, out: str) -> list[str]:
    return [str(bin_dir / "ct2-transformers-converter"), "--model", src, "--output_dir", out,
            "--quantization", "float32"]


@dataclass(frozen=True)
class Peer:
    """One engine's environment: what pip installs, what it must remove afterwards (a package
    the resolver pulls in that breaks the converter), and the conversion command."""
    name: str
    packages: tuple[str, ...]
    convert: Command
    uninstall: tuple[str, ...] = ()

    @property
    def venv(self) -> Path:
        return cache_root() / self.name / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


PEERS: dict[str, Peer] = {
    # torchvision: pulled in by optimum-intel, and its build does not load against torch 2.13's
    # CPU wheel ("operator torchvision::nms does not exist"), which breaks every transformers import.
    "openvino": Peer("openvino", ("openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0",
                                  "torch==2.13.0"), _optimum_export, uninstall=("torchvision",)),
    # onnx_ir: imported by the builder but not declared by onnxruntime-genai 0.18.
    "ortgenai": Peer("ortgenai", ("onnxruntime-genai==0.18.0", "onnx==1.23.2", "onnx_ir==1.1.0",
                                  "transformers==5.23.0", "torch==2.13.0"), _ort_builder),
    "ctranslate2": Peer("ctranslate2", ("ctranslate2==4.8.5", "transformers==5.23.0", "torch==2.13.0"),
                        _ct2_converter),
}


def _run_logged(argv: list[str], log: Path, timeout: float, what: str) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        try:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"{what} took over {timeout:.0f} s (log: {log})") from None
    if proc.returncode != 0:
        raise PeerUnavailable(f"{what} failed (exit {proc.returncode}): {tail(log)} (log: {log})")


def tail(path: Path, lines: int = 3) -> str:
    text = [ln for ln in path.read_text(errors="replace").splitlines()
            if ln.strip() and not ln.startswith("WARNING: Location")]
    return " | ".join(text[-lines:])[-600:]


def ensure_venv(peer: Peer) -> Path:
    """The peer's interpreter, installing its environment first when missing or when its
    package list changed (the stamp file holds the list it was built from)."""
    stamp = peer.venv / ".vgraph-peer-packages"
    wanted = json.dumps({"packages": peer.packages, "uninstall": peer.uninstall})
    if peer.python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return peer.python
    log = cache_root() / peer.name / "install.log"
    print(f"  {peer.name}: installing {' '.join(peer.packages)} (log: {log})", flush=True)
    if not peer.python.exists():
        _run_logged([sys.executable, "-m", "venv", str(peer.venv)], log, 300, f"{peer.name}: venv")
    _run_logged([str(peer.python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), *peer.packages],
                log, INSTALL_TIMEOUT_S, f"{peer.name}: pip install")
    if peer.uninstall:
        _run_logged([str(peer.python), "-m", "pip", "uninstall", "-y", "-q", *peer.uninstall],
                    log.with_name("uninstall.log"), 300, f"{peer.name}: pip uninstall")
    stamp.write_text(wanted)
    return peer.python


def checkpoint_hash(path: str) -> str:
    """sha256 over the checkpoint's files (names and contents), in name order."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            with open(f, "rb") as data:
                for block in iter(lambda: data.read(1 << 22), b""):
                    h.update(block)
    return h.hexdigest()


def ensure_converted(peer: Peer, checkpoint: str, ckpt_hash: str) -> tuple[str, list[str]]:
    """The converted model's folder and the command that made it, converting on first use.

    Written to a temporary folder and renamed when complete, so an interrupted conversion is
    redone rather than half-used."""
    template = peer.convert(peer.venv / "bin", "SRC", "OUT")
    key = hashlib.sha256((ckpt_hash + json.dumps(template) + json.dumps(peer.packages)).encode()).hexdigest()[:16]
    out = cache_root() / peer.name / "converted" / key
    command = peer.convert(peer.venv / "bin", checkpoint, str(out))
    if (out / ".complete").exists():
        return str(out), command
    partial = out.with_name(key + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(str(partial) + ".hf-cache", ignore_errors=True)
    print(f"  {peer.name}: converting {checkpoint}", flush=True)
    _run_logged(peer.convert(peer.venv / "bin", checkpoint, str(partial)), out.with_suffix(".log"),
                CONVERT_TIMEOUT_S, f"{peer.name}: conversion")
    shutil.rmtree(str(partial) + ".hf-cache", ignore_errors=True)
    (partial / ".complete").write_text(json.dumps(command))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    return str(out), command


def ensure_checkpoint(name: str, build: Callable[[str], str]) -> str:
    """A benchmark checkpoint built once into the cache (the 0.5B-shaped one is 1.5 GB)."""
    out = cache_root() / "checkpoints" / name
    if (out / ".complete").exists():
        return str(out)
    shutil.rmtree(out, ignore_errors=True)
    print(f"  building checkpoint {name}", flush=True)
    build(str(out))
    (out / ".complete").write_text("")
    return str(out)
