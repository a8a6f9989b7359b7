"""The overlapped loop and speculative decoding on a real GPU, with CUDA graphs (FULL decode
buckets and PIECEWISE pieces): what the CPU tests prove with an emulated device, here with the
device's own asynchronous launches, the pinned copy of the sampled ids and the step thread.

Tokens must be identical, and logprobs equal. On CUDA the two loops may group requests into
different batches (the overlapped one never schedules a grammar's request ahead), and a matrix
product of another row count may pick another kernel: fp32 logprobs are therefore compared to
1e-4, tokens exactly."""
from __future__ import annotations

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.compiler.graph_scenarios import logprobs_close
from tests.engine.test_overlapped_scheduling import _workload
from vgraph import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _llm(**kwargs) -> LLM:
    kwargs = {"num_gpu_blocks": 10, "block_size": 16, "max_num_batched_tokens": 48, **kwargs}
    return LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cuda", seed=0, **kwargs)


def _run(llm: LLM) -> list:
    prompts, params = zip(*_workload())
    return llm.generate(list(prompts), list(params), use_tqdm=False)


def test_overlapped_and_serial_loops_agree_on_cuda():
    serial, overlapped = _llm(async_scheduling=False), _llm(async_scheduling=True)
    expected, got = _run(serial), _run(overlapped)
    assert serial.engine.scheduler.num_preemptions > 0, "the small KV cache preempts"
    for e, g in zip(expected, got):
        assert logprobs_close(e.prompt_logprobs, g.prompt_logprobs, 1e-4)
        for ce, cg in zip(e.outputs, g.outputs, strict=True):
            assert (cg.token_ids, cg.text, cg.finish_reason, cg.stop_reason) == \
                (ce.token_ids, ce.text, ce.finish_reason, ce.stop_reason)
            assert logprobs_close(ce.logprobs, cg.logprobs, 1e-4)
    for llm in (serial, overlapped):
        pool = llm.engine.scheduler.block_pool
        assert pool.num_free_blocks == pool.num_blocks, "every block came back"


@pytest.mark.parametrize("overlap", [False, True])
def test_speculation_equals_plain_greedy_on_cuda(overlap):
    prompts = ["a b c d a b c d a b c d a b", "one two three one two three one two", "x y x y x y x y x y"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _llm(num_gpu_blocks=64, async_scheduling=overlap)
    spec = _llm(num_gpu_blocks=64, async_scheduling=overlap, speculative_config=SPEC)
    for batch in (prompts[:1], prompts):
        want = [o.outputs[0].token_ids for o in plain.generate(batch, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in spec.generate(batch, params, use_tqdm=False)]
        assert got == want
    assert spec.engine.stats().spec_num_accepted_tokens > 0


def test_draft_model_on_cuda_shares_the_device_and_equals_plain_greedy():
    """The target sizes its cache from a memory profile, leaving the draft's share free; the
    draft (here the target itself: every guess kept) then builds its own runner and graphs."""
    path = tiny_checkpoint(arch="llama")
    kwargs = dict(dtype="float32", device="cuda", seed=0, gpu_memory_utilization=0.4, max_model_len=256,
                  max_num_seqs=8)
    prompts = ["a b c d a b c d a b c d a b", "one two three one two three one two"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **kwargs).generate(prompts, params, use_tqdm=False)]
    spec = LLM(path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3},
               **kwargs)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    stats = spec.engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0, "its own draft: every guess kept"


def test_logprobs_wait_for_nothing_at_launch_on_cuda():
    """A step that asks for logprobs or prompt logprobs launches without a host sync: its
    entries are read when it is finished (``torch.cuda.set_sync_debug_mode`` raises on a sync)."""
    from vgraph.worker.logprob_rows import HostCopy
    from vgraph.worker.prompt_logprobs import compute_prompt_logprobs
    from vgraph.worker.runner_requests import RunnerChunk, RunnerRequest, RunnerStep
    from vgraph.worker.sampler import Sampler, SamplingMetadata
    vocab = 1000
    requests = [RunnerRequest(r, list(range(1, 9)), SamplingParams(temperature=0, logprobs=2),
                              num_prompt_logprobs=1) for r in "ab"]
    meta = SamplingMetadata.from_requests(requests, vocab, "cuda")
    lm_head = torch.randn(vocab, 16, device="cuda")
    hidden = torch.randn(16, 16, device="cuda")
    step = RunnerStep([RunnerChunk(r, 8, 0, True) for r in requests])
    logits = hidden[[7, 15]] @ lm_head.T
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, meta)
        pending = compute_prompt_logprobs(hidden, step, lambda h: h @ lm_head.T)
        copy = HostCopy([out.token_ids, *out.logprobs.tensors(), *pending.tensors()])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = copy.wait()
    expected = logits.log_softmax(-1)
    ids = host[0].tolist()
    entries = out.logprobs.entries(ids, host[1:4])
    assert ids == expected.argmax(-1).tolist()
    assert entries[0][ids[0]] == pytest.approx(expected[0, ids[0]].item(), abs=1e-5)
    assert len(pending.entries(host[4:])["b"].entries) == 7
