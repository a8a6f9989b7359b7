"""The e2e suite's own logic without a GPU, a model or a server: which shapes and sizes each
mode runs, the step arithmetic, interleaved timing over stub systems, the results it writes
(measurements stubbed) and the targets' pass/fail in its summary."""
from __future__ import annotations

import pytest

from perf.suites import e2e


@pytest.fixture(autouse=True)
def _no_shape_overrides(monkeypatch):
    monkeypatch.delenv("PERF_DECODE_SHAPES", raising=False)
    monkeypatch.delenv("PERF_DECODE_LAYERS", raising=False)


def test_plans_quick_cuda_runs_8b_first_at_batch_1_and_64_and_64_streams():
    quick, layers = e2e.plans("cuda", quick=True)
    assert layers is None
    assert [p.shape for p in quick] == ["llama3-8b", "qwen2.5-0.5b"]
    assert (quick[0].batches, quick[0].streams) == ((1, 64), (64,))
    assert (quick[1].batches, quick[1].streams) == (e2e.BATCHES, e2e.STREAMS)
    full, _ = e2e.plans("cuda", quick=False)
    assert all(p.batches == (1, 16, 64) and p.streams == (1, 64) for p in full)
    assert all((p.prompt_len, p.new_tokens) == (128, 128) for p in full)
    cpu, _ = e2e.plans("cpu", quick=True)
    assert [p.shape for p in cpu] == [e2e.CPU_SHAPE]


def test_cell_takes_the_decode_step_from_full_minus_prefill():
    plan = e2e.Plan("x", (4,), (), (), prompt_len=10, new_tokens=11)
    samples = [{"prefill_s": 1.0, "total_s": 2.0}, {"prefill_s": 1.0, "total_s": 3.0}, {"prefill_s": 2.0, "total_s": 4.0}]
    c = e2e.cell(samples, 4, plan, weights=10**9, copy_gbs=100.0)
    assert c["ms_per_step"] == pytest.approx(2.0 / 10 * 1e3)  # median of 1, 2, 2 over 10 decode steps
    assert c["tok_s"] == pytest.approx(44 / 3.0)
    assert c["copy_fraction"] == pytest.approx(1.0 / 0.2 / 100.0)  # 1 GB in 0.2 s over 100 GB/s


def test_interleaved_times_prefill_and_full_of_each_system_and_checks_lengths():
    plan = e2e.Plan("x", (2,), (), (), prompt_len=3, new_tokens=4)
    calls = {"a": lambda new: [[7] * new] * 2, "b": lambda new: [[8] * new] * 2}
    samples, tokens = e2e.interleaved(calls, plan, 2, "cpu", rounds=3)
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3}
    assert set(samples["a"][0]) == {"prefill_s", "total_s"}
    assert tokens == {"a": [[7] * 4] * 2, "b": [[8] * 4] * 2}
    with pytest.raises(RuntimeError, match="expected 4"):
        e2e.interleaved({"short": lambda new: [[1] * (new - 1 or 1)]}, plan, 1, "cpu", rounds=1)


def _system(ms: float, tok_s: float, fraction: float) -> dict:
    return {"ms_per_step": ms, "tok_s": tok_s, "copy_fraction": fraction}


def _stub_shape(plan, device, layers, tmp, copy_gbs):
    """run_shape's result layout, with the 8B numbers on both sides of the targets."""
    fast = plan.shape == "llama3-8b"
    offline = [{"batch": b, "async_sync_tokens_equal": True,
                "systems": {"vgraph_async": _system(4.0 if fast else 0.7, 250.0, 0.9),
                            "vgraph_sync": _system(5.0, 200.0, 0.7), "hf_eager": _system(88.0, 11.0, 0.05)}}
               for b in plan.batches]
    served = [{"streams": c, "systems": {"vgraph_async": _system(9.0, 7100.0, 0.4),
                                         "vgraph_sync": _system(11.0, 5500.0, 0.3)}} for c in plan.streams]
    return {"plan": e2e.asdict(plan), "weights_bytes": 16 * 10**9, "load_format": "dummy", "offline": offline,
            "served": served}


