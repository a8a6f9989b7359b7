"""On a static-fp8 Llama the passes fuse every site: 2L RMSNorm+quant and L SiLU+mul+quant."""
from __future__ import annotations

import pytest

from vgraph import LLM, SamplingParams
from vgraph.testing.checkpoints import build_tiny_fp8_static_checkpoint

LAYERS = 3  # the two middle pieces are identical graphs: counts must still be per site


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """Under pytest's temp root (pruned by pytest), not a bare mkdtemp left in /tmp per run."""
    return build_tiny_fp8_static_checkpoint(tmp_path_factory.mktemp("fp8-static"), seed=0, num_layers=LAYERS)


@pytest.fixture(scope="module")
def fused_llm(checkpoint) -> LLM:
    return LLM(checkpoint, dtype="float32", device="cpu", num_gpu_blocks=64)


def test_pass_matches_are_exactly_2L_and_L(fused_llm):
    counters = fused_llm.engine.runner.compile_counters
    assert counters.pass_matches == {"RMSNormQuantFusionPass": 2 * LAYERS, "SiluMulFusionPass": LAYERS,
                                     "AllReduceRMSNormFusionPass": 0,  # one process: no all-reduce
                                     "NormLinearFusionPass": 0}  # fp8 projections, and CPU: no vgraph::linear
    assert counters.pieces == 2 * LAYERS + 1


def test_fused_model_generates_the_eager_tokens(fused_llm, checkpoint):
    eager = LLM(checkpoint, dtype="float32", device="cpu", num_gpu_blocks=64, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 33, 81, 120, 7, 9], list(range(10, 50))]
    fused = [o.outputs[0].token_ids for o in fused_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    plain = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert fused == plain


def test_warm_start_reports_the_same_matches(fused_llm, checkpoint):
    again = LLM(checkpoint, dtype="float32", device="cpu", num_gpu_blocks=64)
    assert again.engine.runner.compile_counters.inductor_compilations == 0
    assert again.engine.runner.compile_counters.pass_matches == fused_llm.engine.runner.compile_counters.pass_matches
