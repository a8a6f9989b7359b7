"""CUDA graph memory: what capture measures, and what the KV sizing reserves for it.

No GPU here: capture runs against a model of the device's memory (torch.cuda's memory calls
patched), with the captures themselves replaced by allocations of known size.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vgraph.config import CudaGraphMode
from vgraph.worker.cuda_graphs import PIECE_GRAPH_BYTES, ForwardRunner, estimate_capture_bytes
from vgraph.worker.dispatch import Buckets

GIB = 1 << 30


class FakeDevice:
    """A GPU's memory as the caching allocator shapes it: free = total - other - allocated -
    cached; ``empty_cache`` hands the cached blocks back to the device."""

    def __init__(self, total: int, other: int, allocated: int, cached: int) -> None:
        self.total, self.other, self.allocated, self.cached = total, other, allocated, cached

    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        return self.total - self.other - self.allocated - self.cached, self.total

    def empty_cache(self) -> None:
        self.cached = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def _piecewise_runner(buckets: tuple[int, ...]) -> ForwardRunner:
    builder = SimpleNamespace(device=torch.device("cuda"), block_size=16, max_model_len=64)
    return ForwardRunner(lambda ids, pos: ids, [], 1.0, builder, CudaGraphMode.PIECEWISE,
                         Buckets((), buckets))


def test_capture_memory_is_measured_from_a_baseline_taken_after_emptying_the_cache(monkeypatch):
    """3 GiB sit in the allocator's cache when capture starts; the graphs take 1 GiB. A
    baseline read before ``empty_cache`` counted the cache as used and reported 0."""
    device = FakeDevice(total=80 * GIB, other=1 * GIB, allocated=10 * GIB, cached=3 * GIB)
    device.install(monkeypatch)
    runner = _piecewise_runner((8, 16))

    def capture_pieces(num_tokens: int, dummies: object) -> None:
        torch.cuda.empty_cache()  # what torch.cuda.graph does before each capture
        device.allocated += GIB // 2
    monkeypatch.setattr(runner, "_capture_pieces", capture_pieces)
    report = runner.capture(pool=None, dummies=None)
    assert report.piecewise_buckets == 2
    assert report.memory_bytes == GIB


def test_capture_empties_the_cache_once_then_reads_the_baseline(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append("mem_get_info") or (0, 0))
    runner = _piecewise_runner((8,))
    monkeypatch.setattr(runner, "_capture_pieces", lambda n, d: torch.cuda.empty_cache())
    runner.capture(pool=None, dummies=None)
    assert calls == ["empty_cache", "mem_get_info", "mem_get_info"], \
        "one empty_cache, before the baseline; the per-capture ones are skipped"


def _model(num_layers: int = 2) -> SimpleNamespace:
    return SimpleNamespace(dtype=torch.bfloat16, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                           head_dim=16, hidden_size=64)


def test_piecewise_buffers_count_three_q_three_kv_and_hidden_per_token_per_layer():
    """Per layer and token: the fused qkv (q + 2kv, kept whole because v leaves its piece as a
    strided view of it), q and k after rotary (q + kv), the staged attention output (q) and
    the residual (hidden): 3q + 3kv + hidden elements (the old estimate had 2q + 2kv +
    hidden); then the last piece's hidden output, the rotary cos and sin (head_dim) and the
    staged input ids and positions (two int64). An earlier estimate counted the 3q + 3kv +
    hidden for the last piece too, which has only its hidden output."""
    tokens, layers = 32, 2
    q, kv, hidden, head_dim, elt = 4 * 16, 2 * 16, 64, 16, 2
    estimate = estimate_capture_bytes(0.0, _model(layers), Buckets((), (8, tokens)), CudaGraphMode.PIECEWISE,
                                      max_model_len=64, block_size=16)
    buffers = tokens * (elt * (layers * (3 * q + 3 * kv + hidden) + hidden + head_dim) + 16)
    assert estimate == buffers + 2 * (layers + 1) * PIECE_GRAPH_BYTES
    assert buffers == 50688


def test_capture_estimate_adds_the_pool_at_the_largest_bucket():
    buckets = Buckets((), (8, 32))
    without = estimate_capture_bytes(0.0, _model(), buckets, CudaGraphMode.PIECEWISE, 64, 16)
    with_pool = estimate_capture_bytes(100.0, _model(), buckets, CudaGraphMode.PIECEWISE, 64, 16)
    assert with_pool - without == 100 * 32


def test_nothing_captured_reserves_nothing():
    assert estimate_capture_bytes(100.0, _model(), Buckets((1, 2), (8,)), CudaGraphMode.NONE, 64, 16) == 0
