"""The KV pool is not zeroed on CUDA (worker/kv_sizing.py, ``allocate_kv_caches``): this
holds only if no attention kernel ever reads a slot that no step has written. Here the pool
starts full of NaN, which any such read would spread into the logits (a masked-off NaN
times a zero weight is still NaN), and the engine must give the same greedy tokens as over
a zeroed pool: prefills of several lengths in one batch, chunked prefill, decode, and
prefix-cache hits that attend to blocks an earlier request wrote."""
from __future__ import annotations

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.worker import kv_sizing, runner

SHARED = list(range(300, 460))  # longer than a CPU block (128 tokens): a cached full block
PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 75)), [7], SHARED + [1, 2, 3], SHARED + [9]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(**engine) -> list[list[int]]:
    llm = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=64,
              max_num_batched_tokens=96, max_num_seqs=4, enforce_eager=True, **engine)
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], PARAMS, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": PROMPTS[4]}], PARAMS, use_tqdm=False)  # a prefix-cache hit
    return [list(o.outputs[0].token_ids) for o in [*first, *again]]


def _garbage_pools(spec, num_blocks, device, prefault=False):
    pools = kv_sizing.allocate_kv_caches(spec, num_blocks, device, prefault)
    for k, v in pools:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    return pools


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_a_pool_full_of_nan_gives_the_same_tokens(attention, monkeypatch):
    """``native``: the C++ kernels; ``torch``: the SDPA routes (VGRAPH_CPU_ATTENTION=torch)."""
    if attention == "torch":
        monkeypatch.setenv("VGRAPH_CPU_ATTENTION", "torch")
    clean = _tokens()
    monkeypatch.setattr(runner, "allocate_kv_caches", _garbage_pools)
    garbage = _tokens()
    assert all(len(t) == PARAMS.max_tokens for t in garbage)
    assert garbage == clean
