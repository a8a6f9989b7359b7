"""``vgraph`` with ``LLMEngine.step`` raising once, at step N + 1 ($VGRAPH_TEST_FAIL_AFTER_STEPS),
counted over every engine of the process (with --data-parallel-size, one replica fails).

Run as a script by test_lifecycle.py: it exercises the server's fatal-engine-error path in a
real process without any fault-injection hook in the product code.
"""
from __future__ import annotations

import os
import sys

from vgraph.engine import llm_engine
from vgraph.engine.stats import StepOutput

_FAIL_AFTER = int(os.environ["VGRAPH_TEST_FAIL_AFTER_STEPS"])
_original_step = llm_engine.LLMEngine.step
_calls = 0


def _failing_step(self: llm_engine.LLMEngine) -> StepOutput:
    global _calls
    _calls += 1
    if _calls == _FAIL_AFTER + 1:
        raise RuntimeError("injected engine failure")
    return _original_step(self)


llm_engine.LLMEngine.step = _failing_step

if __name__ == "__main__":
    from vgraph.cli import main
    sys.exit(main())
