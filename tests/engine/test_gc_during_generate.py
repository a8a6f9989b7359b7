"""``LLM.generate`` freezes the collector for its run only (gc_tuning.frozen_for_the_run): frozen
and with a raised young threshold while it steps, as the caller had it afterwards, even when the
run fails, and untouched when the caller froze objects itself or turned the tuning off. Each case
runs in a fresh interpreter: the collector's state is process-wide."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import gc, json, sys
from vgraph import LLM, SamplingParams
llm = LLM("demo-model-v1", device="cpu", enforce_eager=True, max_model_len=128)
if sys.argv[1] == "caller-froze":
    gc.freeze()
gc.set_threshold(900, 11, 12)
before = {"frozen": gc.get_freeze_count(), "thresholds": gc.get_threshold()}
seen = []
step = llm.step
def spy():
    seen.append({"frozen": gc.get_freeze_count(), "thresholds": gc.get_threshold()})
    if sys.argv[1] == "failing" and len(seen) == 2:
        raise RuntimeError("a step failed")
    return step()
llm.step = spy
try:
    out = llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    tokens = [len(o.outputs[0].token_ids) for o in out]
except RuntimeError:
    tokens = None
print(json.dumps({"before": before, "during": seen[0], "after": {"frozen": gc.get_freeze_count(),
                  "thresholds": gc.get_threshold()}, "tokens": tokens}))
"""


def _run(case: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "VGRAPH_GC_TUNING"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True,
                         env={**clean, **env}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_generate_runs_frozen_and_leaves_the_collector_as_it_found_it():
    from vgraph.engine.gc_tuning import GEN0_THRESHOLD
    r = _run("plain")
    assert r["tokens"] == [4, 4, 4]
    assert r["before"] == {"frozen": 0, "thresholds": [900, 11, 12]}
    assert r["during"]["frozen"] > 0 and r["during"]["thresholds"] == [GEN0_THRESHOLD, 11, 12]
    assert r["after"] == r["before"]


def test_a_failing_run_still_restores_the_collector():
    r = _run("failing")
    assert r["tokens"] is None
    assert r["during"]["frozen"] > 0
    assert r["after"] == r["before"]


def test_the_callers_own_freeze_is_left_alone():
    r = _run("caller-froze")
    assert r["before"]["frozen"] > 0 and r["after"]["frozen"] > 0  # not unfrozen (frozen objects may die)
    assert r["during"]["thresholds"] == r["after"]["thresholds"] == [900, 11, 12]


def test_gc_tuning_off_leaves_generate_unfrozen():
    r = _run("plain", VGRAPH_GC_TUNING="0")
    assert r["during"] == r["before"] == r["after"]
