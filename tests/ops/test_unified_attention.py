"""unified_attention: cache write + attention driven by the forward context.

The expected result is built from the references: the op's cache must equal the batch's
cache with the new tokens written, its output must equal paged_attention_reference, and
rows past the metadata's tokens (bucket padding) must write nothing and come back zero.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import vgraph.ops.unified_attention  # noqa: F401  (registers torch.ops.vgraph.unified_attention)
from tests.ops.test_attention import PAD, PagedBatch, make_batch
from tests.ops.tolerances import assert_close_rel
from vgraph.ops.attention import paged_attention_reference
from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]

MIXED = [(0, 1), (7, 1), PAD, (0, 6), (16, 3)]
DECODE = [(40, 1), (0, 1), PAD, (15, 1)]


def _metadata(b: PagedBatch, device: str, num_kv_splits: int = 1) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=b.slot_mapping.to(device), block_table=b.block_table.to(device),
        query_start_loc=b.query_start_loc.to(device), seq_lens=b.seq_lens.to(device),
        max_query_len=b.max_query_len, max_seq_len=int(b.seq_lens.max()),
        num_kv_splits=num_kv_splits)


def _blank_new_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache before this step: the new tokens' slots hold NaN, not their K/V yet."""
    cache = cache.clone()
    valid = slots[slots >= 0]
    cache[valid // cache.shape[1], valid % cache.shape[1]] = float("nan")
    return cache


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, torch.randn(rows, *t.shape[1:]).to(t.dtype)])


def _context(b: PagedBatch, device: str, num_kv_splits: int, num_layers: int = 2):
    caches = [(_blank_new_slots(b.k_cache, b.slot_mapping).to(device),
               _blank_new_slots(b.v_cache, b.slot_mapping).to(device)) for _ in range(num_layers)]
    return ForwardContext(attn_metadata=_metadata(b, device, num_kv_splits), kv_caches=caches,
                          softmax_scale=b.scale)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("specs,num_kv_splits,dtype", [
    (MIXED, 1, torch.float32), (MIXED, 4, torch.bfloat16),  # splits ignored: not pure decode
    (DECODE, 3, torch.float32), (DECODE, 1, torch.float16),
])
def test_matches_references_with_padding_rows(device, specs, num_kv_splits, dtype):
    b = make_batch(specs, 2, 4, 80, 16, dtype, extra_rows=3)
    q, k, v = b.q, _pad_rows(b.k, 3), _pad_rows(b.v, 3)
    ctx = _context(b, device, num_kv_splits)
    layer0_before = [t.cpu().clone() for t in ctx.kv_caches[0]]
    with set_forward_context(ctx):
        out = torch.ops.vgraph.unified_attention(q.to(device), k.to(device), v.to(device), 1)
    assert out.dtype == dtype and out.shape == q.shape
    assert _same_bytes(ctx.kv_caches[1][0], b.k_cache)
    assert _same_bytes(ctx.kv_caches[1][1], b.v_cache)
    assert all(_same_bytes(t, before) for t, before in zip(ctx.kv_caches[0], layer0_before))
    assert_close_rel(out, paged_attention_reference(*b.attention_args()))
    tail = int(b.query_start_loc[-1])
    assert torch.equal(out[tail:].cpu(), torch.zeros_like(q[tail:]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("specs,num_kv_splits", [(MIXED, 1), (DECODE, 2)])
def test_opcheck_inside_forward_context(device, specs, num_kv_splits):
    b = make_batch(specs, 1, 2, 64, 16, torch.float32, extra_rows=1)
    args = [b.q.to(device), _pad_rows(b.k, 1).to(device), _pad_rows(b.v, 1).to(device), 0]
    with set_forward_context(_context(b, device, num_kv_splits, num_layers=1)):
        torch.library.opcheck(torch.ops.vgraph.unified_attention.default, args)


class _OutputBuffers:
    """The PIECEWISE graphs' side of the forward context: one persistent buffer per layer,
    filled with NaN so a row the op fails to write shows."""

    def __init__(self, rows: int) -> None:
        self.rows, self.buffers = rows, {}

    def attention_output(self, layer_idx, shape, dtype, device):
        if layer_idx not in self.buffers:
            self.buffers[layer_idx] = torch.full((self.rows, *shape[1:]), float("nan"), dtype=dtype, device=device)
        return self.buffers[layer_idx][:shape[0]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("specs,num_kv_splits", [(MIXED, 1), (DECODE, 3)])
def test_writes_into_the_piecewise_graphs_buffer(device, specs, num_kv_splits):
    """Under PIECEWISE graphs the op returns the layer's persistent buffer, holding exactly
    what it returns without one (padding rows zero), so the next piece reads it in place."""
    b = make_batch(specs, 2, 4, 80, 16, torch.float32, extra_rows=3)
    q, k, v = b.q.to(device), _pad_rows(b.k, 3).to(device), _pad_rows(b.v, 3).to(device)
    with set_forward_context(_context(b, device, num_kv_splits)):
        expected = torch.ops.vgraph.unified_attention(q, k, v, 1)
    buffers = _OutputBuffers(rows=q.shape[0] + 5)
    ctx = _context(b, device, num_kv_splits)
    ctx.piecewise = buffers
    with set_forward_context(ctx):
        out = torch.ops.vgraph.unified_attention(q, k, v, 1)
    assert out.data_ptr() == buffers.buffers[1].data_ptr() and out.shape == q.shape
    assert list(buffers.buffers) == [1]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_compiles_as_one_opaque_call():
    """Dynamo traces through the fake impl with a dynamic token count; results match eager."""
    b = make_batch(MIXED, 1, 2, 64, 16, torch.float32)

    def layer(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.vgraph.unified_attention(x * 2.0, k, v, 0) + 1.0

    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    with set_forward_context(_context(b, "cpu", 1, num_layers=1)):
        expected = layer(b.q, b.k, b.v)
        assert_close_rel(compiled(b.q, b.k, b.v), expected)
    assert counter.frame_count == 1 and counter.op_count == 3


def test_outside_forward_context_raises():
    b = make_batch([(0, 2)], 1, 1, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="forward context"):
        torch.ops.vgraph.unified_attention(b.q, b.k, b.v, 0)


def test_bad_inputs_raise_value_error():
    b = make_batch([(3, 2)], 1, 2, 64, 16, torch.float32)
    with set_forward_context(_context(b, "cpu", 1, num_layers=1)):
        with pytest.raises(ValueError, match="layer_idx"):
            torch.ops.vgraph.unified_attention(b.q, b.k, b.v, 1)
        with pytest.raises(ValueError, match="slot_mapping has 2 entries for 1 tokens"):
            torch.ops.vgraph.unified_attention(b.q[:1], b.k[:1], b.v[:1], 0)
        with pytest.raises(ValueError, match="disagree"):
            torch.ops.vgraph.unified_attention(b.q, b.k[:1], b.v[:1], 0)
