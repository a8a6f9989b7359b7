"""The cpu-peers suite's own logic without installing or running any peer: the workload, the
agreement and timing arithmetic, what happens to an engine that cannot run, the results it
writes and the summary it prints."""
from __future__ import annotations

import math

import pytest

from perf.peers import envs
from perf.suites import cpu_peers
from perf.suites.cpu_peers import (FIRST_REGULAR_ID, TOKENIZER_VOCAB, Workload, agreement, make_prompts,
                                   timing_summary, workload)


def test_prompts_are_fixed_regular_ids_within_the_length_range():
    w = workload(quick=False)
    prompts = make_prompts(w)
    assert prompts == make_prompts(w)  # same draw every time, every machine
    assert len(prompts) == 64 and w.max_new_tokens == 64
    assert all(16 <= len(p) <= 256 for p in prompts)
    assert all(FIRST_REGULAR_ID <= t < TOKENIZER_VOCAB for p in prompts for t in p)
    assert sum(map(len, prompts)) == 9569
    assert make_prompts(Workload(64, 16, 256, 64, seed=1)) != prompts
    quick = workload(quick=True)
    assert (quick.num_prompts, quick.max_new_tokens) == (16, 16)


def test_agreement_counts_positions_prompts_and_prefixes():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement(reference, reference, [1, 5]) == {
        "token_agreement": 1.0, "prompts_equal": 2, "prompts": 2, "prefix_agreement": 1.0,
        "prefill_first_token_equal": 2}
    # Second prompt parts at its second token, then happens to match again at the last one.
    a = agreement([[1, 2, 3, 4], [5, 9, 9, 8]], reference, [1, 9])
    assert a["token_agreement"] == 6 / 8
    assert a["prompts_equal"] == 1
    assert a["prefix_agreement"] == pytest.approx((1.0 + 0.25) / 2)
    assert a["prefill_first_token_equal"] == 1
    assert agreement([[0, 0, 0, 0], [0, 0, 0, 0]], reference)["token_agreement"] == 0.0


def test_timing_summary_splits_prefill_and_decode_per_round():
    samples = [{"prefill_s": 2.0, "total_s": 6.0}, {"prefill_s": 1.0, "total_s": 5.0},
               {"prefill_s": 4.0, "total_s": 7.0}]
    s = timing_summary(samples, prompt_tokens=1000, num_prompts=10, max_new_tokens=65)
    assert (s["prefill_s"], s["total_s"], s["decode_s"]) == (2.0, 6.0, 4.0)  # decode: median of 4, 4, 3
    assert s["tok_s"] == {"generated": 650 / 6.0, "prefill": 500.0, "decode": 640 / 4.0}
    assert math.isnan(timing_summary([{"prefill_s": 1.0, "total_s": 1.0}], 10, 1, 2)["tok_s"]["decode"])


def _fake_result(samples: dict[str, list[dict]], tokens: dict[str, list[list[int]]]) -> dict:
    w = Workload(2, 2, 3, 2)
    prompts = [[6, 7], [8, 9, 10]]
    last = {name: {"info": {"engine": name}, "tokens": t, "first": [row[0] for row in t]} for name, t in tokens.items()}
    model = cpu_peers.MODELS[0]
    m = cpu_peers.model_result(model, "/ckpt", prompts, w, 2, samples, last,
                               {"ctranslate2": "ctranslate2: pip install failed"},
                               {"onnxruntime_genai": "failed in round 2: exit 1"})
    return {"suite": "cpu-peers", "headline": "all_cores",
            "config": {"num_prompts": 2, "min_len": 2, "max_len": 3, "max_new_tokens": 2},
            "runs": {"all_cores": {"threads": 2, "threads_setting": "default (all cores)", "models": {model.name: m}}}}


