"""``vgraph.passes.report`` / ``vgraph passes report`` end to end on the demo model and the
tiny test checkpoints (short configurations), its numbers checked against direct
measurements: matches against the pass manager's and the engine's counts, the logit
difference against one computed here from the two compiled engines' logits, greedy
agreement against the engines' own generations."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import vgraph.passes
from tests.checkpoints import tiny_checkpoint
from vgraph import SamplingParams, cli
from vgraph.worker.dummy import prefill_step

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "user_pass.py"
SHORT = dict(tokens=4, repeats=1, decode_sizes=(1, 8), prefill_tokens=32, device="cpu")


@pytest.fixture(scope="module")
def lifted(tmp_path_factory):
    """The demo model with plain-torch norms and quant, the example's lifting passes (given as
    file specs) before vgraph's, and one static compile size: the "with" variant computes
    the norms and quant in vgraph's ops, so its logits differ slightly from Inductor's."""
    out = tmp_path_factory.mktemp("report-demo")
    return vgraph.passes.report("demo-model-v1", [f"{EXAMPLE}:PlainRMSNormPass", f"{EXAMPLE}:PlainDynamicQuantPass"],
                                out=out, keep_engines=True, custom_ops=False, quantization="fp8",
                                compile_sizes=[4], **SHORT)


def logits_by_hand(llm, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt position's logits from one prefill step through the engine's runner."""
    runner = llm.engine.runner
    step = prefill_step(prompts, runner.spec.block_size, runner.num_blocks,
                        SamplingParams(temperature=0.0, max_tokens=1), "by-hand")
    with torch.inference_mode():
        batch, decision = runner.graphs.build(step)
        batch = replace(batch, output_rows=None)  # every row's hidden state, not the sampled rows'
        return runner.model.compute_logits(runner.graphs.run(batch, decision)).float()


def test_matches_equal_the_managers_and_the_engines_counts(lifted):
    data = lifted.data
    engine = lifted.llms["with"].engine.runner
    manager = engine.graphs.forward_fn.backend.post_grad_pass
    per_pass = data["matches"]["per_pass"]
    assert {k: v["distinct_graphs"] for k, v in per_pass.items()} == manager.match_counts()
    assert {k: v["piece_instances"] for k, v in per_pass.items()} == engine.compile_counters.pass_matches
    assert data["config"]["run_order"] == ["PlainRMSNormPass", "PlainDynamicQuantPass", "RMSNormQuantFusionPass",
                                           "SiluMulFusionPass", "AllReduceRMSNormFusionPass",
                                           "NormLinearFusionPass"]
    # demo model, L = 4 layers: 2L+1 norms, 4 quantized projections per layer, 2L norm+quant
    # sites; the identical middle layers compile once, so distinct graphs hold 4 sites per size
    assert {k: v["piece_instances"] for k, v in per_pass.items()} == {
        "PlainRMSNormPass": 9, "PlainDynamicQuantPass": 16, "RMSNormQuantFusionPass": 8, "SiluMulFusionPass": 0,
        "AllReduceRMSNormFusionPass": 0, "NormLinearFusionPass": 0}
    assert per_pass["RMSNormQuantFusionPass"]["by_size"] == {"dynamic": 4, "4": 4}  # distinct graphs
    assert data["matches"]["per_pattern"]["RMSNormQuantFusionPass"] == {
        "rms_norm_dynamic_per_token_fp8_quant": {"distinct_graphs": 8, "piece_instances": 8}}
    baseline = lifted.llms["without"].engine.runner.compile_counters.pass_matches
    assert set(baseline) == {"observe_post_grad_graph"} and data["compile"]["without"]["engine_pass_matches"] == {}


def test_logit_difference_equals_one_computed_by_hand(lifted):
    numerics = lifted.data["numerics"]
    assert list(numerics) == ["float32"], "the demo model is float32: one dtype"
    n = numerics["float32"]
    with_, without = (logits_by_hand(lifted.llms[v], n["prompts"]) for v in ("with", "without"))
    assert with_.shape == (sum(map(len, n["prompts"])), lifted.llms["with"].engine.vocab_size)
    diff = (with_.double() - without.double()).abs()
    assert n["logits"]["max_abs"] == pytest.approx(diff.max().item(), rel=1e-12, abs=0)
    assert n["logits"]["max_rel"] == pytest.approx(diff.max().item() / without.double().abs().max().item(), rel=1e-12)
    assert 0 < n["logits"]["max_abs"] < 1e-3, "vgraph's ops round differently from Inductor's loops, slightly"


