"""The tiny Llama engine and greedy prompts the warm-start tests share (captured graphs,
runnables): each test compares a warm start's tokens with a cold start's."""
from __future__ import annotations

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 75)), [7]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", num_gpu_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)


def engine() -> LLM:
    return LLM(tiny_checkpoint(arch="llama"), **ENGINE)


def tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
