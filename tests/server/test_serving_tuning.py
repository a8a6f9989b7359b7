"""The serving processes' tuning: the collector frozen after startup, the OpenMP wait policy
chosen before torch loads, and the optional per-step trace of the engine loop."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys

from vgraph.engine.core_codec import SHUTDOWN
from vgraph.engine.core_loop import EngineLoop
from vgraph.engine.stats import EngineStats, EngineStep, RequestTiming


def _python(code: str, **env: str) -> str:
    """Runs ``code`` in a fresh interpreter (process-wide state stays out of this one)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "VGRAPH_GC_TUNING")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env}, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_freeze_after_startup_freezes_and_raises_the_young_threshold():
    code = ("import gc; from vgraph.engine.gc_tuning import freeze_after_startup, GEN0_THRESHOLD\n"
            "freeze_after_startup(); print(gc.get_freeze_count() > 0, gc.get_threshold()[0] == GEN0_THRESHOLD)")
    assert _python(code) == "True True"


def test_gc_tuning_off_leaves_the_collector_alone():
    code = ("import gc; from vgraph.engine.gc_tuning import freeze_after_startup\n"
            "before = gc.get_threshold(); freeze_after_startup(); print(gc.get_freeze_count(), gc.get_threshold() == before)")
    assert _python(code, VGRAPH_GC_TUNING="0") == "0 True"


class _FakeEngine:
    """Two steps of work, one request's timing each: enough to drive ``EngineLoop``."""

    def __init__(self) -> None:
        self.left = 2

    def has_unfinished_requests(self) -> bool:
        return self.left > 0

    def step(self) -> EngineStep:
        self.left -= 1
        return EngineStep([], [RequestTiming("r", 4, queue_time=0.0)], EngineStats(num_running=1))

    def stats(self) -> EngineStats:
        return EngineStats()

    def abort_all(self) -> None:
        pass


