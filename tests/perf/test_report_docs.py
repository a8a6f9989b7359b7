"""The measured-results page's text for stand-alone A/B scripts' files: the command that wrote
each (with the options it records), and a table of its rounds or per-variant medians."""
from __future__ import annotations

import json

import pytest

from perf.report_docs import command_for, section, suite_of


def test_a_generate_ab_file_names_its_script_and_options():
    result = {"base": "abc1234", "batch": 256, "tokens": 64, "per_child": "mean call",
              "rounds": [{"base": 100.0, "this": 110.0, "load": 0.7}]}
    assert suite_of("generate-ab-cpu-x") is None
    assert command_for("generate-ab-cpu-x", result) == \
        "python -m perf.generate_ab --base abc1234 --batch 256 --tokens 64 --mean"
    assert command_for("generate-ab-cpu-y", {**result, "per_child": "best call"}).endswith("--tokens 64")


def test_a_client_ab_file_gets_its_command_and_a_row_per_client(tmp_path):
    result = {"config": {"rounds": 3, "streams": 64, "new_tokens": 128, "emulated_device_ms_per_step": 20.0},
              "medians": {"aiohttp": {"tok_s": 2893.0, "ttft_p50_ms": 272.0},
                          "httpx": {"tok_s": 2729.0, "ttft_p50_ms": 368.0}}}
    path = tmp_path / "client-ab-cpu.json"
    path.write_text(json.dumps(result))
    text = "\n".join(section(path, None))
    assert "`python -m perf.client_ab --rounds 3 --streams 64 --tokens 128 --device-ms 20`" in text
    assert "| variant | tok_s | ttft_p50_ms |" in text
    assert "| aiohttp | 2,893 | 272 |" in text and "| httpx | 2,729 | 368 |" in text


def test_a_kernel_script_keeps_its_thread_option():
    assert command_for("prefill-attention-cpu-t1", {"threads": 1}) == "python -m perf.prefill_attention_ab --threads 1"


@pytest.mark.parametrize("compared,sides,option", [
    ({"env": "VGRAPH_PDL=1"}, ("off", "on"), "--env VGRAPH_PDL=1"),
    ({"base": "1513edd"}, ("base", "this"), "--base 1513edd"),
])
def test_an_env_ab_file_gets_what_it_compared_and_a_row_per_shape(tmp_path, compared, sides, option):
    result = {"tool": "env_ab", **compared, "batch": 1,
              "shapes": {"qwen2.5-0.5b": {"median_ms": dict(zip(sides, (1.1, 0.9))), "speedup": 1.1 / 0.9,
                                          "rounds": []}}}
    path = tmp_path / "env-ab-cuda-x.json"
    path.write_text(json.dumps(result))
    text = "\n".join(section(path, None))
    assert f"`python -m perf.env_ab {option} --batch 1`" in text
    assert f"| shape | {sides[0]}_ms | {sides[1]}_ms | speedup |" in text and "| qwen2.5-0.5b | 1.1 | 0.9 | 1.222 |" in text
