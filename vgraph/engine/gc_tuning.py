"""Garbage-collector settings for the long-lived serving processes, and for one offline run.

Why: after startup a server process holds millions of long-lived objects (torch, transformers,
the tokenizer, FastAPI, the compiled model's graph modules). CPython's cyclic collector walks
every tracked object of a generation when it collects it, so each full (gen-2) collection
costs a pause proportional to all of them: tens to hundreds of milliseconds, during which no
token is streamed (the server's event loop) or no step runs (the engine-core process). And the
steady allocation of small per-step objects (outputs, deltas, SSE chunks) triggers young
collections every 700 allocations, which promote survivors and eventually trigger full ones.

``freeze_after_startup`` moves everything alive at the end of startup into the permanent
generation (``gc.freeze``), which collections skip, and raises the young generation's threshold,
so collections are rarer and only ever walk what was allocated while serving.

``frozen_for_the_run`` does the same for the span of one ``LLM.generate`` (``embed``, ``chat``)
and undoes it after: the library runs in its caller's process, whose collector is the caller's.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import Iterator

logger = logging.getLogger("vgraph")

# Young-generation threshold while serving (CPython's default is 700): per-step objects die
# young, so rarer young collections find little to promote.
GEN0_THRESHOLD = 50_000
ENV = "VGRAPH_GC_TUNING"  # "0": leave the collector as CPython sets it (to measure the difference)


def freeze_after_startup() -> None:
    """Collects once, freezes what survived, and raises the young threshold (see module doc);
    nothing when ``VGRAPH_GC_TUNING=0``."""
    if os.environ.get(ENV, "1") == "0":
        return
    gc.collect()
    gc.freeze()
    _raise_young_threshold()
    logger.debug("gc: froze %d objects after startup; thresholds %s", gc.get_freeze_count(), gc.get_threshold())


@contextlib.contextmanager
def frozen_for_the_run() -> Iterator[None]:
    """Freezes what is alive when an offline run starts and raises the young threshold; both
    undone when it ends.

    Why: a run's steps allocate per-step objects that promote until a full collection walks the
    whole heap: on the CPU demo model each took about 105 ms over 214k objects, four times in
    three ``generate`` calls of 256 x 64 tokens (22% of their time), and a CUDA process's heap
    is larger. Freezing and unfreezing splice lists (no walk), so a run of one token pays
    nothing. Nothing changes when objects are frozen already (the caller's own ``gc.freeze``,
    which unfreezing would undo; a serving process after ``freeze_after_startup``) or with
    ``VGRAPH_GC_TUNING=0``."""
    if os.environ.get(ENV, "1") == "0" or gc.get_freeze_count():
        yield
        return
    thresholds = gc.get_threshold()
    gc.freeze()
    _raise_young_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def _raise_young_threshold() -> None:
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