def test_step_trace_writes_one_line_per_step(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("VGRAPH_STEP_TRACE", str(path))
    steps: list[EngineStep] = []
    commands: queue.SimpleQueue = queue.SimpleQueue()
    engine = _FakeEngine()

    def stepped(step: EngineStep) -> None:
        steps.append(step)
        if not engine.has_unfinished_requests():
            commands.put((SHUTDOWN,))

    EngineLoop(engine, lambda *_: None, stepped).serve(commands)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2 == sum(1 for s in steps if s.stats.num_running == 1)
    assert all(r["start"] <= r["end"] and r["first_scheduled"] == 1 and r["running"] == 1 for r in records)


def test_step_trace_is_off_by_default(monkeypatch):
    monkeypatch.delenv("VGRAPH_STEP_TRACE", raising=False)
    loop = EngineLoop(_FakeEngine(), lambda *_: None, lambda _: None)
    assert not loop.trace.enabled


def _topology(**kwargs):
    from vgraph.engine.launch import ServingTopology
    return ServingTopology("m", {"device": "cpu", "max_num_seqs": 16, "max_num_batched_tokens": None, **kwargs})


def test_serving_on_cpu_defaults_to_the_serving_step_budget():
    from vgraph.engine.launch import SERVE_CPU_STEP_TOKENS, with_serving_defaults
    assert with_serving_defaults(_topology()).engine_kwargs["max_num_batched_tokens"] == SERVE_CPU_STEP_TOKENS


def test_the_serving_budget_holds_every_seat_and_respects_the_user():
    from vgraph.engine.launch import with_serving_defaults
    assert with_serving_defaults(_topology(max_num_seqs=3000)).engine_kwargs["max_num_batched_tokens"] == 3000
    assert with_serving_defaults(_topology(max_num_batched_tokens=777)).engine_kwargs["max_num_batched_tokens"] == 777
    whole_prompts = _topology(enable_chunked_prefill=False)
    assert with_serving_defaults(whole_prompts).engine_kwargs["max_num_batched_tokens"] is None
    gpu = _topology(device="cuda")
    assert with_serving_defaults(gpu) is gpu


def test_serving_on_cpu_prefaults_the_kv_cache_unless_told_not_to():
    """The pool hands out fresh blocks until it has used all of them once; a step reaching a
    fresh 2 MiB page in every layer waited ~100 ms for its first touch (issue 33)."""
    from vgraph.engine.launch import with_serving_defaults
    assert with_serving_defaults(_topology()).engine_kwargs["kv_cache_prefault"] is True
    assert with_serving_defaults(_topology(kv_cache_prefault=False)).engine_kwargs["kv_cache_prefault"] is False
    assert "kv_cache_prefault" not in with_serving_defaults(_topology(device="cuda")).engine_kwargs


def test_import_vgraph_chooses_an_openmp_policy_before_torch_loads():
    code = ("import os, vgraph; print(os.environ.get('GOMP_SPINCOUNT') == vgraph.omp_policy.SPIN_COUNT "
            "or os.environ.get('OMP_WAIT_POLICY') == 'PASSIVE')")
    assert _python(code) == "True"


def test_a_short_spin_on_a_quiet_machine_passive_beside_busy_neighbours():
    from vgraph.omp_policy import SPIN_COUNT, choose
    assert choose(2, 0) == {"GOMP_SPINCOUNT": SPIN_COUNT}
    assert choose(2, 1) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert choose(64, 3) == {"GOMP_SPINCOUNT": SPIN_COUNT}
    assert choose(64, 32) == {"OMP_WAIT_POLICY": "PASSIVE"}


def _task(proc, pid: int, tid: int, state: str) -> None:
    task = proc / str(pid) / "task" / str(tid)
    task.mkdir(parents=True)
    task.joinpath("stat").write_text(f"{tid} (a (busy) launcher) {state} 1 {pid} 0 0\n")


def test_other_runnable_reads_the_kernels_running_count_less_the_launchers(tmp_path):
    """The machine's running count, less this process and the threads of the process that
    launched it (busy for a moment starting its children, then waiting: no neighbour)."""
    from vgraph.omp_policy import other_runnable, running_threads
    (tmp_path / "loadavg").write_text("0.50 0.40 0.30 4/412 9999\n")
    assert other_runnable(str(tmp_path), launcher=77) == 3  # no such process: nothing to take off
    for tid, state in ((77, "R"), (78, "S"), (79, "R")):
        _task(tmp_path, 77, tid, state)
    assert running_threads(77, str(tmp_path)) == 2
    assert other_runnable(str(tmp_path), launcher=77) == 1
    assert other_runnable(str(tmp_path / "missing")) == 0


def test_the_users_openmp_policy_wins():
    code = "import os, vgraph; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    assert _python(code, OMP_WAIT_POLICY="PASSIVE") == "None PASSIVE"
    assert _python(code, GOMP_SPINCOUNT="77") == "77 None"


def test_no_policy_once_torch_is_loaded():
    from vgraph.omp_policy import apply_default
    environ: dict = {}
    assert apply_default(environ) is None and environ == {}  # this test process imported torch long ago


def test_a_token_without_text_yet_still_streams_an_event():
    """A partial UTF-8 character completes no text, but the client gets its step's event (an
    empty text delta), as from vLLM, instead of a gap spanning the run of such tokens."""
    from vgraph import SamplingParams
    from vgraph.engine.outputs import CompletionOutput, RequestOutput
    from vgraph.server.routes_completions import _Completion
    from vgraph.server.streaming import DeltaTracker
    params = SamplingParams(max_tokens=4)
    job = _Completion(None, None, "m", params, 1)
    tracker = DeltaTracker(params)
    partial = CompletionOutput(0, "", [200], None, None)
    output = RequestOutput(job.ids[0], "p", [1], [partial], False)
    chunk = job._chunk_choice(0, output, partial, tracker, {(0, 0): 0}, (0, 0))
    assert chunk is not None and chunk["text"] == "" and chunk["finish_reason"] is None
    assert job._chunk_choice(0, output, partial, tracker, {(0, 0): 0}, (0, 0)) is None  # nothing new: no event
