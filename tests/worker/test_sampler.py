"""Sampler: greedy, seeds, truncation sets, penalties, logprobs and min_tokens against hand references."""
from __future__ import annotations

import math

import pytest
import torch

from tests.worker.test_results_on_device import read_entries
from vgraph.worker.runner_requests import RunnerRequest as Request
from vgraph.sampling_params import SamplingParams
from vgraph.worker.sampler import Sampler, SamplingMetadata, apply_penalties

V = 32


def _request(prompt=(1, 2, 3), output=(), eos=frozenset({0}), **params) -> Request:
    request = Request(request_id="r", prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(**params), eos_token_ids=frozenset(eos))
    request.output_token_ids = list(output)
    return request


def _sample(logits: torch.Tensor, requests: list[Request]):
    md = SamplingMetadata.from_requests(requests, logits.shape[-1], logits.device)
    return Sampler()(logits, md)


def _seeded_run(seed: int, logits_rows: list[torch.Tensor], others: int, steps: int = 5,
                position: int = 0) -> list[int]:
    """Tokens of one seeded request over ``steps`` steps, batched among ``others`` unseeded rows."""
    target = _request(temperature=0.9, top_p=0.95, seed=seed)
    tokens = []
    for step in range(steps):
        batch = [_request(temperature=1.0) for _ in range(others)]
        batch.insert(position, target)
        logits = torch.randn(len(batch), V)
        logits[position] = logits_rows[step]
        token = int(_sample(logits, batch).token_ids[position])
        target.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_greedy_is_argmax():
    logits = torch.randn(6, V)
    out = _sample(logits, [_request(temperature=0.0) for _ in range(6)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_seeded_rows_repeat_regardless_of_batch():
    rows = [torch.randn(V) for _ in range(5)]
    reference = _seeded_run(1234, rows, others=0)
    assert _seeded_run(1234, rows, others=3, position=2) == reference
    torch.manual_seed(99)  # the default RNG state must not matter either
    assert _seeded_run(1234, rows, others=5, position=5) == reference
    assert _seeded_run(4321, rows, others=0) != reference


def test_unseeded_rows_vary():
    logits = torch.zeros(1, V)
    draws = {int(_sample(logits, [_request()]).token_ids[0]) for _ in range(50)}
    assert len(draws) > 10


def _crafted_logits() -> torch.Tensor:
    """Distinct probabilities so every truncation set is unambiguous: p_i proportional to 2^-i/4."""
    return -torch.arange(V, dtype=torch.float32) * math.log(2) / 4


def _draws(params: dict, n: int = 400) -> set[int]:
    logits = _crafted_logits()[torch.randperm(V)]
    batch = [_request(**params) for _ in range(n)]
    tokens = _sample(logits.expand(n, V).contiguous(), batch).token_ids
    order = logits.argsort(descending=True).tolist()
    return {order.index(t) for t in tokens.tolist()}  # ranks of the drawn tokens


# Ranks kept, worked out by hand for p_i ~ 2^(-i/4) (masses 0.160, 0.134, 0.113, 0.095, 0.080, ...).
@pytest.mark.parametrize("params, expected_ranks", [
    ({"top_k": 3}, {0, 1, 2}),
    ({"top_k": 1, "temperature": 5.0}, {0}),
    ({"top_p": 0.3}, {0, 1, 2}),  # mass before rank 2 is 0.294 < 0.3, before rank 3 0.407
    ({"top_p": 0.05}, {0}),  # the most likely token always stays
    ({"min_p": 0.45}, {0, 1, 2, 3, 4}),  # 2^(-i/4) >= 0.45 <=> i <= 4
    # T=0.7: p_i ~ 2^(-i/2.8); top-10 renormalised reaches 0.9 before rank 8; min_p keeps i <= 6.
    ({"top_k": 10, "top_p": 0.9, "min_p": 0.2, "temperature": 0.7}, set(range(7))),
])
def test_truncation_draws_exactly_the_allowed_set(params, expected_ranks):
    assert _draws(params) == expected_ranks


def _reference_penalties(logits: torch.Tensor, request: Request) -> torch.Tensor:
    params = request.sampling_params
    out = logits.clone()
    for token in set(request.prompt_token_ids) | set(request.output_token_ids):
        value = out[token].item()
        out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(request.output_token_ids):
        count = request.output_token_ids.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def test_penalties_match_reference():
    requests = [
        _request(prompt=[1, 2, 2, 5], output=[5, 7, 7, 7, 9], temperature=0.0, repetition_penalty=1.3),
        _request(prompt=[4], output=[3, 3, 8], temperature=0.0, frequency_penalty=0.7),
        _request(prompt=[4], output=[3, 3, 8, 11], temperature=0.0, presence_penalty=1.5),
        _request(prompt=[6, 10], output=[10, 10, 12], temperature=0.0, repetition_penalty=0.8,
                 frequency_penalty=-0.5, presence_penalty=0.4),
        _request(prompt=[6], output=[], temperature=0.0),
    ]
    logits = torch.randn(len(requests), V) * 3
    md = SamplingMetadata.from_requests(requests, V, "cpu")
    got = apply_penalties(logits, md)
    expected = torch.stack([_reference_penalties(row, r) for row, r in zip(logits, requests)])
    torch.testing.assert_close(got, expected)
    out = Sampler()(logits, md)
    assert torch.equal(out.token_ids, expected.argmax(-1))


def test_logprobs_are_raw_log_softmax_with_top_n():
    logits = torch.randn(3, V) * 2
    requests = [_request(temperature=0.8, logprobs=4), _request(temperature=0.0, logprobs=0),
                _request(temperature=1.0, repetition_penalty=1.5, output=[5], logprobs=2)]
    out = _sample(logits, requests)
    entries = read_entries(out.logprobs, out.token_ids.tolist())
    reference = logits.log_softmax(-1)
    for row, n in enumerate([4, 0, 2]):
        entry = entries[row]
        chosen = int(out.token_ids[row])
        assert next(iter(entry)) == chosen
        assert entry[chosen] == pytest.approx(reference[row, chosen].item(), abs=1e-6)
        top = reference[row].topk(n).indices.tolist() if n else []
        assert set(entry) == set(top) | {chosen}
        for token in top:
            assert entry[token] == pytest.approx(reference[row, token].item(), abs=1e-6)


def test_logprobs_none_for_rows_that_did_not_ask():
    out = _sample(torch.randn(2, V), [_request(logprobs=1), _request()])
    entries = read_entries(out.logprobs, out.token_ids.tolist())
    assert entries[1] is None and len(entries[0]) in (1, 2)


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.full((4, V), -5.0)
    logits[:, 0] = 10.0  # EOS
    logits[:, 7] = 9.0  # stop token id
    requests = [
        _request(output=[1], min_tokens=3, stop_token_ids=[7], temperature=0.0),
        _request(output=[1, 2, 3], min_tokens=3, stop_token_ids=[7], temperature=0.0),  # reached
        _request(output=[], min_tokens=2, stop_token_ids=[7], ignore_eos=True, temperature=0.0),
        _request(output=[], min_tokens=5, stop_token_ids=[7], temperature=1.0),
    ]
    tokens = _sample(logits, requests).token_ids.tolist()
    assert tokens[0] not in (0, 7)
    assert tokens[1] == 0
    assert tokens[2] == 0  # with ignore_eos, EOS ends nothing, so it is not held back
    assert tokens[3] not in (0, 7)


def test_greedy_and_random_rows_mixed():
    logits = torch.randn(6, V)
    logits[:, 3] += 100.0  # the random rows' only plausible token at low temperature
    requests = [_request(temperature=0.0 if i % 2 else 0.01) for i in range(6)]
    out = _sample(logits, requests)
    greedy = logits.argmax(-1)
    assert out.token_ids.tolist() == greedy.tolist()
    wide = torch.randn(6, V)
    flat_requests = [_request(temperature=0.0 if i % 2 else 2.0, seed=i) for i in range(6)]
    tokens = _sample(wide, flat_requests).token_ids
    assert torch.equal(tokens[1::2], wide[1::2].argmax(-1))


def test_cuda_metadata_is_built_in_pinned_memory_and_copied_without_blocking(monkeypatch):
    """On a GPU every per-step tensor is built on the host in pinned memory and copied with
    ``non_blocking=True``. The device is mocked: host tensors are plain and the copy returns
    them, so the values can be compared with the CPU metadata."""
    requests = [_request(temperature=0.8, top_k=5, top_p=0.9, min_tokens=3, stop_token_ids=[3]),
                _request(temperature=0.0, min_p=0.1)]
    on_cpu = SamplingMetadata.from_requests(requests, V, "cpu")
    built, copies = [], []
    host_tensor = torch.tensor

    def tensor(data, *, dtype=None, pin_memory=False, **others):
        assert not others, f"built on the host only, got {others}"
        built.append(pin_memory)
        return host_tensor(data, dtype=dtype)

    def to(self, device, non_blocking=False):
        copies.append((torch.device(device), non_blocking))
        return self

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "to", to)
    on_cuda = SamplingMetadata.from_requests(requests, V, "cuda")
    monkeypatch.undo()
    assert built == [True] * 10, "temperature, greedy, top_k/p, min_p, 3 penalties, min_tokens rows/cols"
    assert copies == [(torch.device("cuda"), True)] * 10
    for name, value in vars(on_cpu).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(on_cuda, name), value), name
        else:
            assert getattr(on_cuda, name) == value, name


