"""Runs one lm-evaluation-harness evaluation and writes what the test compares, as JSON.

A separate process (``python -m tests.server.lm_eval_run SPEC OUT``) because the harness
must be offline from its first import (``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` are read
when ``datasets`` and ``huggingface_hub`` are imported) and configures logging globally.
SPEC is a JSON file: {"model": ..., "model_args": ..., "task": ..., "include_path": ...}.
OUT receives {"metrics": {metric: value}, "loglikelihoods": {doc_id: [per-choice ll]},
"seconds": wall time of the evaluation}.
"""
from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with open(spec_path) as f:
        spec = json.load(f)
    task = spec["task"]
    start = time.perf_counter()
    results = simple_evaluate(model=spec["model"], model_args=spec["model_args"], tasks=[task],
                              task_manager=TaskManager(include_path=spec["include_path"]),
                              batch_size=spec.get("batch_size", 1), device=spec.get("device"),
                              log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    seconds = time.perf_counter() - start
    metrics = {k.split(",")[0]: v for k, v in results["results"][task].items()
               if k.split(",")[0] in ("acc", "acc_norm")}
    lls = {str(s["doc_id"]): [r[0] for r in s["filtered_resps"]] for s in results["samples"][task]}
    with open(out_path, "w") as f:
        json.dump({"metrics": metrics, "loglikelihoods": lls, "seconds": seconds}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
