"""The tiny Llama engine and greedy prompts the compiled-forward tests share (captured graphs,
runnables, the row-wise tail): each test compares a warm start's tokens with a cold start's,
or the compiled engine's with the eager one's."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams
from vgraph.compiler.piece import PieceRunner

PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 75)), [7]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", num_gpu_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)


def engine(**overrides: Any) -> LLM:
    return LLM(tiny_checkpoint(arch="llama"), **{**ENGINE, **overrides})


def tokens(llm: LLM, prompts: list[list[int]] = PROMPTS, params: SamplingParams = PARAMS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def cold_start(tmp_path_factory: Any, name: str) -> tuple[LLM, Path]:
    """A compiled engine started into an empty cache dir of its own, and that dir (the
    environment points there only while the engine starts)."""
    root = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VGRAPH_CACHE_DIR", str(root))
        return engine(), root


def piece_runners(llm: LLM) -> list[PieceRunner]:
    """The compiled pieces of the engine's forward, in the split's order."""
    split = llm.engine.runner.graphs.forward_fn.forward.split
    return [m for m in split.children() if isinstance(m, PieceRunner)]