def test_metadata_cache_reuses_a_steady_batch_and_rebuilds_what_changes():
    """A decode batch of the same requests reuses its metadata; anything that changes per step
    (penalty counts, min_tokens bans) or per batch (other rows, grammar masks) rebuilds."""
    from vgraph.worker.sampler import SamplingMetadataCache
    cache = SamplingMetadataCache(32, torch.device("cpu"))
    a, b = _request(temperature=0.0), _request(temperature=0.7, top_k=5)
    first = cache.get([a, b])
    assert cache.get([a, b]) is first
    assert cache.get([b, a]) is not first, "another order is another batch"
    penalized = _request(frequency_penalty=0.5)
    assert cache.get([a, penalized]) is not cache.get([a, penalized]), "penalty counts change every step"
    banned = _request(min_tokens=3, max_tokens=8)
    assert cache.get([banned]) is not cache.get([banned]), "min_tokens bans end as tokens arrive"


def test_pending_tokens_are_counted_from_the_device():
    """A row's output may end in a ``PENDING`` placeholder (overlapped scheduling): its id comes
    as (row, id) tensors and counts like the known tokens."""
    from vgraph.worker.runner_requests import PENDING
    known = [_request(output=[3, 3, 8, 11], frequency_penalty=0.5), _request(output=[5], presence_penalty=1.0)]
    pending = [_request(output=[3, 3, 8, PENDING], frequency_penalty=0.5), _request(output=[5], presence_penalty=1.0)]
    want = SamplingMetadata.from_requests(known, V, "cpu").output_token_counts
    got = SamplingMetadata.from_requests(pending, V, "cpu", pending=(torch.tensor([0]), torch.tensor([11])))
    assert torch.equal(got.output_token_counts, want)
