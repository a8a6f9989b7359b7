"""Speculative decoding: generated tokens per second with n-gram guesses against without, on
the demo model, timed in turns.

Workloads (greedy, ``ignore_eos``):

- ``batch 1, code edit``: prompts that quote a block of the standard library's source twice
  (an edit's before and after, unchanged here) and ask for it once more: the output repeats
  long runs of its input, where prompt lookup guesses right often; 128 new tokens each, eight
  prompts (each a different block) one after another.
- ``batch 32``: 32 such prompts at once, where the forward is busier and guesses pay less:
  speculation on must not be slower than off (``disable_by_batch_size`` is the knob when it is).

Figures: tok/s of each engine (median of rounds), the speedup, and the engine's acceptance
counters (acceptance rate, mean tokens per verifying step, per-position acceptance). The
draft-model proposer is not built yet; the suite says so in its results.
"""
from __future__ import annotations

import inspect
import os
import statistics
import time
from typing import Any

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NEW_TOKENS = 128
TARGETS = {"ngram batch 1 speedup": 1.5, "batch 32 speedup (not slower)": 1.0}


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


def measure(engines: dict[str, Any], prompts: list[str], rounds: int, batch: int) -> dict[str, Any]:
    """Both engines over the same prompts, ``batch`` at a time, in turns per round."""
    from vgraph import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for name, llm in engines.items():  # warm-up: compile every shape once
        llm.generate(prompts[:batch], params, use_tqdm=False)
    before = engines["ngram"].engine.stats()
    for _ in range(rounds):
        for name, llm in engines.items():
            samples[name].append(_tok_per_s(llm, prompts, params, batch))
    after = engines["ngram"].engine.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    guessed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_pos = [a - b for a, b in zip(after.spec_accepted_per_position, before.spec_accepted_per_position)]
    tok_s = {name: statistics.median(values) for name, values in samples.items()}
    return {"batch": batch, "prompts": len(prompts), "tok_per_s": {k: round(v, 1) for k, v in tok_s.items()},
            "speedup": round(tok_s["ngram"] / tok_s["off"], 3),
            "acceptance_rate": round(accepted / guessed, 3) if guessed else 0.0,
            "mean_tokens_per_verify_step": round(1 + accepted / drafts, 3) if drafts else 0.0,
            "accepted_per_position": [round(c / drafts, 3) for c in per_pos] if drafts else []}


def run(device: str, quick: bool = False) -> dict:
    from vgraph import LLM
    engines = {"off": LLM("demo-model-v1", device=device, max_num_seqs=32),
               "ngram": LLM("demo-model-v1", device=device, max_num_seqs=32, speculative_config=SPEC)}
    rounds = 1 if quick else 5
    # Batch 1: eight prompts one after another (one prompt alone is one sample of how often a
    # small model's output repeats its input: 1.6 to 3.5 tokens per step across these eight).
    rows = [measure(engines, _code_prompts(8), rounds, 1),
            measure(engines, _code_prompts(8 if quick else 32), rounds, 8 if quick else 32)]
    return {"suite": "spec-decode",
            "config": {"device": device, "model": "demo-model-v1 (compiled)", "speculative_config": SPEC,
                       "new_tokens": NEW_TOKENS, "rounds": rounds, "load_average": os.getloadavg(),
                       "targets": TARGETS,
                       "draft_model": "not built yet (speculative method 'draft_model' is refused)"},
            "rows": rows}


def summarize(result: dict) -> str:
    lines = ["batch   off tok/s  ngram tok/s  speedup  acceptance  tokens/verify  per position"]
    for r in result["rows"]:
        lines.append(f"{r['batch']:>5} {r['tok_per_s']['off']:11.1f} {r['tok_per_s']['ngram']:12.1f} "
                     f"{r['speedup']:8.3f} {r['acceptance_rate']:11.3f} {r['mean_tokens_per_verify_step']:14.3f}  "
                     f"{r['accepted_per_position']}")
    lines.append(f"(demo model, greedy, {NEW_TOKENS} new tokens; load average {result['config']['load_average']})")
    return "\n".join(lines)


def headline_figures(result: dict) -> dict[str, float]:
    return {f"n-gram speedup, batch {r['batch']}": r["speedup"] for r in result["rows"]}
