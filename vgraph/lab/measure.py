"""Measurements on built engines: logits on a fixed batch, greedy tokens, step times per bucket.

Every function takes engines (``LLM`` objects) keyed by variant name and treats them alike, so
a report compares two variants and the fusion study three or more with the same code. Steps
are built by each runner's own batch builder and run on its dispatcher's path (as a served
step would run, padding included), and timed interleaved, rotating the order each round, so
drift on a shared machine hits every variant alike.

The logits batch and the timing batches write KV into the engine's cache blocks directly,
outside the block pool; engines built for measurement disable prefix caching, so no cached
prefix can be overwritten.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from ..config import resolve_device
from ..sampling_params import SamplingParams
from ..worker.dummy import dummy_decode, dummy_prefill, prefill_step
from ..worker.runner_requests import RunnerStep

FIRST_REGULAR_ID = 6  # ids below are the demo tokenizer's special tokens; harmless elsewhere
PROMPT_LENGTHS = (5, 11, 17)  # the fixed batch: three prompts, none a multiple of a block
DECODE_CONTEXT = 64  # cached tokens per sequence in the decode buckets


def fixed_prompts(vocab_size: int, lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Deterministic prompts (token ids) of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    high = max(FIRST_REGULAR_ID + 1, vocab_size)
    return [torch.randint(FIRST_REGULAR_ID, high, (n,), generator=gen).tolist() for n in lengths]


def prefill_batch(prompts: list[list[int]], block_size: int) -> RunnerStep:
    """One step that prefills every prompt, each over its own blocks from block 0 on."""
    num_blocks = sum(-(-len(ids) // block_size) for ids in prompts)
    return prefill_step(prompts, block_size, num_blocks, SamplingParams(temperature=0.0, max_tokens=1), "lab")


@torch.inference_mode()
def prompt_logits(llm: Any, prompts: list[list[int]]) -> torch.Tensor:
    """float32 logits of every prompt position [sum(len), vocab], prompts concatenated in order:
    one prefill step of the whole batch through the engine's compiled (or eager) forward."""
    runner = llm.engine.runner
    batch, decision = runner.graphs.build(prefill_batch(prompts, runner.spec.block_size))
    batch = replace(batch, output_rows=None)  # every row's logits, not only the sampled rows'
    hidden = runner.graphs.run(batch, decision)
    return runner.model.compute_logits(hidden).float().clone()


def logit_difference(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """max |a - b|, that over max |b| (relative to the reference's largest logit: an
    elementwise ratio would blow up at logits near zero), and the mean |a - b|."""
    diff = (logits.double() - reference.double()).abs()
    scale = reference.double().abs().max().item()
    return {"max_abs": diff.max().item(), "max_rel": diff.max().item() / scale if scale else 0.0,
            "mean_abs": diff.mean().item(), "argmax_agreement": _argmax_agreement(logits, reference)}


def _argmax_agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of positions whose top token is the same."""
    return (logits.argmax(-1) == reference.argmax(-1)).double().mean().item()


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """N greedy tokens per prompt, end-of-sequence ignored."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def token_agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Per prompt the length of the prefix both agree on; overall the fraction of tokens
    before the first divergence, and how many sequences are identical."""
    prefixes = [_common_prefix(a, b) for a, b in zip(tokens, reference)]
    total = sum(len(b) for b in reference)
    return {"prefix_lengths": prefixes, "agreement": sum(prefixes) / total if total else 1.0,
            "identical": sum(a == b for a, b in zip(tokens, reference)), "sequences": len(reference)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------- step times


@dataclass(frozen=True)
class Bucket:
    """A step to time: ``decode`` of ``size`` sequences (DECODE_CONTEXT cached tokens each), or
    one ``prefill`` of ``size`` tokens."""

    kind: str
    size: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.size}"

    def blocks(self, block_size: int) -> int:
        """KV blocks the step touches (the engine needs at least this many)."""
        if self.kind == "decode":
            return self.size * -(-(DECODE_CONTEXT + 1) // block_size)
        return -(-self.size // block_size)


def buckets(decode_sizes: tuple[int, ...], prefill_tokens: Optional[int]) -> list[Bucket]:
    out = [Bucket("decode", n) for n in decode_sizes]
    if prefill_tokens:
        out.append(Bucket("prefill", prefill_tokens))
    return out


def step_fn(llm: Any, bucket: Bucket) -> Callable[[], torch.Tensor]:
    """One step of the bucket as the runner runs it, minus the sampler: build once, then
    forward on the dispatcher's path and the logits of the sampled rows."""
    runner = llm.engine.runner
    block_size, blocks = runner.spec.block_size, runner.num_blocks
    if bucket.kind == "decode":
        sched = dummy_decode(bucket.size, DECODE_CONTEXT, block_size, blocks, FIRST_REGULAR_ID)
    else:
        sched = dummy_prefill([bucket.size], block_size, blocks)
    batch, decision = runner.graphs.build(sched)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        hidden = batch.sampled_hidden(runner.graphs.run(batch, decision))
        return runner.model.compute_logits(hidden)
    return step


def time_interleaved(steps: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2,
                     target_seconds: float = 0.02) -> dict[str, dict[str, Any]]:
    """Per variant: ``repeats`` samples (seconds per call, each the mean of enough back-to-back
    calls to last about ``target_seconds``) taken in rotating order, their median and their
    minimum (on a shared machine, the least disturbed sample)."""
    inner = {}
    for name, fn in steps.items():
        for _ in range(warmup):
            fn()
        start = time.perf_counter()
        fn()
        once = max(time.perf_counter() - start, 1e-6)
        inner[name] = max(1, min(200, int(target_seconds / once)))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            _sync()
            start = time.perf_counter()
            for _ in range(inner[name]):
                steps[name]()
            _sync()
            samples[name].append((time.perf_counter() - start) / inner[name])
    return {name: {"median_ms": statistics.median(s) * 1e3, "min_ms": min(s) * 1e3,
                   "samples_ms": [x * 1e3 for x in s], "calls_per_sample": inner[name]}
            for name, s in samples.items()}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def step_times(llms: dict[str, Any], bucket_list: list[Bucket], repeats: int,
               target_seconds: float = 0.02) -> dict[str, dict[str, Any]]:
    """Per bucket name: each variant's timing (``time_interleaved``)."""
    out = {}
    for bucket in bucket_list:
        steps = {name: step_fn(llm, bucket) for name, llm in llms.items()}
        out[bucket.name] = {"kind": bucket.kind, "size": bucket.size,
                            "variants": time_interleaved(steps, repeats, target_seconds=target_seconds)}
    return out


def warm_inductor(device: str = "auto") -> None:
    """Compiles a small function once on ``device``, so the process's one-time Inductor start-up
    (the C++ toolchain, or Triton's) is not charged to whichever variant compiles first."""
    device = resolve_device(device)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) * x.pow(2).mean(-1, keepdim=True).rsqrt()
    torch.compile(f, dynamic=False)(torch.randn(4, 8, device=device))
