"""Where a decode step's time goes: ``python -m perf.profile_step [--device cuda] [--shape NAME]
[--batch N] [--out DIR]``.

Why: the e2e suite says how long a step takes; this says why. On a GPU a step is host work
(schedule, batch build, launches, sampling, reading the ids, outputs) and device work (the
graph replay, the sampler's kernels); the overlapped loop hides the host only up to the
device's time. Printed and written under ``--out``:

- ms per decode step of ``LLM.generate`` with the overlapped loop and the serial one
  (prompt 128, 128 new tokens, greedy, ``ignore_eos``; medians of rounds);
- device busy time per step (the sum of the device's kernel and copy times over a profiled
  generate, per step), next to the step time: step - device is the host's share the device waits;
- the host's Python profile of one generate (cProfile, top functions by own time);
- torch.profiler's operator table (host and device time per op).

Shapes as perf/suites/decode.py (random weights, bf16, on CUDA); on CPU the perf checkpoint.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .suites.decode import CPU_SHAPE, build_llm, write_model_dir

PROMPT_LEN, NEW_TOKENS, ROUNDS = 128, 128, 3


def generate(llm, batch: int, new_tokens: int) -> None:
    from vgraph import SamplingParams
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(vocab // 8, vocab // 2, (PROMPT_LEN,), generator=g).tolist()}
               for _ in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)


def ms_per_step(llm, batch: int, device: str) -> float:
    """(full generate - prefill-only generate) / (new tokens - 1), median of rounds."""
    def timed(n: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        generate(llm, batch, n)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start
    samples = [(timed(NEW_TOKENS) - timed(1)) / (NEW_TOKENS - 1) * 1e3 for _ in range(ROUNDS)]
    return statistics.median(samples)


def device_ms_per_step(llm, batch: int, device: str, out: Path) -> float:
    """Device busy time of a profiled generate per step, and the operator table."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        generate(llm, batch, NEW_TOKENS)
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    (out / "torch_ops.txt").write_text(events.table(sort_by=sort, row_limit=60))
    if device != "cuda":
        return float("nan")
    busy_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    return busy_us / 1e3 / NEW_TOKENS


def python_profile(llm, batch: int, out: Path) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    generate(llm, batch, NEW_TOKENS)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
    (out / "python_profile.txt").write_text(text.getvalue())
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.profile_step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default=None, help="decode.py shape (default: qwen2.5-0.5b on CUDA)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("profile-step-out"))
    args = parser.parse_args(argv)
    shape = args.shape or ("qwen2.5-0.5b" if args.device == "cuda" else CPU_SHAPE)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    with tempfile.TemporaryDirectory(prefix="vgraph-profile-") as tmp:
        dummy = shape != CPU_SHAPE
        if dummy:
            path = write_model_dir(os.path.join(tmp, shape), shape)
        else:
            from vgraph.testing.checkpoints import build_perf_checkpoint
            path = build_perf_checkpoint(os.path.join(tmp, shape), seed=0)
        for overlap in (True, False):
            llm, _ = build_llm(path, args.device, 64, {"async_scheduling": overlap}, dummy)
            generate(llm, args.batch, 8)  # warm
            step = ms_per_step(llm, args.batch, args.device)
            name = "overlapped" if overlap else "serial"
            lines.append(f"{shape} batch {args.batch} {name}: {step:.3f} ms/step")
            if overlap:
                busy = device_ms_per_step(llm, args.batch, args.device, args.out)
                lines.append(f"  device busy per step (profiled generate): {busy:.3f} ms")
                python_profile(llm, args.batch, args.out)
            llm.close()  # its step thread too: left running it would hold a core
            del llm
            torch._dynamo.reset()
    summary = "\n".join(lines)
    (args.out / "summary.txt").write_text(summary + "\n")
    print(summary)
    print((args.out / "python_profile.txt").read_text()[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
