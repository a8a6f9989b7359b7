"""A KV cache smaller than max_model_len: a warning at startup, and the engine's limit lowered
to what the cache holds, so requests that could never fit are rejected instead of cut short."""
from __future__ import annotations

import logging

import pytest

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams

BLOCKS, BLOCK_SIZE = 4, 16  # 64 tokens; the tiny checkpoint's max_position_embeddings is 512


@pytest.fixture(scope="module")
def small_kv(request) -> tuple[LLM, list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vgraph")
    logger.addHandler(handler)
    try:
        llm = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=BLOCKS,
                  block_size=BLOCK_SIZE, enforce_eager=True)
    finally:
        logger.removeHandler(handler)
    return llm, records


def test_startup_warns_with_both_numbers(small_kv):
    llm, records = small_kv
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and "KV cache" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in records]
    assert "holds 64 tokens" in warnings[0] and "max_model_len 512" in warnings[0]
    assert "--max-model-len 64" in warnings[0]


def test_engine_limit_is_the_cache_capacity(small_kv):
    llm, _ = small_kv
    assert llm.engine.max_model_len == 64, "what /v1/models and the request checks read"
    assert llm.engine.config.max_model_len == 512, "the resolved config keeps what was asked"


def test_requests_that_cannot_fit_are_rejected_up_front(small_kv):
    llm, _ = small_kv
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens\. However, you requested 110 tokens "
                                         r"\(10 in the prompt, 100 in the completion\)"):
        llm.generate([list(range(10, 20))], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens. However, you requested 71 tokens"):
        llm.generate([list(range(10, 80))], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_what_fits_runs_to_its_full_length(small_kv):
    llm, _ = small_kv
    out = llm.generate([list(range(10, 20))], SamplingParams(max_tokens=54, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 54 and out[0].outputs[0].finish_reason == "length"
    unbounded = llm.generate([list(range(10, 20))], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(unbounded[0].outputs[0].token_ids) == 54, "max_tokens=None runs up to the cache's limit"


def test_a_cache_that_holds_max_model_len_gives_no_warning(caplog):
    caplog.set_level(logging.WARNING, logger="vgraph")
    llm = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=BLOCKS,
              block_size=BLOCK_SIZE, max_model_len=64, enforce_eager=True)
    assert llm.engine.max_model_len == 64
    assert not [r for r in caplog.records if "KV cache holds" in r.getMessage()]
