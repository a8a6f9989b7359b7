"""Scenarios shared by the CUDA graph tests on a GPU (test_cudagraph_gpu.py) and on CPU with
emulated graphs (test_cudagraph_emulated.py), so that the GPU tests' exact configuration also
runs in CI, where a mistake in it (a batch that does not fit the buckets it means to test)
shows without a GPU.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from tests.engine.hf_oracle import random_prompts
from vgraph import SamplingParams
from vgraph.config import CompileConfig
from vgraph.ops.forward_context import ForwardContext, set_forward_context
from vgraph.worker.dispatch import Path
from vgraph.core.outputs import ModelRunnerOutput

# The GPU tests' engine: capture sizes up to 40, so a mixed batch must stay within 40 tokens.
GPU_SIZES = [1, 2, 4, 8, 16, 24, 32, 40]
GPU_MAX_SEQS = 40
# The mixed batch of the replay test: 5 decodes + a 21-token prefill (a prompt the decoding
# sequences do not share, so no prefix-cache hit shortens it) = 26 tokens, bucket 32.
GPU_NEW_PROMPT = 9


def gpu_llm_kwargs(dtype: str, mode: str) -> dict[str, Any]:
    """The GPU tests' ``LLM`` arguments, less the device. The serial loop: the scenarios drive
    the scheduler and the runner by hand, one step at a time, and read each step's inputs (the
    overlapped loop would leave a decode's token on the device, unread; its own tests are
    tests/engine/test_overlap_cuda.py)."""
    return dict(dtype=dtype, async_scheduling=False, num_gpu_blocks=512, max_num_seqs=GPU_MAX_SEQS, max_num_batched_tokens=1024,
                compile_config=CompileConfig(cudagraph_mode=mode, cudagraph_capture_sizes=GPU_SIZES))


def gpu_prompts() -> list[list[int]]:
    return random_prompts([3, 17, 5, 30, 9, 1, 12, 40, 8, 21, 2] * 3, 512, seed=5)


def decode_state(llm, prompts: Sequence[Sequence[int]], n: int):
    """The engine after prefilling ``n`` requests: the next step is pure decode."""
    engine = llm.engine
    for i in range(n):
        engine.add_request(f"s{i}", {"prompt_token_ids": prompts[i]},
                           SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    return engine


def eager_forward(runner, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
    with set_forward_context(ForwardContext(meta, runner.kv_caches, runner.softmax_scale)):
        return runner.model(ids, positions)


def replay_equals_eager(llm, prompts: Sequence[Sequence[int]], kind: str, new_prompt: int,
                        tol: float, expected_bucket: Optional[int] = None) -> None:
    """Five sequences decoding (``kind="full"``), or those plus a prefill of
    ``prompts[new_prompt]`` (``"piecewise"``): the step runs on that path, replaying graphs,
    and its hidden states equal the eager model's on the same inputs."""
    engine = decode_state(llm, prompts, 5)
    runner = engine.runner
    try:
        if kind == "piecewise":
            engine.add_request("s-new", {"prompt_token_ids": prompts[new_prompt]},
                               SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        sched = engine.scheduler.schedule()
        step = runner.requests.apply(sched.plan)  # the runner's copies follow every plan
        graphs = runner.graphs
        misses = graphs.piecewise_graphs.misses if graphs.piecewise_graphs is not None else 0
        with torch.inference_mode():
            batch, decision = graphs.build(step)
            assert decision.path is Path(kind), (
                f"a {decision.num_tokens}-token batch took the {decision.path.value} path; buckets "
                f"{graphs.buckets}")
            if expected_bucket is not None:
                assert decision.bucket == expected_bucket, (decision, graphs.buckets)
            replayed = graphs.run(batch, decision).clone()
            if kind == "full":
                inputs = graphs.decode_buffers.fill(batch)
                eager = eager_forward(runner, inputs.input_ids, inputs.positions, inputs.attn_metadata)
            else:
                eager = eager_forward(runner, batch.input_ids, batch.positions, batch.attn_metadata)
        n = batch.num_scheduled
        torch.testing.assert_close(replayed[:n], eager[:n], rtol=tol, atol=tol)
        if graphs.piecewise_graphs is not None:
            assert graphs.piecewise_graphs.misses == misses, "every piece replayed a graph"
        engine.scheduler.update(sched, ModelRunnerOutput({s.request.request_id: 5 for s in sched.scheduled
                                                          if s.produces_token}))
    finally:
        engine.abort_request([f"s{i}" for i in range(5)] + ["s-new"])


def assert_logprobs_close(a: Sequence, b: Sequence, atol: float) -> None:
    """Two greedy runs of the same prompts (``CompletionOutput``s with logprobs) agree up to
    rounding: while their tokens agree, each step's chosen-token logprob agrees within
    ``atol``; they may part only at a near tie (both tokens within ``atol`` of each other in
    both runs' top logprobs), after which the contexts differ and comparing stops.

    Why not tokens: in bf16, padding a batch changes the GEMM's row count, cuBLAS may pick
    another kernel, and a near tie flips with the last bit."""
    assert len(a) == len(b)
    for seq, (x, y) in enumerate(zip(a, b)):
        for step, (tx, ty, lx, ly) in enumerate(zip(x.token_ids, y.token_ids, x.logprobs, y.logprobs)):
            if tx == ty:
                assert abs(lx[tx] - ly[ty]) <= atol, (
                    f"sequence {seq} step {step}: token {tx} logprob {lx[tx]:.4f} vs {ly[ty]:.4f}")
                continue
            near_tie = (ty in lx and tx in ly and abs(lx[tx] - lx[ty]) <= atol and abs(ly[tx] - ly[ty]) <= atol)
            assert near_tie, (f"sequence {seq} step {step}: tokens {tx} vs {ty} differ without a near tie "
                              f"({lx} vs {ly})")
            break


def logprobs_close(a, b, tol: float) -> bool:
    """Two runs' logprobs (a sequence's, or a prompt's with None for its first token) name the
    same tokens at every position, with values within ``tol``: batches of other row counts may
    take other matrix-product kernels, which move fp32 results by an ulp or so."""
    if a is None or b is None:
        return a is b
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is None or y is None:
            if x is not y:
                return False
        elif x.keys() != y.keys() or any(abs(_logprob(x[t]) - _logprob(y[t])) > tol for t in x):
            return False
    return True


def _logprob(value) -> float:
    """A ``Logprob``'s value, or the float itself."""
    return getattr(value, "logprob", value)
