"""Counters the compiler keeps, readable from Python (tests, logs, `vgraph compile`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    pass_matches: dict[str, int] = field(default_factory=dict)

    @property
    def recompiles(self) -> int:
        return max(0, self.graphs_seen - 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "recompiles": self.recompiles}
