"""The compiled engine in motion: batches that grow, shrink, mix prefill and decode."""
from __future__ import annotations

import random

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams


def test_200_steps_of_varying_batches_cause_no_recompile():
    llm = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=96,
              max_num_batched_tokens=48, max_num_seqs=12)
    engine = llm.engine
    rng = random.Random(0)
    steps, next_id, finished = 0, 0, 0
    while steps < 200:
        if rng.random() < 0.3:  # arrivals at random steps: batch sizes rise and fall
            length = rng.choice([1, 2, 3, 15, 16, 17, 40, 90])
            params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=next_id,
                                    max_tokens=rng.randint(1, 30), ignore_eos=True)
            llm.add_request(str(next_id), [rng.randrange(3, 500) for _ in range(length)], params)
            next_id += 1
        finished += sum(out.finished for out in llm.step().outputs)
        steps += 1
    assert finished > 10 and next_id > 40
    counters = engine.runner.compile_counters
    assert counters.graphs_seen <= 1 and counters.recompiles == 0  # 0: a warm start loaded the captured graph
