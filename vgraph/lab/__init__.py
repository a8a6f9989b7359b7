"""The pass lab: measure what a fusion pass does to a real model, end to end.

``report(model, passes=[...])`` (also ``vgraph.passes.report`` and ``vgraph passes report``)
compiles the model without and with the passes under study and writes one report: matches,
graph diffs, numerics, compile and step times, and Inductor's kernels. The modules:
``kernels`` (Inductor's output code per piece), ``measure`` (logits, greedy tokens, step
times over any number of engines), ``analysis`` (matches and diffs from the pass manager's
history), ``markdown`` (rendering), ``report`` (the two-variant report itself).
"""
from __future__ import annotations

from .report import PassReport, report

__all__ = ["report", "PassReport"]
