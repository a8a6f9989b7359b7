"""Multi-LoRA through the whole engine: mixed batches of three adapters and the base model give
the greedy tokens of transformers + PEFT on each adapter (fp32), eager and compiled, with
prefix caching on, more adapters than slots (the scheduler keeps a step within the slots and
the slots are reused), no recompile, and bad adapters refused as the request's error."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tests.checkpoints import process_tmp_dir, tiny_checkpoint
from tests.engine.hf_oracle import random_prompts
from tests.lora.adapters import cached_adapter, peft_model
from vgraph import LLM, LoRARequest, SamplingParams

TOKENS = 8
ADAPTERS = (dict(seed=11, rank=8, alpha=16),
            dict(seed=12, rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj"), use_rslora=True),
            dict(seed=13, rank=16, alpha=32, targets=("gate_proj", "up_proj", "down_proj")))


@functools.lru_cache(maxsize=None)
def _loras() -> tuple[LoRARequest, ...]:
    path = tiny_checkpoint()
    folders = [cached_adapter(path, process_tmp_dir(), **spec) for spec in ADAPTERS]
    return tuple(LoRARequest(f"adapter-{i}", i + 1, folder) for i, folder in enumerate(folders))


@functools.lru_cache(maxsize=None)
@torch.inference_mode()
def _oracle(adapter: int, prompt: tuple[int, ...]) -> list[int]:
    """transformers (+ PEFT for adapter >= 1) greedy continuation of ``prompt``."""
    path = tiny_checkpoint()
    model = _peft(path, adapter)
    ids = torch.tensor([list(prompt)])
    out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=None)
def _peft(path: str, adapter: int) -> torch.nn.Module:
    return peft_model(path, None if adapter == 0 else _loras()[adapter - 1].lora_path)


def _prompts() -> list[list[int]]:
    shared = random_prompts([24], 500, seed=5)[0]  # a shared prefix: cached blocks must not cross adapters
    tails = random_prompts([5, 9, 3, 7, 6, 4, 8, 2], 500, seed=6)
    return [shared + t for t in tails]


@pytest.fixture(scope="module", params=["eager", "compiled"])
def llm(request):
    kwargs = {"enforce_eager": True} if request.param == "eager" else {}
    # Two slots for three adapters: every step may hold at most two of them.
    engine = LLM(tiny_checkpoint(), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                 enable_prefix_caching=True, max_num_seqs=8, **kwargs)
    yield engine
    engine.close()


def test_mixed_adapters_equal_transformers_and_peft(llm):
    prompts = _prompts()
    assignment = [i % 4 for i in range(len(prompts))]  # 0: base, 1-3: the adapters
    loras = [None if a == 0 else _loras()[a - 1] for a in assignment]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    for _ in range(2):  # the second round reads the prefix cache, per adapter
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == [_oracle(a, tuple(p)) for a, p in zip(assignment, prompts)]
    assert len({tuple(g) for g in got}) > 4, "the adapters change the tokens (else this proves nothing)"
    counters = llm.engine.runner.compile_counters
    if counters is not None:
        assert counters.recompiles == 0, "adapters swapped through the slots without a recompile"


def test_the_scheduler_keeps_each_step_within_the_slots(llm):
    engine = llm.engine
    seen: list[int] = []
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        seen.append(len({s.request.lora_id for s in out.scheduled if s.request.lora_id is not None}))
        return out

    engine.scheduler.schedule = schedule
    try:
        loras = [_loras()[i % 3] for i in range(6)]
        llm.generate([{"prompt_token_ids": p} for p in _prompts()[:6]],
                     SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False,
                     lora_request=loras)
    finally:
        engine.scheduler.schedule = original
    assert max(seen) == 2 and all(n <= 2 for n in seen)


def test_bad_adapters_are_the_requests_error(llm, tmp_path):
    broken = Path(tmp_path) / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 64, "lora_alpha": 8,
                                                             "target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("broken", 99, str(broken)))
    with pytest.raises(ValueError, match="no such|not found|does not exist|missing"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("gone", 98, str(tmp_path / "nowhere")))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False, lora_request=_loras()[0])
    assert len(out[0].outputs[0].token_ids) == 2, "the engine serves on"


def test_an_adapter_removed_while_in_use_serves_its_requests_to_the_end(llm):
    lora, prompt = _loras()[0], _prompts()[0]
    llm.add_request("in-use", {"prompt_token_ids": prompt},
                    SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True), lora_request=lora)
    outputs = []
    outputs += llm.step().outputs
    assert llm.engine.remove_lora(lora.lora_int_id) is False, "in use: kept"
    while llm.has_unfinished_requests():
        outputs += llm.step().outputs
    assert outputs[-1].outputs[0].token_ids == _oracle(1, tuple(prompt))
    assert llm.engine.remove_lora(lora.lora_int_id) is True


def test_lora_requests_need_lora_enabled():
    engine = LLM(tiny_checkpoint(), dtype="float32", enforce_eager=True)
    try:
        with pytest.raises(ValueError, match="not enabled"):
            engine.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False, lora_request=_loras()[0])
    finally:
        engine.close()


@pytest.mark.slow
def test_tensor_parallel_shards_adapters_like_their_layers():
    """TP=2 (two gloo ranks): each rank holds its shard of every adapter (B's output rows on q/k/v
    and gate/up, A's input columns on o and down), and mixed batches still equal transformers +
    PEFT; a bad adapter is refused by the ranks, which serve on."""
    llm = LLM(tiny_checkpoint(), dtype="float32", tensor_parallel_size=2, enable_lora=True, max_loras=2,
              max_lora_rank=16, block_size=16, num_gpu_blocks=128, max_model_len=256)
    try:
        prompts = _prompts()[:4]
        assignment = [1, 2, 3, 0]
        loras = [None if a == 0 else _loras()[a - 1] for a in assignment]
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == [_oracle(a, tuple(p)) for a, p in zip(assignment, prompts)]
        with pytest.raises(ValueError, match="not found|missing|no such|does not exist"):
            llm.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False,
                         lora_request=LoRARequest("gone", 77, "/nowhere/at/all"))
        again = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False, lora_request=loras[0])
        assert again[0].outputs[0].token_ids == _oracle(1, tuple(prompts[0]))
    finally:
        llm.close()
