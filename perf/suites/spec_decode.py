"""Speculative decoding: generated tokens per second with guesses against without, timed in
turns, for both proposers.

Pairs (greedy, ``ignore_eos``, 128 new tokens):

- ``ngram`` on the demo model: prompt lookup, no second model.
- ``draft_model``: the demo model drafts for a larger target built from it
  (``demo-big``: examples/grow_demo_model.py widens every MLP to 4096 and adds two layers after
  each demo layer, computing the demo's function exactly; examples/train_demo_model.py then
  trains all 30M parameters for 150 steps on the stdlib). The target's batch-1 step costs
  about six of the draft's. Built on first use into ``$VGRAPH_CACHE_DIR/spec-pair/demo-big``
  (about six minutes on one core); ``python -m perf.suites.spec_decode --build-pair`` builds it alone.

Workloads:

- ``batch 1, code edit``: prompts that quote a block of the standard library's source twice
  (an edit's before and after, unchanged here) and ask for it once more: the output repeats
  long runs of its input, where prompt lookup guesses right often (a draft model guesses from
  what it learned as well); eight prompts (each a different block) one after another.
- ``batch 32``: 32 such prompts at once, where the forward is busier and guesses pay less:
  speculation on must not be slower than off (on CPU guesses stop above 16 sequences unless
  ``disable_by_batch_size`` says otherwise).

Figures: tok/s of each engine (median of rounds), the speedup, and the speculating engine's
acceptance counters (acceptance rate, mean tokens per verifying step, per-position acceptance).
"""
from __future__ import annotations

import inspect
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "demo-model-v1", "num_speculative_tokens": 4}
NEW_TOKENS = 128
TARGETS = {"ngram batch 1 speedup": 1.5, "draft_model batch 1 speedup": 1.4, "batch 32 speedup (not slower)": 1.0}
REPO = Path(__file__).resolve().parents[2]
GROW = ["--intermediate-size", "4096", "--extra-layers", "2", "--seed", "0"]
TRAIN = ["--max-steps", "150", "--batch-size", "4", "--lr", "3e-4", "--warmup-steps", "10", "--threads", "1",
         "--line-start-fraction", "0.5", "--eval-every", "50", "--eval-batches", "4"]


def pair_target() -> Path:
    """The draft-model pair's target, built (grown from the demo model, then trained) if missing."""
    from vgraph.paths import cache_dir

    root = cache_dir() / "spec-pair"
    target = root / "demo-big"
    if (target / "training.json").exists():
        return target
    grown = root / "demo-grown"
    python = [sys.executable]
    subprocess.run(python + ["examples/grow_demo_model.py", "--out", str(grown), *GROW], check=True, cwd=REPO)
    subprocess.run(python + ["examples/train_demo_model.py", "--init-from", str(grown), "--out", str(target), *TRAIN],
                   check=True, cwd=REPO)
    return target


def _code_prompts(count: int) -> list[str]:
    """Prompts that quote a block of the standard library's source twice and ask for it again."""
    import textwrap
    text = inspect.getsource(textwrap) + inspect.getsource(statistics)
    prompts = []
    for i in range(count):
        source = text[4000 + 300 * i:4300 + 300 * i]
        prompts.append(f"# before\n{source}\n# after\n{source}\n# once more\n{source[:80]}")
    return prompts


def _tok_per_s(llm: Any, prompts: list[str], params: Any, batch: int) -> float:
    """Generated tokens per second over ``prompts``, ``batch`` at a time."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        outputs = llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start)


def measure(off: Any, on: Any, prompts: list[str], rounds: int, batch: int) -> dict[str, Any]:
    """Both engines over the same prompts, ``batch`` at a time, in turns per round (off, on, off,
    on, ...), after a warm-up run of each."""
    from vgraph import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engines = {"off": off, "on": on}
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for llm in engines.values():  # warm-up: compile every shape once
        llm.generate(prompts[:batch], params, use_tqdm=False)
    before = on.engine.stats()
    for _ in range(rounds):
        for name, llm in engines.items():
            samples[name].append(_tok_per_s(llm, prompts, params, batch))
    after = on.engine.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    guessed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_pos = [a - b for a, b in zip(after.spec_accepted_per_position, before.spec_accepted_per_position)]
    tok_s = {name: statistics.median(values) for name, values in samples.items()}
    return {"batch": batch, "prompts": len(prompts), "tok_per_s": {k: round(v, 1) for k, v in tok_s.items()},
            "speedup": round(tok_s["on"] / tok_s["off"], 3),
            "acceptance_rate": round(accepted / guessed, 3) if guessed else 0.0,
            "mean_tokens_per_verify_step": round(1 + accepted / drafts, 3) if drafts else 0.0,
            "accepted_per_position": [round(c / drafts, 3) for c in per_pos] if drafts else []}


def _rows(proposer: str, target: str, spec: dict, device: str, quick: bool) -> list[dict[str, Any]]:
    """Batch 1 and batch 32 for one pair; the engines are closed before the next pair starts."""
    from vgraph import LLM
    off = LLM(target, device=device, max_num_seqs=32)
    on = LLM(target, device=device, max_num_seqs=32, speculative_config=spec)
    rounds = 1 if quick else 5
    # Batch 1: eight prompts one after another (one prompt alone is one sample of how often a
    # small model's output repeats its input: 1.6 to 3.5 tokens per step across these eight).
    large = 8 if quick else 32
    rows = [measure(off, on, _code_prompts(8), rounds, 1), measure(off, on, _code_prompts(large), rounds, large)]
    off.close()
    on.close()
    return [{"proposer": proposer, "target": Path(target).name, **row} for row in rows]


def run(device: str, quick: bool = False) -> dict:
    target = str(pair_target())
    rows = _rows("ngram", "demo-model-v1", NGRAM, device, quick) + _rows("draft_model", target, DRAFT, device, quick)
    return {"suite": "spec-decode",
            "config": {"device": device, "compiled": True, "ngram": NGRAM, "draft_model": DRAFT,
                       "draft_pair": {"target": f"demo-big ({target}): examples/grow_demo_model.py {' '.join(GROW)}, "
                                                f"then examples/train_demo_model.py {' '.join(TRAIN)}",
                                      "draft": "demo-model-v1"},
                       "new_tokens": NEW_TOKENS, "rounds": 1 if quick else 5, "load_average": os.getloadavg(),
                       "targets": TARGETS},
            "rows": rows}


def summarize(result: dict) -> str:
    lines = ["proposer     target          batch  off tok/s   on tok/s  speedup  acceptance  tokens/verify  "
             "per position"]
    for r in result["rows"]:
        lines.append(f"{r['proposer']:<12} {r['target']:<14} {r['batch']:>6} {r['tok_per_s']['off']:10.1f} "
                     f"{r['tok_per_s']['on']:10.1f} {r['speedup']:8.3f} {r['acceptance_rate']:11.3f} "
                     f"{r['mean_tokens_per_verify_step']:14.3f}  {r['accepted_per_position']}")
    lines.append(f"(greedy, {NEW_TOKENS} new tokens; load average {result['config']['load_average']})")
    return "\n".join(lines)


def headline_figures(result: dict) -> dict[str, float]:
    return {f"{r['proposer']} speedup, batch {r['batch']}": r["speedup"] for r in result["rows"]}


if __name__ == "__main__":
    if sys.argv[1:] != ["--build-pair"]:
        sys.exit("usage: python -m perf.suites.spec_decode --build-pair")
    print(pair_target())