def test_greedy_agreement_equals_the_engines_generations(lifted):
    greedy = lifted.data["numerics"]["float32"]["greedy"]
    params = SamplingParams(temperature=0.0, max_tokens=greedy["tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in lifted.data["numerics"]["float32"]["prompts"]]
    for variant in ("with", "without"):
        outs = lifted.llms[variant].generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == greedy[variant]
    same = sum(a == b for a, b in zip(greedy["with"], greedy["without"]))
    assert greedy["identical"] == same and greedy["sequences"] == 3


def test_graph_diffs_kernels_times_and_files(lifted):
    data, out = lifted.data, lifted.out_dir
    first = data["graphs"][0]
    assert (first["piece"], first["size"]) == (0, "dynamic")
    fusion = next(s for s in first["steps"] if s["pass"] == "RMSNormQuantFusionPass")
    assert fusion["ops_changed"]["vgraph.rms_norm_dynamic_per_token_fp8_quant.default"] == [0, 1]
    assert fusion["removed"] == {"vgraph.rms_norm.default": 1, "vgraph.dynamic_per_token_scaled_fp8_quant.default": 1}
    diff = (out / "graphs" / "with" / fusion["diff"]).read_text()
    assert "+    rms_norm_dynamic_per_token_fp8_quant_default = torch.ops.vgraph.rms_norm_dynamic_per_token_fp8_quant.default(" in diff
    assert {(r["piece"], r["size"]) for r in data["graphs"]} >= {(0, "dynamic"), (0, "4")}
    piece0 = next(r for r in data["kernels"]["pieces"] if (r["piece"], r["size"]) == (0, "dynamic"))
    assert "vgraph.rms_norm_dynamic_per_token_fp8_quant" in piece0["with"]["custom_ops"]
    assert not piece0["without"]["custom_ops"].keys() - {"vgraph.fp8_gemm", "vgraph.packed_linear"}, \
        "without passes Inductor generates the norm and the quant itself"
    assert piece0["without"]["fused_count"] >= 1
    assert set(data["step_times"]) == {"decode-1", "decode-8", "prefill-32"}
    for row in data["step_times"].values():
        assert all(row["variants"][v]["median_ms"] > 0 for v in ("with", "without"))
    assert json.loads(lifted.json_path.read_text())["matches"] == data["matches"]
    md = lifted.markdown_path.read_text()
    for heading in ("## Summary", "## Matches", "## Numerics", "## Step time", "## Inductor kernels per piece",
                    "## Graph diff per piece"):
        assert heading in md


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_report_on_test_checkpoints(arch, tmp_path):
    """Custom ops with dynamic fp8: the one fusable site is layer 0's input norm (the others
    are fused_add_rms_norm, which has no dynamic-quant fused op)."""
    result = vgraph.passes.report(tiny_checkpoint(arch=arch), out=tmp_path, custom_ops=True, quantization="fp8",
                                  tokens=2, repeats=1, decode_sizes=(2,), prefill_tokens=None, device="cpu")
    per_pass = result.data["matches"]["per_pass"]
    assert {k: v["piece_instances"] for k, v in per_pass.items()} == result.data["compile"]["with"]["engine_pass_matches"]
    assert per_pass["RMSNormQuantFusionPass"]["piece_instances"] == 1
    assert result.data["numerics"]["float32"]["logits"]["max_abs"] == 0, "the fused op is the unfused sequence"
    assert result.markdown_path.is_file()


def test_cli_report_on_the_llama_checkpoint_with_a_file_pass(tmp_path, capsys):
    out = tmp_path / "report"
    code = cli.main(["passes", "report", tiny_checkpoint(arch="llama"), "--device", "cpu", "--custom-ops",
                     "--quantization", "fp8", "--pass", f"after:{EXAMPLE}:count_vgraph_ops", "--tokens", "2",
                     "--repeats", "1", "--decode-sizes", "2", "--prefill-tokens", "0", "--out", str(out),
                     "--log-level", "WARNING"])
    printed = capsys.readouterr().out
    assert code == 0
    data = json.loads((out / "report.json").read_text())
    assert data["config"]["run_order"] == ["RMSNormQuantFusionPass", "SiluMulFusionPass", "AllReduceRMSNormFusionPass",
                                           "NormLinearFusionPass", "count_vgraph_ops"]
    assert data["matches"]["per_pass"]["RMSNormQuantFusionPass"]["piece_instances"] == 1
    assert "RMSNormQuantFusionPass=1 sites" in printed and str(out / "report.md") in printed
    assert set(data["step_times"]) == {"decode-2"}
