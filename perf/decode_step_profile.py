"""``python -m perf.decode_step_profile [--model NAME] [--batch N] [--threads N] [--profile]
[--root DIR]``:
one decode step of a cpu-peers checkpoint (perf/suites/cpu_peers.py; the Qwen2.5-0.5B-shaped
model unless ``--model llama-24m``) at batch 64 (``--batch``; the served CPU run keeps 16) with 192 prompt tokens per sequence, timed step by step through the engine, and with ``--profile`` the
torch.profiler split of 6 steps by op (self CPU ms per step): packed_linear (the projections),
aten::mm (a tied lm_head on BLAS before it had a kernel), paged_attention, the compiled graphs
(norms, RoPE, SiLU), the sampler's argmax.

``--root DIR``: import vgraph from another source tree of this repository (say ``git archive
REV | tar -x -C DIR``) in place of this checkout, for an A/B of two revisions in alternating
processes (works with the editable install the project's venv has). ``record_shapes`` is left
off: on this model it made the profiler hold over 20 GB.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

CHECKPOINTS = {"qwen2-0.5b-shape": 32000, "llama-24m": 512}  # name -> vocabulary size


def _use_tree(root: str) -> None:
    import __editable___vgraph_0_1_0_finder as finder  # the venv's editable install
    finder.MAPPING.update({"vgraph": f"{root}/vgraph", "vgraph.ops": f"{root}/ops",
                           "vgraph.passes": f"{root}/passes"})
    sys.path.insert(0, root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(CHECKPOINTS), default="qwen2-0.5b-shape")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--root", help="another source tree to import vgraph from")
    args = parser.parse_args()
    if args.root:
        _use_tree(args.root)
    if args.threads:
        torch.set_num_threads(args.threads)
    from perf.peers import envs
    from perf.suites import cpu_peers
    from perf.suites.offline import Requests, VgraphSystem
    from vgraph import SamplingParams

    model = next(m for m in cpu_peers.MODELS if m.name == args.model)
    path = envs.ensure_checkpoint(model.name, model.build)
    generator = torch.Generator().manual_seed(0)
    vocab = CHECKPOINTS[args.model]
    prompts = [torch.randint(10, vocab - 2, (192,), generator=generator).tolist() for _ in range(args.batch)]
    system = VgraphSystem(path, "cpu", [Requests(prompts, [64] * args.batch)], compiled=True)
    engine = system.llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    prefill, advanced = [], 0
    while advanced < len(prompts):  # until a step advances every request: the last prefill chunk
        start = time.perf_counter()
        advanced = len(engine.step().deltas)
        prefill.append(time.perf_counter() - start)
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    import vgraph
    print(f"vgraph from {vgraph.__file__}; {torch.get_num_threads()} threads; prefill "
          f"{sum(prefill):.2f} s in {len(prefill)} steps; decode step median "
          f"{statistics.median(steps) * 1e3:.1f} ms (min {min(steps) * 1e3:.1f}) over {len(steps)}")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(6):
                engine.step()
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]:
            print(f"{e.self_cpu_time_total / 6e3:9.2f} ms/step {e.count / 6:6.1f} calls/step  {e.key[:80]}")


if __name__ == "__main__":
    main()