def test_run_writes_rows_per_shape_and_checks_the_targets(monkeypatch, tmp_path):
    monkeypatch.setattr(e2e, "run_shape", _stub_shape)
    monkeypatch.setattr(e2e, "add_peers", lambda *args: None)
    monkeypatch.setattr(e2e, "copy_bandwidth_gbs", lambda device: 4230.0)
    monkeypatch.setattr("perf.timing.RESULTS_DIR", tmp_path)
    result = e2e.run("cuda", quick=True)
    assert (tmp_path / "e2e-cuda-quick-partial.json").is_file()  # written after each shape
    assert list(result["shapes"]) == ["llama3-8b", "qwen2.5-0.5b"]
    t = result["target"]
    assert t["llama3-8b batch 1 <= 4.4 ms/step"]["met"] is True
    assert t["llama3-8b batch 1 >= 86% of copy bandwidth"]["met"] is True
    assert t["qwen2.5-0.5b batch 1 <= 0.6 ms/step"]["met"] is False
    assert t["llama3-8b served 64 streams >= 7000 output tok/s"] == {
        "met": True, "system": "vgraph_async", "measured": 7100.0, "bound": 7000.0, "vgraph_sync measured": 5500.0}
    text = e2e.summarize(result)
    assert "target qwen2.5-0.5b batch 1 <= 0.6 ms/step: NOT MET" in text
    assert "target llama3-8b served 64 streams >= 7000 output tok/s: MET" in text
    assert "offline      1 vgraph_async           4.000" in text
    figures = e2e.headline_figures(result)
    assert figures["llama3-8b served 64 vgraph_sync ms/step"] == 11.0

    cpu = e2e.targets("cpu", result["shapes"], reduced=False)
    assert all(v["met"] is None for v in cpu.values())  # the targets are the GPU's
    assert all(v["met"] is None for v in e2e.targets("cuda", result["shapes"], reduced=True).values())


def test_a_failing_peer_or_server_keeps_the_vgraph_rows(monkeypatch, tmp_path):
    plan = e2e.Plan("qwen2.5-0.5b", (1, 2), (1,), (1,), prompt_len=4, new_tokens=3)
    rows = {b: {n: _system(1.0, 2.0, 0.5) for n in e2e.VGRAPH} for b in plan.batches}
    tokens = {b: {n: [[9, 9, 9]] * b for n in e2e.VGRAPH} for b in plan.batches}
    monkeypatch.setattr(e2e, "vgraph_offline", lambda *a: {"rows": rows, "tokens": tokens, "weights_bytes": 10,
                                                           "build_s": {}, "interleaved": True})

    def broken(*args):
        raise RuntimeError("vgraph serve exited with 1")

    monkeypatch.setattr(e2e, "hf_offline", lambda *a: {"build_s": 1.0, "static_compiled": False,
                                                       "rows": {1: {"hf_eager": _system(9.0, 1.0, 0.1)}}})
    monkeypatch.setattr(e2e, "served", broken)
    shape = e2e.run_shape(plan, "cpu", 1, str(tmp_path), copy_gbs=10.0)
    assert list(shape["offline"][0]["systems"]) == ["vgraph_async", "vgraph_sync"]  # peers come later
    e2e.add_peers(shape, plan, "cpu", 1, str(tmp_path), copy_gbs=10.0)
    assert shape["errors"] == {"served": "RuntimeError: vgraph serve exited with 1"}
    assert shape["served"] == []
    assert list(shape["offline"][0]["systems"]) == ["vgraph_async", "vgraph_sync", "hf_eager"]
    assert list(shape["offline"][1]["systems"]) == ["vgraph_async", "vgraph_sync"]
    assert all(row["async_sync_tokens_equal"] for row in shape["offline"])
    result = {"config": {"dtype": "float32", "device": "cpu"}, "bandwidth": {"copy_gbs": 10.0},
              "shapes": {plan.shape: shape}, "target": e2e.targets("cpu", {plan.shape: shape}, reduced=True)}
    text = e2e.summarize(result)
    assert "served: FAILED, not measured: RuntimeError: vgraph serve exited with 1" in text
    assert "hf_static_compile: generate() compiled no forward" in text


def test_step_summary_splits_decode_and_prefill_steps(tmp_path):
    import json
    trace = tmp_path / "steps.jsonl"
    steps = [(0.0, 0.010, 1), (0.010, 0.012, 0), (0.013, 0.015, 0), (0.015, 0.017, 0)]
    trace.write_text("".join(json.dumps({"start": a, "end": b, "first_scheduled": f}) + "\n" for a, b, f in steps))
    out = e2e.step_summary(str(trace))
    assert out["steps"] == 4 and not trace.exists()
    assert out["prefill"]["steps"] == 1 and out["decode"]["steps"] == 3
    assert abs(out["decode"]["p50_ms"] - 2.0) < 1e-9 and abs(out["busy_fraction"] - 16 / 17) < 1e-9
    assert "decode 3 (p50 2.00" in e2e.step_line(out)