def test_results_report_rows_ratios_and_why_an_engine_is_missing():
    fast, slow = {"prefill_s": 0.5, "total_s": 1.0, "load_s": 1}, {"prefill_s": 1.0, "total_s": 2.0, "load_s": 1}
    result = _fake_result(
        {"vgraph": [fast, fast], "transformers": [slow, slow], "openvino_genai_defaults": [fast, slow],
         "onnxruntime_genai": [slow]},
        {"vgraph": [[1, 2], [3, 4]], "transformers": [[1, 2], [3, 4]], "openvino_genai_defaults": [[1, 2], [3, 9]],
         "onnxruntime_genai": [[1, 2], [3, 4]]})
    m = result["runs"]["all_cores"]["models"]["llama-24m"]
    assert list(m["systems"]) == ["vgraph", "transformers", "openvino_genai_defaults", "onnxruntime_genai"]
    assert m["ratios"]["transformers"] == {"generated": 2.0, "prefill": 2.0, "decode": 2.0}
    assert m["systems"]["openvino_genai_defaults"]["fp32"] is False
    assert m["systems"]["openvino_genai_defaults"]["agreement_vs_transformers"]["token_agreement"] == 0.75
    assert m["prompt_tokens"] == 5 and m["generated_tokens"] == 4
    text = cpu_peers.summarize(result)
    assert "openvino_genai_defaults (not fp32)" in text
    assert "skipped ctranslate2: ctranslate2: pip install failed" in text
    assert "onnxruntime_genai stopped early: failed in round 2" in text
    assert " 75.0%" in text
    fig = cpu_peers.plot(result)
    assert len(fig.axes) == 3


def test_a_peer_that_cannot_install_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("VGRAPH_PERF_PEERS_DIR", str(tmp_path))
    broken = envs.Peer("broken", ("vgraph-no-such-package==0.0.0",), lambda b, s, o: ["true"])
    monkeypatch.setattr(envs, "_run_logged", _fail_pip)
    with pytest.raises(envs.PeerUnavailable, match="pip install failed"):
        envs.ensure_venv(broken)


def _fail_pip(argv, log, timeout, what):
    if "pip" in argv:
        raise envs.PeerUnavailable(f"{what} failed (exit 1): no matching distribution")


def test_conversions_are_cached_by_checkpoint_contents(tmp_path, monkeypatch):
    monkeypatch.setenv("VGRAPH_PERF_PEERS_DIR", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    calls = []

    def convert(argv, log, timeout, what):
        calls.append(argv)
        out = argv[-1]
        import os
        os.makedirs(out)
        open(os.path.join(out, "model.bin"), "w").close()

    monkeypatch.setattr(envs, "_run_logged", convert)
    peer = envs.Peer("fake", ("x==1",), lambda b, s, o: [str(b / "convert"), s, o])
    h = envs.checkpoint_hash(str(ckpt))
    out1, cmd = envs.ensure_converted(peer, str(ckpt), h)
    out2, _ = envs.ensure_converted(peer, str(ckpt), h)
    assert out1 == out2 and len(calls) == 1 and cmd[-1] == out1
    (ckpt / "config.json").write_text('{"changed": 1}')
    out3, _ = envs.ensure_converted(peer, str(ckpt), envs.checkpoint_hash(str(ckpt)))
    assert out3 != out1 and len(calls) == 2


def test_a_row_measured_again_replaces_the_kept_one():
    fast, slow = {"prefill_s": 0.5, "total_s": 1.0, "load_s": 1}, {"prefill_s": 1.0, "total_s": 2.0, "load_s": 1}
    ref = [[1, 2], [3, 4]]
    old = _fake_result({"vgraph": [fast], "transformers": [slow]}, {"vgraph": ref, "transformers": ref})
    new = _fake_result({"onnxruntime_genai": [slow]}, {"onnxruntime_genai": ref})
    m_old = old["runs"]["all_cores"]["models"]["llama-24m"]
    m_new = new["runs"]["all_cores"]["models"]["llama-24m"]
    m_old["failures"]["onnxruntime_genai"] = "failed in round 1"
    merged = cpu_peers.merge_rows(m_old, m_new, {"onnxruntime_genai"})
    assert list(merged["systems"]) == ["vgraph", "transformers", "onnxruntime_genai"]
    assert merged["systems"]["onnxruntime_genai"]["measured_separately"] is True
    assert "onnxruntime_genai" not in merged["skipped"]
    assert merged["ratios"]["onnxruntime_genai"]["generated"] == 2.0
    assert "onnxruntime_genai" not in m_old["systems"]  # the kept result is not modified
