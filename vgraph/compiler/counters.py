"""Counters the compiler keeps, readable from Python (tests, logs, `vgraph compile`)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

logger = logging.getLogger("vgraph")


@dataclass
class CompileCounters:
    graphs_seen: int = 0  # Dynamo graphs handed to the backend; > 1 means a recompile
    pieces: int = 0  # pieces of the last split graph (2L + 1 for L attention layers)
    compiled_pieces: int = 0  # pieces that go through Inductor (L + 1)
    unique_piece_graphs: int = 0  # distinct piece graphs (identical layers share one)
    # torch.distributed functional collectives (all_reduce, ...) traced inside the compiled pieces
    # (tensor parallelism); counted when the graph is traced, so 0 on a warm load.
    compiled_collectives: int = 0
    inductor_compilations: int = 0  # standalone_compile calls actually made
    cache_loads: int = 0
    cache_saves: int = 0
    cache_errors: int = 0  # unreadable entries recompiled, or saves that failed
    dynamo_seconds: float = 0.0
    inductor_seconds: float = 0.0
    cache_load_seconds: float = 0.0
    captured_graph: str = ""  # "saved" (cold start) or "loaded" (warm start: no Dynamo ran)
    captured_load_seconds: float = 0.0  # the warm start's whole graph + artifact load
    # Pieces a warm start ran as runnables (runnable.py): then Inductor was not even imported.
    runnable_loads: int = 0
    runnable_saves: int = 0  # pieces saved as runnables after the forward built from them matched
    pass_matches: dict[str, int] = field(default_factory=dict)
    rung: str = ""  # the rung of the compile ladder that served (loaders.py)

    @property
    def recompiles(self) -> int:
        return max(0, self.graphs_seen - 1)

    def rewind(self, to: "CompileCounters") -> None:
        """Back to an earlier copy: a rung whose forward failed counted nothing."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(to, f.name))

    def record_load(self, split: torch.nn.Module, piece_hashes: list[str], matches: dict[str, dict[str, int]],
                    seconds: float) -> None:
        """A captured graph loaded with its pieces: what a warm load reports, as a compile
        reports it."""
        self.pieces = sum(1 for n in split.graph.nodes if n.op == "call_module")
        self.compiled_pieces, self.unique_piece_graphs = len(piece_hashes), len(set(piece_hashes))
        self.captured_graph, self.captured_load_seconds = "loaded", seconds
        self.pass_matches = pass_totals(piece_hashes, matches)

    def as_dict(self) -> dict:
        return {**asdict(self), "recompiles": self.recompiles}


def pass_totals(piece_hashes: list[str], matches: dict[str, dict[str, int]]) -> dict[str, int]:
    """Matches per site in the model: each compiled piece counts the matches of its graph
    (``matches``: piece hash -> pass -> count), so identical layers compiled once still count
    once per layer."""
    totals: dict[str, int] = {}
    for piece_hash in piece_hashes:
        for name, count in matches.get(piece_hash, {}).items():
            totals[name] = totals.get(name, 0) + count
    return totals


def log_compile_summary(counters: CompileCounters, cache: Any, seconds: float) -> None:
    c = counters
    if c.captured_graph == "loaded" and c.runnable_loads:
        logger.info("loaded the compiled model from the cache in %.2f s (%d pieces, %d compiled, %d distinct): "
                    "captured graph and %d runnables in %.2f s, Dynamo and Inductor not imported",
                    seconds, c.pieces, c.compiled_pieces, c.unique_piece_graphs, c.runnable_loads,
                    c.captured_load_seconds)
    elif c.captured_graph == "loaded":
        logger.info("loaded the compiled model from the cache in %.2f s (%d pieces, %d compiled, %d distinct): "
                    "captured graph and %d artifacts in %.2f s, no Dynamo trace, no Inductor compilation",
                    seconds, c.pieces, c.compiled_pieces, c.unique_piece_graphs, c.cache_loads,
                    c.captured_load_seconds)
    else:
        logger.info("compiled %d pieces (%d compiled, %d distinct) in %.2f s: Dynamo %.2f s, "
                    "Inductor %.2f s (%d compilations), cache %d loads (%.2f s), %d saves",
                    c.pieces, c.compiled_pieces, c.unique_piece_graphs, seconds, c.dynamo_seconds,
                    c.inductor_seconds, c.inductor_compilations, c.cache_loads, c.cache_load_seconds,
                    c.cache_saves)
    if c.compiled_collectives:
        logger.info("%d collectives (tensor parallelism) compiled inside the pieces", c.compiled_collectives)
    if c.pass_matches:
        logger.info("pass matches: %s", ", ".join(f"{k}={v}" for k, v in c.pass_matches.items()))
    if cache.writable:
        logger.info("compile cache: %s", cache.folder)
    elif cache.root is not None:
        logger.info("compile cache: none this run (compiled in memory; see the warning above)")
