"""The pass manager: vgraph's single ``post_grad_custom_post_pass`` for Inductor.

Inductor accepts one custom post-grad pass (or a list), keyed in its FX-graph cache by the
pass's ``uuid()``. The manager runs an ordered list of passes, combines their uuids into its
own, keeps the match counts, and can dump the graph around each pass for inspection.

Caching caveat: when Inductor's FX-graph cache (or AOTAutograd's cache) hits, Inductor loads
the compiled code and runs no post-grad pass at all; the manager is not called, counts do
not move and nothing is dumped. Counts therefore describe the compiles that actually ran.
"""
from __future__ import annotations

import hashlib
import logging
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, Union

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .base import AnyPass, as_pass, source_of
from .rms_norm_quant import RMSNormQuantFusionPass
from .silu_mul import SiluMulFusionPass

logger = logging.getLogger("vgraph.passes")


def default_passes(lift_plain_torch: bool = True) -> list[AnyPass]:
    """vgraph's shipped passes, in the order they run.

    ``lift_plain_torch=False`` leaves a plain-torch SiLU-and-mul to Inductor instead of
    turning it into ``vgraph::silu_and_mul``: for a model built without custom ops, whose
    user asked for Inductor's kernels (on CPU the op is the reference, run aten call by aten
    call, where Inductor emits one fused loop).
    """
    return [RMSNormQuantFusionPass(), SiluMulFusionPass(plain_torch=lift_plain_torch)]


class PassManager(CustomGraphPass):
    """Runs passes in order on each post-grad graph; set it as Inductor's custom post pass::

        manager = PassManager(default_passes() + [my_pass])
        with torch._inductor.config.patch(post_grad_custom_post_pass=manager):
            compiled = torch.compile(fn)
            compiled(*inputs)
        manager.match_counts()   # {"RMSNormQuantFusionPass": 2, ...}

    ``passes`` are ``VgraphPass`` instances or any callable on a ``torch.fx.Graph`` with a
    ``uuid()``. With ``dump_dir`` set, the graph is written there before and after each pass.
    """

    def __init__(self, passes: Iterable[Any] = (),
                 dump_dir: Optional[Union[str, Path]] = None) -> None:
        self._passes: list[AnyPass] = []
        self._names: list[str] = []
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        #: Number of graphs this manager has run on.
        self.graphs_seen = 0
        #: Matches per pass in the most recent graph.
        self.last_match_counts: dict[str, int] = {}
        for p in passes:
            self.add(p)

    def add(self, p: Any) -> "PassManager":
        """Appends a pass (runs after the existing ones); returns self for chaining."""
        wrapped = as_pass(p)
        self._passes.append(wrapped)
        self._names.append(self._unique_name(wrapped.pass_name))
        return self

    @property
    def passes(self) -> tuple[AnyPass, ...]:
        return tuple(self._passes)

    def _unique_name(self, name: str) -> str:
        """Two instances of one pass (e.g. different configs) get ``Name``, ``Name#2``."""
        if name not in self._names:
            return name
        n = 2
        while f"{name}#{n}" in self._names:
            n += 1
        return f"{name}#{n}"

    # ------------------------------------------------------------------ running

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs_seen += 1
        counts: dict[str, int] = {}
        for step, (name, p) in enumerate(zip(self._names, self._passes), start=1):
            self._dump(graph, step, name, "before")
            p(graph)
            _check_graph(graph, name)
            counts[name] = p.matched_count
            self._dump(graph, step, name, "after")
        self.last_match_counts = counts
        logger.debug("graph %d: matches %s", self.graphs_seen, counts)

    def match_counts(self) -> dict[str, int]:
        """Matches per pass, summed over every graph this manager has run on."""
        return {name: p.total_matched for name, p in zip(self._names, self._passes)}

    def reset_counts(self) -> None:
        for p in self._passes:
            p.reset_counts()
        self.graphs_seen = 0
        self.last_match_counts = {}

    def summary(self) -> str:
        """One line for logs, e.g. ``RMSNormQuantFusionPass=4 SiluMulFusionPass=2 (3 graphs)``."""
        counts = " ".join(f"{name}={n}" for name, n in self.match_counts().items())
        return f"{counts or 'no passes'} ({self.graphs_seen} graphs)"

    # ------------------------------------------------------------------ cache key

    def uuid(self) -> Optional[str]:
        """Hash of this module's source and each pass's uuid, in order; None if any is None.

        A pass without a uuid cannot be told apart from a changed version of itself, so the
        whole manager then opts out of Inductor's FX-graph cache. ``dump_dir`` is left out:
        it changes what is written to disk, not what is compiled.
        """
        parts = [source_of(sys.modules[__name__]) or ""]
        for p in self._passes:
            pass_uuid = p.uuid()
            if pass_uuid is None:
                return None
            parts.append(repr(pass_uuid))
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    # ------------------------------------------------------------------ dumps

    def _dump(self, graph: torch.fx.Graph, step: int, name: str, when: str) -> None:
        """Writes ``graph{N:03}_{step:02}_{pass}_{before|after}.py`` under ``dump_dir``."""
        if self.dump_dir is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        path = self.dump_dir / f"graph{self.graphs_seen:03d}_{step:02d}_{safe_name}_{when}.py"
        header = f"# graph {self.graphs_seen}, {when} pass {step} ({name})\n"
        if when == "after":
            header += f"# matches: {self._passes[step - 1].matched_count}\n"
        path.write_text(header + graph.python_code(root_module="self").src)

    def __repr__(self) -> str:
        return f"PassManager({self._passes!r}, dump_dir={self.dump_dir!r})"


def _check_graph(graph: torch.fx.Graph, pass_name: str) -> None:
    """Fails at the pass that broke the graph, not later inside Inductor's lowering."""
    try:
        graph.lint()
    except Exception as exc:
        raise RuntimeError(f"pass {pass_name} left an invalid FX graph: {exc}") from exc
