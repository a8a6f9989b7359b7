"""A step's results stay on the device until it is finished: logprobs and prompt logprobs
(worker/logprob_rows.py) and pooled states (worker/pooling.py).

What a GPU needs, checked on the meta device: a meta tensor has no data, so any host read of
one (``.tolist()``, ``.item()``) raises. The sampler, the prompt scorer and the pooling run on
meta inputs here, which shows that nothing in them waits for the device; the launched step
reads the results only in ``finish``."""
from __future__ import annotations

import pytest
import torch

from vgraph.sampling_params import SamplingParams
from vgraph.worker.launched import LaunchedStep
from vgraph.worker.logprob_rows import HostCopy, LogprobRows
from vgraph.worker.prompt_logprobs import compute_prompt_logprobs
from vgraph.worker.runner_requests import PENDING, RunnerChunk, RunnerRequest, RunnerStep
from vgraph.worker.sampler import Sampler, SamplingMetadata

V = 40


def read_entries(rows: LogprobRows, token_ids: list[int]) -> list:
    """``rows``' entries read at once (what a finished step does, without the step)."""
    return rows.entries(token_ids, [t.cpu() for t in rows.tensors()])


def _request(rid: str, prompt=(1, 2, 3, 4, 5), prompt_logprobs=None, **params) -> RunnerRequest:
    return RunnerRequest(rid, list(prompt), SamplingParams(**params), frozenset({0}),
                         num_prompt_logprobs=prompt_logprobs)


def test_entries_put_the_scored_token_first_then_the_top_n():
    logprobs = torch.randn(3, V).log_softmax(-1)
    tokens = torch.tensor([5, 7, 9])
    rows = LogprobRows.of(logprobs, tokens, [2, None, 0])
    entries = read_entries(rows, tokens.tolist())
    assert entries[1] is None
    assert entries[2] == {9: pytest.approx(logprobs[2, 9].item())}
    top = logprobs[0].topk(2).indices.tolist()
    assert next(iter(entries[0])) == 5
    assert set(entries[0]) == {5, *top}
    for token, value in entries[0].items():
        assert value == pytest.approx(logprobs[0, token].item())


def test_slices_joined_equal_one_pass():
    logprobs = torch.randn(5, V).log_softmax(-1)
    tokens = torch.tensor([1, 2, 3, 4, 6])
    counts = [3, 1, 0, 2, 3]
    whole = LogprobRows.of(logprobs, tokens, counts)
    parts = LogprobRows.cat([LogprobRows.of(logprobs[:2], tokens[:2], counts[:2], top_n=3),
                             LogprobRows.of(logprobs[2:], tokens[2:], counts[2:], top_n=3)])
    assert read_entries(parts, tokens.tolist()) == read_entries(whole, tokens.tolist())


def test_sampling_with_logprobs_reads_nothing_on_the_host():
    requests = [_request("a", logprobs=3), _request("b"), _request("c", temperature=0.8, top_p=0.9, logprobs=0)]
    meta = SamplingMetadata.from_requests(requests, V, "meta")
    out = Sampler()(torch.empty(3, V, device="meta"), meta)  # a host read of a meta tensor raises
    assert out.token_ids.device.type == "meta"
    assert [t.device.type for t in out.logprobs.tensors()] == ["meta"] * 3
    assert out.logprobs.counts == [3, None, 0]


def test_prompt_scoring_reads_nothing_on_the_host():
    request = _request("p", prompt=list(range(1, 9)), prompt_logprobs=2)
    other = _request("q")
    step = RunnerStep([RunnerChunk(request, 8, 0, True), RunnerChunk(other, 5, 0, True)])
    lm_head = torch.empty(V, 16, device="meta")
    pending = compute_prompt_logprobs(torch.empty(13, 16, device="meta"), step, lambda h: h @ lm_head.T)
    assert [(rid, first, tokens) for rid, first, tokens in pending.spans] == [("p", 1, list(range(2, 9)))]
    assert all(t.device.type == "meta" and t.shape[0] == 7 for t in pending.tensors())


def test_the_launched_step_reads_logprobs_when_finished():
    """Entries come from the tensors as they are at ``finish`` (on a GPU: after the step ran),
    not as they were at launch: the step still writes them when it is launched."""
    request = _request("a", logprobs=1)
    step = RunnerStep([RunnerChunk(request, 5, 0, True)])
    logprobs = torch.full((1, V), -10.0)
    token_ids = torch.tensor([3])
    rows = LogprobRows.of(logprobs, token_ids, [1])
    launched = LaunchedStep(step, [request], token_ids, rows)
    assert request.output_token_ids == [PENDING]
    rows.chosen.fill_(-0.5)  # "the device" finishes the step after launch
    token_ids.fill_(4)
    out = launched.finish()
    assert out.sampled == {"a": 4} and request.output_token_ids == [4]
    assert out.logprobs["a"][4] == -0.5


def test_host_copy_off_cuda_is_the_tensors_themselves():
    tensors = [torch.arange(3), torch.ones(2, 2)]
    assert all(a is b for a, b in zip(HostCopy(tensors).wait(), tensors))


def test_pooling_reads_nothing_on_the_host_until_finished():
    from vgraph.worker.pooling import pooled_chunks
    mean = RunnerRequest("m", [1, 2, 3], SamplingParams(), pooling_type="mean")
    last = RunnerRequest("l", [4, 5], SamplingParams(), pooling_type="last")
    step = RunnerStep([RunnerChunk(mean, 3, 0, False), RunnerChunk(last, 2, 0, False)])
    pending = pooled_chunks(torch.empty(5, 8, device="meta"), step)
    assert pending.reduced == ["m", "l"] and pending.values.device.type == "meta"
    hidden = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    launched = LaunchedStep(step, pooled=pooled_chunks(hidden, step))
    pooled = launched.finish().pooled
    assert torch.equal(pooled["m"].value, hidden[:3].sum(0)) and torch.equal(pooled["l"].value, hidden[4])
