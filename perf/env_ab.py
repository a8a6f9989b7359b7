"""``python -m perf.env_ab (--env NAME=VALUE | --base REV) [--shape S ...] [--batch B] [--rounds R]
[--out F]``: a decode step's time with an environment switch and without it (``--env``), or
with this checkout's vgraph and git revision REV's (``--base``), in alternating child
processes (A B B A ...), on each shape's batch-``B`` ``LLM.generate`` (the overlapped loop,
random weights, bf16 on CUDA; prompt 128, 128 new tokens, greedy; ms per step as
``perf.profile_step`` measures it: full minus prefill-only, over the new tokens).

``--base`` is for changes that only a GPU can time and that have no switch (a kernel's
body, a default pass): REV is installed as ``perf.generate_ab`` installs it, and its side
imports REV's vgraph with this checkout's ``perf`` helpers.

Why children: the switches this is for are read once per process (``VGRAPH_PDL``: kernels
launched with programmatic dependent launch, ops/kernels/common.py) and baked into the CUDA
graphs a process captures, so each side needs its own process; alternating them keeps a
drifting machine from deciding the result. Both sides must generate the same tokens. Prints
each round and the ratio (off / on, base / this: above 1, the switch or this checkout is
faster) per shape; ``--out`` writes them as JSON.
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
import vgraph.ops
print(json.dumps({"ms_per_step": step, "tokens": [list(o.outputs[0].token_ids) for o in out],
                  "modules": [vgraph.__file__, vgraph.ops.__file__]}))
"""


def run_child(side: dict[str, str], path: str, device: str, batch: int) -> dict:
    """One child on one side: ``side`` holds its environment switch, or its ``PYTHONPATH``
    (REV's installed vgraph first, then this checkout for ``perf``)."""
    env = {**os.environ, "VGRAPH_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT), **side}
    # cwd "/": a child run from the checkout would import its vgraph/ before REV's.
    out = subprocess.run([sys.executable, "-c", CHILD, path, device, str(batch)], env=env, cwd="/",
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({side}):\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    tree = env["PYTHONPATH"].split(os.pathsep)[0]
    strays = [m for m in got["modules"] if not Path(m).resolve().is_relative_to(Path(tree).resolve())]
    if strays:
        raise SystemExit(f"a child meant to run the vgraph under {tree} imported {strays}")
    return got


def env_sides(switch: str) -> dict[str, dict[str, str]]:
    name, _, value = switch.partition("=")
    return {"off": {name: "0" if value != "0" else "1"}, "on": {name: value}}


def ab_shape(shape: str, sides: dict[str, dict[str, str]], device: str, batch: int, rounds: int, tmp: str,
             layers: int | None = None) -> dict:
    from .suites.decode import write_model_dir
    path = write_model_dir(os.path.join(tmp, shape), shape, layers)
    first, second = sides
    rows = []
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        got = {side: run_child(sides[side], path, device, batch) for side in order}
        if got[first]["tokens"] != got[second]["tokens"]:
            raise SystemExit(f"{shape}: the two sides generated different tokens")
        rows.append({side: round(got[side]["ms_per_step"], 4) for side in sides})
        print(f"  {shape} round {r}: {first} {rows[-1][first]:.3f} ms, {second} {rows[-1][second]:.3f} ms "
              f"({rows[-1][first] / rows[-1][second]:.3f}x)", flush=True)
    median = {side: statistics.median(row[side] for row in rows) for side in sides}
    return {"rounds": rows, "median_ms": median, "speedup": median[first] / median[second]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--env", help="the switch, NAME=VALUE (off: NAME=0)")
    what.add_argument("--base", help="a git revision: this checkout's vgraph against REV's")
    parser.add_argument("--shape", action="append", help="decode.py shapes (default: both GPU shapes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, help="fewer layers than the shape has (a smoke run)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shapes = args.shape or ["qwen2.5-0.5b", "llama3-8b"]
    from .generate_ab import install
    from .timing import machine_info
    compared = {"env": args.env} if args.env else {"base": args.base}
    result = {"tool": "env_ab", **compared, "batch": args.batch, "layers": args.layers, "shapes": {}}
    label = f"with {args.env}" if args.env else f"this checkout against {args.base}"
    with tempfile.TemporaryDirectory(prefix="vgraph-env-ab-") as tmp:
        if args.env:
            sides = env_sides(args.env)
        else:
            sides = {"base": {"PYTHONPATH": f"{install(args.base, Path(tmp))}{os.pathsep}{ROOT}"}, "this": {}}
        for shape in shapes:
            got = result["shapes"][shape] = ab_shape(shape, sides, args.device, args.batch, args.rounds, tmp,
                                                     args.layers)
            medians = ", ".join(f"{side} {ms:.3f} ms" for side, ms in got["median_ms"].items())
            print(f"{shape}: {medians}: {got['speedup']:.3f}x {label}", flush=True)
            if args.out:  # after each shape: a cut-off run keeps what it measured
                args.out.write_text(json.dumps({**result, "machine": machine_info(args.device)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
