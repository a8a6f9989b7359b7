"""What Inductor generated for each compiled piece: its kernels, read from the output code.

Inductor hands every module it generates to ``GraphLowering.save_output_code`` (a class-level
hook, None by default; ``torch._inductor.utils.run_and_get_code`` uses it too). While a
``KernelCapture`` is active, each module is stored under the piece and size vgraph's backend
is compiling (``compiling_now``), so a report can show, piece by piece, which kernels exist
with and without a pass: where Inductor fused on its own, and where a custom op stayed opaque.

The output code declares each generated kernel as ``name = async_compile.<kind>(...)``
(``cpp_fused_add_mean_mul_0`` on CPU, ``triton_poi_fused_...`` / ``triton_red_...`` /
``triton_per_...`` on CUDA; the name lists the aten ops fused into it), and calls what it did
not generate: ``extern_kernels.mm(...)`` (library GEMMs) and ``torch.ops.<ns>.<op>.<overload>``
(custom ops, opaque to Inductor).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from torch._inductor.graph import GraphLowering

from ..compiler.backend import compiling_now

_KERNEL = re.compile(r"^(\w+) = async_compile\.(\w+)\(", re.MULTILINE)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_OP_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
# Inductor's descriptive kernel names: <backend>[_<kind>]_fused_<op>_<op>..._<index>
_FUSED = re.compile(r"_fused_(.+)_\d+$")


@dataclass
class KernelSummary:
    """The kernels of one generated module."""

    generated: list[str] = field(default_factory=list)  # kernel names Inductor wrote, in order
    extern: dict[str, int] = field(default_factory=dict)  # extern_kernels.<name> calls
    custom_ops: dict[str, int] = field(default_factory=dict)  # "vgraph.rms_norm" -> calls

    @property
    def fused(self) -> list[str]:
        """Generated kernels that combine two or more aten ops (per their descriptive name)."""
        return [name for name in self.generated if len(fused_ops(name)) >= 2]

    def as_dict(self) -> dict[str, Any]:
        return {"generated": list(self.generated), "generated_count": len(self.generated),
                "fused": self.fused, "fused_count": len(self.fused), "extern": dict(self.extern),
                "custom_ops": dict(self.custom_ops)}


def fused_ops(kernel_name: str) -> list[str]:
    """The op names a descriptive kernel name lists: ``cpp_fused_add_mean_mul_0`` -> add, mean,
    mul. Inductor joins op names with "_" and op names contain "_" themselves, so this is a
    best effort for counting; the name itself is what a report shows."""
    match = _FUSED.search(kernel_name)
    return match.group(1).split("_") if match else []


def parse_kernels(code: str) -> KernelSummary:
    """Reads a generated module's kernels and calls (see the module docstring)."""
    summary = KernelSummary(generated=[name for name, _kind in _KERNEL.findall(code)])
    summary.extern = dict(Counter(_EXTERN.findall(code)))
    ops = Counter(f"{ns}.{op}" for ns, op, _overload in _OP_CALL.findall(code) if ns != "aten")
    summary.custom_ops = dict(sorted(ops.items()))
    return summary


class KernelCapture:
    """Context manager: collects Inductor's output code per (piece, size) compiled for vgraph.

    Code generated outside vgraph's backend is kept under piece -1. An earlier hook (someone
    else's ``save_output_code``) still receives every module.
    """

    def __init__(self) -> None:
        self.code: dict[tuple[int, str], list[str]] = {}
        self._previous: Optional[Any] = None

    def __enter__(self) -> "KernelCapture":
        self._previous = GraphLowering.save_output_code
        GraphLowering.save_output_code = self._save
        return self

    def __exit__(self, *exc: Any) -> None:
        GraphLowering.save_output_code = self._previous

    def _save(self, code: str) -> None:
        now = compiling_now()
        key = (now.piece, now.size) if now is not None else (-1, "")
        self.code.setdefault(key, []).append(code)
        if self._previous is not None:
            self._previous(code)

    def summaries(self) -> dict[tuple[int, str], KernelSummary]:
        """Per (piece, size): the kernels of every module generated for it, in order."""
        out = {}
        for key, modules in self.code.items():
            merged = KernelSummary()
            for module in modules:
                part = parse_kernels(module)
                merged.generated += part.generated
                merged.extern = dict(Counter(merged.extern) + Counter(part.extern))
                merged.custom_ops = dict(sorted((Counter(merged.custom_ops) + Counter(part.custom_ops)).items()))
            out[key] = merged
        return out
