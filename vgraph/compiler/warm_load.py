"""Inductor settings for a warm start's artifact load that skip work whose answer is already
on disk, without changing what is loaded (see cache_dir.md, "What a warm load skips").

Loading a CPU artifact, Inductor probes which vector instruction sets the C++ compiler and
this CPU support, in every process: for each candidate (AVX-512 VNNI, AVX-512, AVX2 on a
current x86 machine) it builds a probe library once and starts a Python subprocess to load
it, 0.3-0.4 s each. The answer only picks the flags, and so the names, of the compiled
libraries to look up. vgraph records it (``vec-isa.json`` at the cache root) with what it
depends on (torch version, CPU flags, compiler binary, interpreter); when a later process
finds the same fingerprint and every candidate passed, the load runs with
``cpp.vec_isa_ok=True``, which gives Inductor the same list without the generic probes (the
few feature-specific ones, VNNI and BF16, still run). A record with a failed candidate is
never used that way, and after the load the list Inductor settled on is checked against the
record (a mismatch is a warning, and later compiles probe).

Not skipped, because it would change the libraries' names: the precompiled header (its
switch is a macro on the compile command, which keys the library).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from . import cache_entries
from .torch_range import unsupported_torch

logger = logging.getLogger("vgraph")

VEC_ISA_FILE = "vec-isa.json"


def _vec_isa_module() -> Optional[Any]:
    """Inductor's vector-ISA module where it has the functions used here, else None (a torch
    that moved them, or one outside the range this was checked on, loads as before, probes
    included)."""
    outside = unsupported_torch("the warm load's vector-ISA shortcut")
    if outside is not None:
        logger.info("%s; the warm load probes as usual", outside)
        return None
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return None
    needed = ("valid_vec_isa_list", "supported_vec_isa_list", "x86_isa_checker")
    if not all(hasattr(cpu_vec_isa, name) for name in needed):
        return None
    if not hasattr(cpu_vec_isa.valid_vec_isa_list, "cache_info"):
        return None
    return cpu_vec_isa


def _compiler_identity() -> Optional[dict[str, Any]]:
    """The C++ compiler Inductor builds with: its resolved path, size and modification time
    (an upgrade in place changes them)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        name = get_cpp_compiler()
    except Exception:  # no compiler, or a torch without this function: no shortcut
        return None
    path = shutil.which(name) or name
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def vec_isa_fingerprint(isa: Any) -> Optional[dict[str, Any]]:
    """Everything the probes' answer depends on, or None where Inductor does not probe (not
    x86 Linux, or the user decided with ``cpp.vec_isa_ok`` / TORCHINDUCTOR_VEC_ISA_OK) or the
    compiler cannot be identified."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch._inductor import config
    if getattr(config.cpp, "vec_isa_ok", None) is not None:
        return None
    compiler = _compiler_identity()
    if compiler is None:
        return None
    flags = list(isa.x86_isa_checker())
    return {"torch": torch.__version__, "cpu_flags": flags, "compiler": compiler,
            "python": os.path.realpath(sys.executable),
            "candidates": [str(v) for v in isa.supported_vec_isa_list
                           if all(flag in flags for flag in str(v).split())]}


def _read_record(path: Path) -> Optional[dict]:
    """The vec-isa record, or None: missing quietly, damaged with one warning (the probes run
    and ``remember`` rewrites it)."""
    return cache_entries.read_json_record(path, "probing the vector ISAs again; it is rewritten")


class WarmLoadSettings:
    """The Inductor config patches for one warm load, decided from the record on disk, and
    ``remember`` to update the record after a load or compile that worked."""

    def __init__(self, root: Optional[Path]) -> None:
        self.root = root
        self._isa = _vec_isa_module()
        self._fingerprint = vec_isa_fingerprint(self._isa) if self._isa is not None and root else None
        self.skip_vec_isa_probe = self._vec_isa_trusted()

    def _vec_isa_trusted(self) -> bool:
        if self._fingerprint is None or self._isa.valid_vec_isa_list.cache_info().currsize:
            return False  # nothing to compare with, or this process has its answer already
        record = _read_record(self.root / VEC_ISA_FILE)
        return (isinstance(record, dict) and record.get("fingerprint") == self._fingerprint
                and record.get("valid") == self._fingerprint["candidates"])

    def patches(self) -> dict[str, Any]:
        return {"cpp.vec_isa_ok": True} if self.skip_vec_isa_probe else {}

    def check_vec_isa(self) -> None:
        """After a load with the probes skipped: Inductor's list must be the recorded one (it is
        by construction; this guards a torch whose candidates differ from the ones computed
        here). If not, a warning, and the list is dropped so that later compiles probe."""
        if not self.skip_vec_isa_probe or not self._isa.valid_vec_isa_list.cache_info().currsize:
            return
        if [str(v) for v in self._isa.valid_vec_isa_list()] != self._fingerprint["candidates"]:
            logger.warning("Inductor's vector ISA list differs from the one recorded in %s; later "
                           "compiles probe again", self.root / VEC_ISA_FILE)
            self._isa.valid_vec_isa_list.cache_clear()
            self.skip_vec_isa_probe = False

    def remember(self) -> None:
        """Records the probes' answer when they ran in this process. Best effort: a cache that
        cannot be written only means the next start probes again."""
        try:
            self._remember_vec_isa()
        except OSError as exc:
            logger.debug("could not record the warm-load shortcuts (%s)", exc)

    def _remember_vec_isa(self) -> None:
        if self.skip_vec_isa_probe or self._fingerprint is None:
            return
        if not self._isa.valid_vec_isa_list.cache_info().currsize:
            return  # no C++ was loaded: the probes did not run, nothing learned
        valid = [str(v) for v in self._isa.valid_vec_isa_list()]
        record = {"fingerprint": self._fingerprint, "valid": valid}
        if _read_record(self.root / VEC_ISA_FILE) != record:
            self.root.mkdir(parents=True, exist_ok=True)
            cache_entries.write_atomic(self.root / VEC_ISA_FILE, json.dumps(record, indent=1).encode())
