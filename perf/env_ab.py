"""``python -m perf.env_ab --env NAME=VALUE [--shape S ...] [--batch B] [--rounds R] [--out F]``:
a decode step's time with an environment switch and without it, in alternating child
processes (A B B A ...), on each shape's batch-``B`` ``LLM.generate`` (the overlapped loop,
random weights, bf16 on CUDA; prompt 128, 128 new tokens, greedy; ms per step as
``perf.profile_step`` measures it: full minus prefill-only, over the new tokens).

Why children: the switches this is for are read once per process (``VGRAPH_PDL``: kernels
launched with programmatic dependent launch, ops/kernels/common.py) and baked into the CUDA
graphs a process captures, so each side needs its own process; alternating them keeps a
drifting machine from deciding the result. Both sides must generate the same tokens. Prints
each round and the ratio (off / on: above 1, the switch is faster) per shape; ``--out``
writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, torch
from perf.profile_step import generate, ms_per_step
from perf.suites.decode import build_llm
path, device, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm, _ = build_llm(path, device, 64, {"async_scheduling": True}, dummy=True)
generate(llm, batch, 8)  # warm
step = ms_per_step(llm, batch, device)
from vgraph import SamplingParams
out = llm.generate([{"prompt_token_ids": list(range(100, 228))}] * batch,
                   SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
print(json.dumps({"ms_per_step": step, "tokens": [list(o.outputs[0].token_ids) for o in out]}))
"""


def run_child(env_switch: dict[str, str], path: str, device: str, batch: int) -> dict:
    env = {**os.environ, **env_switch, "VGRAPH_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, path, device, str(batch)], env=env, cwd=str(ROOT),
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({env_switch or 'no switch'}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ab_shape(shape: str, name: str, value: str, device: str, batch: int, rounds: int, tmp: str,
             layers: int | None = None) -> dict:
    from .suites.decode import write_model_dir
    path = write_model_dir(os.path.join(tmp, shape), shape, layers)
    sides = {"off": {name: "0" if value != "0" else "1"}, "on": {name: value}}
    rows = []
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        got = {side: run_child(sides[side], path, device, batch) for side in order}
        if got["off"]["tokens"] != got["on"]["tokens"]:
            raise SystemExit(f"{shape}: the two sides generated different tokens")
        rows.append({side: round(v["ms_per_step"], 4) for side, v in got.items()})
        print(f"  {shape} round {r}: off {rows[-1]['off']:.3f} ms, on {rows[-1]['on']:.3f} ms "
              f"({rows[-1]['off'] / rows[-1]['on']:.3f}x)", flush=True)
    median = {side: statistics.median(row[side] for row in rows) for side in sides}
    return {"rounds": rows, "median_ms": median, "speedup": median["off"] / median["on"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True, help="the switch, NAME=VALUE (off: NAME=0)")
    parser.add_argument("--shape", action="append", help="decode.py shapes (default: both GPU shapes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, help="fewer layers than the shape has (a smoke run)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    name, _, value = args.env.partition("=")
    shapes = args.shape or ["qwen2.5-0.5b", "llama3-8b"]
    from .timing import machine_info
    result = {"tool": "env_ab", "env": args.env, "batch": args.batch, "layers": args.layers, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="vgraph-env-ab-") as tmp:
        for shape in shapes:
            result["shapes"][shape] = ab_shape(shape, name, value, args.device, args.batch, args.rounds, tmp,
                                               args.layers)
            print(f"{shape}: off {result['shapes'][shape]['median_ms']['off']:.3f} ms, on "
                  f"{result['shapes'][shape]['median_ms']['on']:.3f} ms: {result['shapes'][shape]['speedup']:.3f}x "
                  f"with {args.env}", flush=True)
            if args.out:  # after each shape: a cut-off run keeps what it measured
                args.out.write_text(json.dumps({**result, "machine": machine_info(args.device)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
