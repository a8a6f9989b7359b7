"""``python -m perf.generate_ab [--base REV] [--rounds N] [--tokens N] [--batch B] [--model M]
[--prompt-len N]``: ``LLM.generate`` of the demo model (or ``--model``: a checkpoint directory,
e.g. the served CPU perf model, ``~/.cache/vgraph/perf-peers/checkpoints/llama-24m``; one
``--prompt-len``-token prompt per sequence, greedy, ``--tokens`` new tokens) of this checkout
against git revision REV, in alternating child processes.

Why a separate tool: issue 33's batch-1 target is a ratio against the code as it was, and a
shared machine drifts by more than the gain in a few minutes, so the two run in turns (A B B A
...) and the best of each side is compared (``--mean``: each child's mean call after its first,
for costs that only some calls pay, such as a full garbage collection). REV is installed (``pip install --no-deps
--target``) into a temporary directory so that all of it, ``vgraph.ops`` included, is REV's
(an editable checkout maps ``vgraph.ops`` to its own ``ops/`` whatever the path says); each side
keeps its own kernel and compile caches (keyed by their sources). Both sides must give the
same tokens. Prints each round and the ratio; ``--out`` writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .timing import machine_info

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 16

CHILD = """
import json, sys, time
from vgraph import LLM, SamplingParams
batch, tokens, repeats, prompt_len = (int(a) for a in sys.argv[1:5])
llm = LLM(sys.argv[5], device="cpu", max_num_seqs=max(8, batch), max_model_len=512, cpu_kv_cache_gib=0.5)
vocab = llm.engine.vocab_size
params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
prompts = [[10 + (i * 7 + j) % (vocab - 10) for j in range(prompt_len)] for i in range(batch)]
took, ids = [], None
for _ in range(repeats):
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    took.append(time.perf_counter() - start)
    ids = [o.outputs[0].token_ids for o in outputs]
warm = took[1:] or took  # the mean leaves out the first call, which warms up
seconds = sum(warm) / len(warm) if sys.argv[6] == "mean" else min(took)
print(json.dumps({"seconds": seconds, "tok_s": batch * tokens / seconds, "ids": ids}))
"""


def install(rev: str, directory: Path) -> Path:
    """REV's tree, installed (not editable) under ``directory``: its path for PYTHONPATH."""
    tree, target = directory / "tree", directory / "site"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(tree)], check=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return target


def run_side(pythonpath: Path, batch: int, tokens: int, repeats: int, prompt_len: int, model: str,
             stat: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "VGRAPH_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(batch), str(tokens), str(repeats), str(prompt_len), model,
                          stat],
                         env=env, cwd="/", capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--model", default="demo-model-v1", help="model name or checkpoint directory")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    parser.add_argument("--repeats", type=int, default=4, help="generate calls per child (the best counts)")
    parser.add_argument("--mean", action="store_true",
                        help="count each child's mean call after the first, not its best: for costs some calls "
                             "pay and others do not (a full garbage collection), which the best call hides")
    parser.add_argument("--out", type=Path, help="write the rounds and the ratio here (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vgraph-generate-ab-") as tmp:
        sides = {"base": install(args.base, Path(tmp)), "this": ROOT}
        rounds: list[dict] = []
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            row = {name: run_side(sides[name], args.batch, args.tokens, args.repeats, args.prompt_len, args.model,
                                  "mean" if args.mean else "best") for name in order}
            if row["base"]["ids"] != row["this"]["ids"]:
                raise SystemExit("the two sides generated different tokens")
            row = {name: round(v["tok_s"], 1) for name, v in row.items()} | {"load": os.getloadavg()[0]}
            print(f"round {r}: base {row['base']} tok/s, this {row['this']} tok/s "
                  f"({row['this'] / row['base']:.3f}x, load {row['load']:.2f})", flush=True)
            rounds.append(row)
    best = {name: max(r[name] for r in rounds) for name in sides}
    ratio = best["this"] / best["base"]
    print(f"best: base {best['base']} tok/s, this {best['this']} tok/s: {ratio:.3f}x ({args.model}, batch {args.batch}, "
          f"{args.tokens} tokens, base {args.base})")
    if args.out:
        args.out.write_text(json.dumps({"base": args.base, "model": args.model, "prompt_len": args.prompt_len,
                                        "batch": args.batch, "tokens": args.tokens, "repeats": args.repeats,
                                        "per_child": "mean call" if args.mean else "best call",
                                        "rounds": rounds, "best_tok_s": best, "ratio": ratio,
                                        "machine": machine_info("cpu")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
