"""The fusion study's own logic (perf/suites/fusion_study.py) without running it: its summary
arithmetic, and the static fp8 checkpoints it builds for families the tests did not cover
(tied embeddings, Mistral) load and generate."""
from __future__ import annotations

import pytest

from perf.suites.fusion_study import CONFIGS, build_checkpoint, summary_table
from vgraph import LLM, SamplingParams


def _case(family: str, ms: dict[str, float]) -> dict:
    variants = {name: {"median_ms": t, "min_ms": t / 2} for name, t in ms.items()}
    config = {"kernels": {"generated_per_forward": 3, "custom_op_calls_per_forward": 5},
              "vs_eager": {"logits": {"max_abs": 1e-6}, "greedy": {"agreement": 1.0}}, "pass_matches": {}}
    return {"family": family, "precision": "fp32", "configs": {name: config for name in CONFIGS},
            "step_times": {"decode-1": {"variants": variants}}}


def test_summary_is_the_median_ratio_to_ops_and_passes():
    rows = [_case("a", {"ops+passes": 2.0, "inductor": 1.0, "ops": 2.0}),
            _case("b", {"ops+passes": 1.0, "inductor": 2.0, "ops": 1.5}),
            _case("c", {"ops+passes": 1.0, "inductor": 0.8, "ops": 1.0})]
    s = summary_table(rows)["fp32"]
    assert s["inductor"]["time_vs_ops_passes_median"] == {"decode-1": 0.8}
    assert s["ops"]["time_vs_ops_passes_median"] == {"decode-1": 1.0}
    assert s["ops+passes"]["time_vs_ops_passes_min"] == {"decode-1": 1.0}
    assert s["ops"]["generated_kernels_per_forward"] == {"a": 3, "b": 3, "c": 3}


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_static_fp8_checkpoints_of_other_families_load_and_generate(family, tmp_path):
    path, extra = build_checkpoint(tmp_path, family, "fp8-static")
    assert extra == {}
    llm = LLM(path, enforce_eager=True, device="cpu", num_gpu_blocks=16)
    model = llm.engine.runner.model
    assert "Fp8MergedLinear" in {type(m).__name__ for m in model.modules()}
    assert all(m.input_scale is not None for m in model.modules() if type(m).__name__.startswith("Fp8"))
    out = llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
