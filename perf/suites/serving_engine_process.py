"""``serving-engine-process``: ``vgraph serve`` with the engine in its own process (the default)
vs in the server process (``--engine-in-process``), TTFT and ITL at 32 and 64 streams, the two
servers measured interleaved. The measurement lives in ``serving.compare_engine_layouts``, next
to the load generator it reuses."""
from __future__ import annotations

from .serving import compare_engine_layouts, summarize_engine_layouts

# One layout comparison at the default threads: a threads-1 rerun would measure something else.
THREADS_1_BUILT_IN = True


def run(device: str, quick: bool = False) -> dict:
    return compare_engine_layouts(device, quick=quick)


def summarize(result: dict) -> str:
    return summarize_engine_layouts(result)
