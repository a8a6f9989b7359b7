"""The all-reduce + RMSNorm fusion in a real TP=2 engine (two gloo ranks, compiled): every rank
fuses exactly 2 sites per layer, and the tokens are those of the unfused engine and of
transformers.

Exactly 2L per rank: each layer's o_proj all-reduce feeds its post-attention norm, and its
down_proj all-reduce feeds the next layer's input norm (the last layer's: the final norm). The
vocab-parallel embedding's all-reduce is the one left: it is the first norm's input (no
residual add) and the first residual too. One engine at a time (each is two worker processes).
"""
from __future__ import annotations

import pytest

from tests.checkpoints import tiny_checkpoint
from tests.engine.hf_oracle import hf_greedy, random_prompts
from vgraph import LLM, SamplingParams
from tests.distributed.processes import pid_alive

pytestmark = pytest.mark.slow
LAYERS, NEW_TOKENS = 2, 8
# custom_ops: the norms as vgraph ops. The CPU default builds them in plain torch and leaves them
# to Inductor, and then the pass (like the SiLU lift) leaves them too: nothing to fuse.
ENGINE = dict(dtype="float32", device="cpu", num_gpu_blocks=128, max_model_len=256, tensor_parallel_size=2,
              custom_ops=True)
PASS = "AllReduceRMSNormFusionPass"


def _run(fusion: bool, prompts: list[list[int]]) -> tuple[list[list[int]], list]:
    """Greedy tokens of a compiled TP=2 llama engine, and every rank's compile counters."""
    llm = LLM(tiny_checkpoint(arch="llama"), enable_allreduce_fusion=fusion, **ENGINE)
    pids = list(llm.engine.runner.pids)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        counters = llm.engine.runner.collect_compile_counters()
    finally:
        llm.close()
    assert not any(pid_alive(p) for p in pids), "a worker outlived LLM.close()"
    return [o.outputs[0].token_ids for o in outputs], counters


def test_tp2_fusion_on_and_off():
    prompts = random_prompts([1, 7, 33], 256, seed=3)
    fused, on = _run(True, prompts)
    unfused, off = _run(False, prompts)
    assert len(on) == len(off) == 2
    for rank, (c_on, c_off) in enumerate(zip(on, off)):
        assert c_on.pass_matches[PASS] == 2 * LAYERS, f"rank {rank}: {c_on.pass_matches}"
        assert PASS not in c_off.pass_matches, f"rank {rank}: the pass is off"
        assert c_on.recompiles == c_off.recompiles == 0
    assert fused == unfused
    path = tiny_checkpoint(arch="llama")
    for prompt, tokens in zip(prompts, fused):
        assert tokens == hf_greedy(path, tuple(prompt), NEW_TOKENS)[0]
