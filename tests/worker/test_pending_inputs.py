"""Pending input ids (worker/launched.py): a step launched before the one ahead of it is read
takes those rows' input ids from that step's sampled tensor, on the device."""
from __future__ import annotations

import torch

from vgraph.sampling_params import SamplingParams
from vgraph.worker.launched import LaunchedStep, PendingInputs, PendingPrefix, pending_inputs
from vgraph.worker.runner_requests import RunnerChunk, RunnerRequest, RunnerStep


def _requests(*ids: str) -> list[RunnerRequest]:
    return [RunnerRequest(rid, [1, 2, 3], SamplingParams(temperature=0)) for rid in ids]


def _in_flight(requests: list[RunnerRequest], sampled: list[int]) -> LaunchedStep:
    """A launched, unfinished decode of ``requests``, whose ids will be ``sampled``."""
    step = RunnerStep([RunnerChunk(r, 1, r.num_tokens - 1, True) for r in requests])
    return LaunchedStep(step, requests, torch.tensor(sampled))


def _decode(requests: list[RunnerRequest]) -> list[RunnerChunk]:
    return [RunnerChunk(r, 1, r.num_tokens - 1, True) for r in requests]


def test_the_steady_decode_copies_a_prefix():
    a, b, c = _requests("a", "b", "c")
    earlier = _in_flight([a, b, c], [7, 8, 9])
    prefill = RunnerRequest("d", [4, 5], SamplingParams(temperature=0))
    feed = pending_inputs(RunnerStep([*_decode([a, b, c]), RunnerChunk(prefill, 2, 0, True)]), [earlier], "cpu")
    assert isinstance(feed, PendingPrefix) and feed.count == 3
    input_ids = torch.tensor([-1, -1, -1, 4, 5])
    feed.apply(input_ids)
    assert input_ids.tolist() == [7, 8, 9, 4, 5]


def test_a_changed_batch_takes_the_general_rows():
    a, b, c = _requests("a", "b", "c")
    earlier = _in_flight([a, b, c], [7, 8, 9])
    for order, want in (([a, c], [7, 9]), ([c, b, a], [9, 8, 7]), ([b, c], [8, 9])):
        feed = pending_inputs(RunnerStep(_decode(order)), [earlier], "cpu")
        assert isinstance(feed, PendingInputs)
        input_ids = torch.full((len(order),), -1)
        feed.apply(input_ids)
        assert input_ids.tolist() == want
