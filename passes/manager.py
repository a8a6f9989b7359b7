"""The pass manager: vgraph's single ``post_grad_custom_post_pass`` for Inductor.

Inductor accepts one custom post-grad pass (or a list), keyed in its FX-graph cache by the
pass's ``uuid()``. The manager runs an ordered list of passes, combines their uuids into its
own, keeps the match counts, and can dump the graph around each pass for inspection.

Caching caveat: when Inductor's FX-graph cache (or AOTAutograd's cache) hits, Inductor loads
the compiled code and runs no post-grad pass at all; the manager is not called, counts do
not move and nothing is dumped. Counts therefore describe the compiles that actually ran.

What the counts count: the manager runs once per graph Inductor compiles, so
``match_counts()`` sums over *distinct graphs and compile sizes*: with identical decoder layers
compiled once, a two-layer model's middle pieces count once, and a piece compiled for the
dynamic shape and two ``compile_sizes`` counts three times. vgraph's engine reports matches
per *piece instance* (per site in the model, dynamic shape only) in
``compile_counters.pass_matches``. ``history`` keeps every graph's record (its labels, and per
pass the matches per pattern, op counts before and after, nodes added and removed), which is
what ``vgraph passes report`` is made from.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .base import AnyPass, as_pass, source_of
from .all_reduce_norm import AllReduceRMSNormFusionPass
from .fx_utils import op_counts, target_name
from .norm_linear import NARROW_ROWS, NormLinearFusionPass
from .rms_norm_quant import RMSNormQuantFusionPass
from .silu_mul import SiluMulFusionPass

logger = logging.getLogger("vgraph.passes")


def default_passes(lift_plain_torch: bool = True, all_reduce: bool = True) -> list[AnyPass]:
    """vgraph's shipped passes, in the order they run.

    ``lift_plain_torch=False`` leaves a plain-torch SiLU-and-mul (and a plain-torch RMSNorm
    after an all-reduce) to Inductor instead of turning it into a vgraph op: for a model built
    without custom ops, whose user asked for Inductor's kernels (on CPU the op is the
    reference, run aten call by aten call, where Inductor emits one fused loop).
    ``all_reduce=False`` leaves out the all-reduce + RMSNorm fusion (tensor parallelism). It
    runs after the quant fusion, so that a norm already fused with its fp8 quant fuses with the
    all-reduce too. The norm + projection fusion (16-bit CUDA projections, rows of at most
    ``NARROW_ROWS`` elements) runs last: a norm the all-reduce took stays there.
    """
    passes: list[AnyPass] = [RMSNormQuantFusionPass(), SiluMulFusionPass(plain_torch=lift_plain_torch)]
    if all_reduce:
        passes.append(AllReduceRMSNormFusionPass(plain_torch=lift_plain_torch))
    passes.append(NormLinearFusionPass(max_width=NARROW_ROWS))
    return passes


@dataclass
class PassStep:
    """What one pass did to one graph."""

    name: str
    matches: int
    patterns: dict[str, int]  # matches per pattern name
    ops_before: dict[str, int]  # calls per target (fx_utils.target_name) before the pass
    ops_after: dict[str, int]
    added: dict[str, int]  # nodes the pass created, per target
    removed: dict[str, int]  # nodes the pass erased, per target
    seconds: float
    dumps: tuple[str, ...] = ()  # file names of the graph before and after, when dumping

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class GraphRecord:
    """One graph the manager ran on: its number, the labels it was compiled under (vgraph's
    backend sets ``piece`` and ``size``), and one step per pass, in order."""

    index: int
    labels: dict[str, str]
    steps: list[PassStep] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "labels": dict(self.labels),
                "steps": [s.as_dict() for s in self.steps]}


class PassManager(CustomGraphPass):
    """Runs passes in order on each post-grad graph; set it as Inductor's custom post pass::

        manager = PassManager(default_passes() + [my_pass])
        with torch._inductor.config.patch(post_grad_custom_post_pass=manager):
            compiled = torch.compile(fn)
            compiled(*inputs)
        manager.match_counts()   # {"RMSNormQuantFusionPass": 2, ...}

    ``passes`` are ``VgraphPass`` instances or any callable on a ``torch.fx.Graph`` with a
    ``uuid()``. With ``dump_dir`` set, the graph is written there before and after each pass,
    under a name that carries the labels of ``labelled`` (the piece and compile size).
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
        #: One record per graph run on (see GraphRecord), oldest first.
        self.history: list[GraphRecord] = []
        #: Labels of the graphs being compiled now (``labelled``).
        self.labels: dict[str, str] = {}
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

    @contextlib.contextmanager
    def labelled(self, **labels: Any) -> Iterator[None]:
        """Labels the graphs run on inside the block, e.g. ``piece="3", size="dynamic"``: the
        labels go into dump file names and ``history``. vgraph's backend labels every compile."""
        old, self.labels = self.labels, {k: str(v) for k, v in labels.items()}
        try:
            yield
        finally:
            self.labels = old

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs_seen += 1
        record = GraphRecord(self.graphs_seen, dict(self.labels))
        counts: dict[str, int] = {}
        for step, (name, p) in enumerate(zip(self._names, self._passes), start=1):
            dumped_before = self._dump(graph, step, name, "before")
            before = {node: target_name(node) for node in graph.nodes}
            ops_before = op_counts(graph)
            start = time.perf_counter()
            p(graph)
            seconds = time.perf_counter() - start
            _check_graph(graph, name)
            counts[name] = p.matched_count
            record.steps.append(_step(name, p, graph, before, ops_before, seconds))
            dumped_after = self._dump(graph, step, name, "after")
            if dumped_before and dumped_after:
                record.steps[-1].dumps = (dumped_before, dumped_after)
        self.last_match_counts = counts
        self.history.append(record)
        logger.debug("graph %d %s: matches %s", self.graphs_seen, self.labels, counts)

    def match_counts(self) -> dict[str, int]:
        """Matches per pass, summed over every graph this manager has run on."""
        return {name: p.total_matched for name, p in zip(self._names, self._passes)}

    def reset_counts(self) -> None:
        for p in self._passes:
            p.reset_counts()
        self.graphs_seen = 0
        self.last_match_counts = {}
        self.history = []

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

    def dump_name(self, step: int, name: str, when: str) -> str:
        """``graph{N:03}[_{key}-{value}...]_{step:02}_{pass}_{before|after}.py`` for the current
        graph, e.g. ``graph002_piece-2_size-dynamic_01_RMSNormQuantFusionPass_before.py``."""
        labels = "".join(f"_{_safe(k)}-{_safe(v)}" for k, v in self.labels.items())
        return f"graph{self.graphs_seen:03d}{labels}_{step:02d}_{_safe(name)}_{when}.py"

    def _dump(self, graph: torch.fx.Graph, step: int, name: str, when: str) -> Optional[str]:
        """Writes the graph as Python under ``dump_dir`` (see ``dump_name``); its file name."""
        if self.dump_dir is None:
            return None
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / self.dump_name(step, name, when)
        labels = ", ".join(f"{k} {v}" for k, v in self.labels.items())
        header = f"# graph {self.graphs_seen}{f' ({labels})' if labels else ''}, {when} pass {step} ({name})\n"
        if when == "after":
            header += f"# matches: {self._passes[step - 1].matched_count}\n"
        path.write_text(header + graph.python_code(root_module="self").src)
        return path.name

    def __repr__(self) -> str:
        return f"PassManager({self._passes!r}, dump_dir={self.dump_dir!r})"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", str(text))


def _step(name: str, p: AnyPass, graph: torch.fx.Graph, before: dict[torch.fx.Node, str],
          ops_before: dict[str, int], seconds: float) -> PassStep:
    """The record of one pass: nodes are told apart by identity, so a node the pass erased
    and re-created counts as removed and added."""
    after = set(graph.nodes)
    removed: dict[str, int] = {}
    for node, name_of in before.items():
        if node not in after and node.op not in ("placeholder", "output"):
            removed[name_of] = removed.get(name_of, 0) + 1
    added: dict[str, int] = {}
    for node in graph.nodes:
        if node not in before and node.op not in ("placeholder", "output"):
            name_of = target_name(node)
            added[name_of] = added.get(name_of, 0) + 1
    return PassStep(name, p.matched_count, dict(getattr(p, "last_pattern_counts", {})),
                    dict(ops_before), dict(op_counts(graph)), added, removed, seconds)


def _check_graph(graph: torch.fx.Graph, pass_name: str) -> None:
    """Fails at the pass that broke the graph, not later inside Inductor's lowering."""
    try:
        graph.lint()
    except Exception as exc:
        raise RuntimeError(f"pass {pass_name} left an invalid FX graph: {exc}") from exc
