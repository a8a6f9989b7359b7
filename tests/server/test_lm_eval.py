"""lm-evaluation-harness scores a served model exactly as it scores the checkpoint itself.

A small multiple-choice task (a local JSONL file and a task yaml written here; nothing is
downloaded) runs twice through the real harness: with its ``local-completions`` model against
``vgraph serve`` (which the harness drives with ``echo=True, logprobs=1, max_tokens=1``, the
prompt logprobs path), and with its ``hf`` model on the same checkpoint (transformers, fp32,
CPU). Accuracy and length-normalized accuracy must be equal, and so must each choice's
log-likelihood (1e-4 per token on average)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TINY_MODEL

NUM_ITEMS = 32
WORDS = ["apple", "river", "stone", "cloud", "music", "garden", "window", "bread", "candle", "forest",
         "silver", "paper", "orange", "winter", "bridge", "coffee"]


def _items(seed: int = 0) -> list[dict]:
    """Arithmetic and word-pair questions with four answers each (the tiny random model's
    accuracy is whatever it is: the point is that both runs agree)."""
    rng = random.Random(seed)
    items = []
    for i in range(NUM_ITEMS):
        if i % 2:
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            answers = [a + b, a + b + 1, a * b, abs(a - b)]
            question, choices = f"Question: what is {a} plus {b}?\nAnswer:", [f" {x}" for x in answers]
        else:
            words = rng.sample(WORDS, 5)
            question = f"Question: which word goes with {words[0]}?\nAnswer:"
            choices = [f" {w}" for w in words[1:]]
        gold = rng.randrange(4)
        choices[0], choices[gold] = choices[gold], choices[0]
        items.append({"question": question, "choices": choices, "answer": gold})
    return items


def _write_task(root: Path) -> str:
    data = root / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in _items()))
    (root / "vgraph_local_mc.yaml").write_text(f"""task: vgraph_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    return "vgraph_local_mc"


def _evaluate(tmp: Path, name: str, spec: dict) -> dict:
    spec_path, out_path = tmp / f"{name}-spec.json", tmp / f"{name}-out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp / "datasets-cache"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-m", "tests.server.lm_eval_run", str(spec_path), str(out_path)],
                            env=env, capture_output=True, text=True, timeout=600,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out_path.read_text())


@pytest.mark.slow
def test_lm_eval_accuracy_served_equals_hf(tiny_server, tmp_path):
    pytest.importorskip("lm_eval")
    task = _write_task(tmp_path)
    common = {"task": task, "include_path": str(tmp_path)}
    served = _evaluate(tmp_path, "served", {**common, "model": "local-completions", "model_args": (
        f"model={TINY_MODEL},base_url={tiny_server.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={tiny_server.checkpoint},num_concurrent=4,max_retries=1,tokenized_requests=True")})
    hf = _evaluate(tmp_path, "hf", {**common, "model": "hf", "device": "cpu", "batch_size": 8,
                                    "model_args": f"pretrained={tiny_server.checkpoint},dtype=float32"})
    assert set(served["loglikelihoods"]) == set(hf["loglikelihoods"]) and len(hf["loglikelihoods"]) == NUM_ITEMS
    diff = max(abs(a - b) for doc, lls in hf["loglikelihoods"].items()
               for a, b in zip(served["loglikelihoods"][doc], lls))
    print(f"\nlm-eval {task}: {NUM_ITEMS} items x 4 choices; vgraph-served {served['metrics']} in "
          f"{served['seconds']:.1f} s; hf {hf['metrics']} in {hf['seconds']:.1f} s; "
          f"largest log-likelihood difference {diff:.2e}")
    assert served["metrics"] == hf["metrics"]
    for doc, lls in hf["loglikelihoods"].items():
        assert served["loglikelihoods"][doc] == pytest.approx(lls, abs=1e-4), f"item {doc}"
