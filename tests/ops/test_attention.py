"""Paged attention: reference vs SDPA, Triton kernels vs reference, opcheck, input errors.

Batches are built the way the runner builds them: caches start as NaN, each sequence's K/V
is written into randomly chosen (shuffled) blocks with reshape_and_cache, and the metadata
describes a flat batch of decode rows, plain prefills, prefills after a cached prefix and
padding sequences (seq_len 0). A kernel that reads a slot it should not sees NaN and fails.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import vgraph.ops.attention  # noqa: F401  (registers torch.ops.vgraph.paged_attention*)
from tests.ops.tolerances import assert_close_rel
from vgraph.ops.attention import (attend_causal, gather_kv, paged_attention_decode_split_kv_reference,
                                  paged_attention_reference)
from vgraph.ops.kernels.attention import (paged_attention_decode_split_kv_triton,
                                          paged_attention_triton)
from vgraph.ops.kv_cache import reshape_and_cache_reference

PAD = None  # a padding sequence in a spec list: seq_len 0


@dataclass
class PagedBatch:
    """Everything the attention ops take, on CPU; ``k``/``v`` are the new tokens' K/V."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    scale: float

    def attention_args(self, device: str = "cpu") -> list:
        tensors = [self.q, self.k_cache, self.v_cache, self.block_table, self.query_start_loc,
                   self.seq_lens]
        return [t.to(device) for t in tensors] + [self.max_query_len, self.scale]


def make_batch(specs: list, kv_heads: int, group: int, head_dim: int, block_size: int,
               dtype: torch.dtype, extra_rows: int = 0, pad_query_len: int = 1) -> PagedBatch:
    """specs: (context_len, query_len) per sequence, or PAD for a padding sequence.

    The cached prefix of every sequence is written into the cache; the new tokens' K/V are
    written too (as reshape_and_cache would before attention), and also returned in k/v.
    ``extra_rows`` appends query rows that belong to no sequence.
    """
    seq_lens = [0 if s is PAD else s[0] + s[1] for s in specs]
    q_lens = [pad_query_len if s is PAD else s[1] for s in specs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(max(blocks_per_seq), 1)
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks nobody owns stay NaN
    order = torch.randperm(num_blocks).tolist()
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    block_table = torch.zeros(len(specs), width, dtype=torch.int32)
    slot_mapping, new_k, new_v = [], [], []
    for i, (seq_len, q_len, n_blocks) in enumerate(zip(seq_lens, q_lens, blocks_per_seq)):
        blocks = [order.pop() for _ in range(n_blocks)]
        block_table[i, :n_blocks] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                              for p in range(seq_len)], dtype=torch.long)
        keys = torch.randn(seq_len, kv_heads, head_dim).to(dtype)
        values = torch.randn(seq_len, kv_heads, head_dim).to(dtype)
        reshape_and_cache_reference(keys, values, k_cache, v_cache, slots)
        if seq_len == 0:
            slots = torch.full((q_len,), -1, dtype=torch.long)
            keys = values = torch.zeros(q_len, kv_heads, head_dim, dtype=dtype)
        slot_mapping.append(slots[-q_len:] if q_len else slots[:0])
        new_k.append(keys[-q_len:] if q_len else keys[:0])
        new_v.append(values[-q_len:] if q_len else values[:0])
    total = sum(q_lens) + extra_rows
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return PagedBatch(
        q=torch.randn(total, kv_heads * group, head_dim).to(dtype),
        k=torch.cat(new_k), v=torch.cat(new_v), k_cache=k_cache, v_cache=v_cache,
        block_table=block_table, query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.cat(slot_mapping), max_query_len=max(q_lens + [0]),
        scale=head_dim ** -0.5)


def sdpa_for_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """torch's SDPA on one sequence: q [Q, Hq, D] are the last Q positions of keys [L, Hkv, D]."""
    num_q, num_k = q.shape[0], keys.shape[0]
    qh, kh, vh = (t.float().transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
    if num_q == num_k:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:  # causal with an offset: SDPA's is_causal is top-left aligned, so spell it out
        mask = torch.ones(num_q, num_k, dtype=torch.bool).tril(diagonal=num_k - num_q)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


MIXED = [(0, 1), (20, 1), PAD, (0, 9), (16, 16), (13, 5), PAD]
BOUNDARY_16 = [(31, 1), (32, 1), (15, 1), (0, 16), (0, 17), (16, 17)]  # seq_len 32/33/16/16/17/33
BOUNDARY_32 = [(0, 32), (0, 33), (63, 1), (32, 2)]

# (dtype, kv_heads, group, head_dim, block_size, specs): each entry covers several axes so
# the interpreted run stays short; together they span every required value.
ATTENTION_CASES = [
    pytest.param(torch.float32, 2, 1, 64, 16, MIXED, id="fp32-mha-d64-bs16-mixed"),
    pytest.param(torch.float32, 1, 4, 80, 16, BOUNDARY_16, id="fp32-gqa4-d80-bs16-boundaries"),
    pytest.param(torch.float32, 1, 7, 128, 32, MIXED, id="fp32-gqa7-d128-bs32-mixed"),
    pytest.param(torch.bfloat16, 2, 4, 128, 16, MIXED, id="bf16-gqa4-d128-bs16-mixed"),
    pytest.param(torch.bfloat16, 1, 7, 80, 32, BOUNDARY_32, id="bf16-gqa7-d80-bs32-boundaries"),
    pytest.param(torch.float16, 1, 1, 80, 32, MIXED, id="fp16-mha-d80-bs32-mixed"),
    pytest.param(torch.float16, 2, 7, 64, 16, BOUNDARY_16, id="fp16-gqa7-d64-bs16-boundaries"),
]


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,specs", [
    (2, 1, 64, 16, MIXED), (1, 4, 80, 16, BOUNDARY_16), (1, 7, 128, 32, BOUNDARY_32),
])
def test_reference_matches_sdpa(kv_heads, group, head_dim, block_size, specs):
    b = make_batch(specs, kv_heads, group, head_dim, block_size, torch.float32, extra_rows=2)
    out = paged_attention_reference(*b.attention_args())
    starts, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        rows = slice(starts[i], starts[i + 1])
        if seq_len == 0:
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))
            continue
        keys, values = gather_kv(b.k_cache, b.v_cache, b.block_table[i], seq_len)
        assert_close_rel(out[rows], sdpa_for_sequence(b.q[rows], keys, values, b.scale))
    assert torch.equal(out[starts[-1]:], torch.zeros_like(out[starts[-1]:]))


def test_attend_causal_matches_sdpa_with_repeat_interleave():
    q, keys, values = torch.randn(5, 8, 64), torch.randn(12, 2, 64), torch.randn(12, 2, 64)
    mask = torch.ones(5, 12, dtype=torch.bool).tril(diagonal=7)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.repeat_interleave(4, 1).transpose(0, 1),
        values.repeat_interleave(4, 1).transpose(0, 1), attn_mask=mask, scale=0.1)
    assert_close_rel(attend_causal(q, keys, values, 0.1), expected.transpose(0, 1))


@pytest.mark.parametrize("dtype,kv_heads,group,head_dim,block_size,specs", ATTENTION_CASES)
def test_paged_attention_triton_matches_reference(kernel_device: str, dtype, kv_heads, group,
                                                  head_dim, block_size, specs):
    b = make_batch(specs, kv_heads, group, head_dim, block_size, dtype, extra_rows=3)
    ref = paged_attention_reference(*b.attention_args())
    out = paged_attention_triton(*b.attention_args(kernel_device))
    assert out.dtype == dtype
    assert_close_rel(out, ref)
    tail = b.query_start_loc[-1].item()
    assert torch.equal(out[tail:].cpu(), torch.zeros_like(ref[tail:]))


def test_paged_attention_triton_loose_max_query_len(kernel_device: str):
    """A max_query_len above the true maximum (a stale host bound) changes nothing."""
    b = make_batch([(3, 2), (0, 4)], 1, 4, 64, 16, torch.float32)
    args = b.attention_args(kernel_device)
    args[6] = 40
    assert_close_rel(paged_attention_triton(*args), paged_attention_reference(*b.attention_args()))


def test_paged_attention_triton_strided_q(kernel_device: str):
    """q sliced out of a fused QKV projection is read through its strides."""
    b = make_batch([(5, 3), (0, 2)], 2, 2, 64, 16, torch.float32)
    fused = torch.cat([b.q, torch.randn(b.q.shape[0], 4, 64)], dim=1)
    args = b.attention_args(kernel_device)
    args[0] = fused.to(kernel_device)[:, :4]
    assert_close_rel(paged_attention_triton(*args), paged_attention_reference(*b.attention_args()))


SPLIT_KV_CASES = [
    pytest.param(torch.float32, 2, 1, 64, 16, [100, 0, 1, 32, 33], 4, id="fp32-mha-d64-bs16"),
    pytest.param(torch.float32, 1, 7, 80, 32, [64, 65, 0, 7], 8, id="fp32-gqa7-d80-bs32-emptysplits"),
    pytest.param(torch.bfloat16, 1, 4, 128, 16, [70, 16, 0], 3, id="bf16-gqa4-d128-bs16"),
    pytest.param(torch.float16, 2, 4, 80, 16, [48, 49, 2], 2, id="fp16-gqa4-d80-bs16"),
    # tiles spanning several cache blocks, split counts capped by the table (see test_attention_tiles)
    pytest.param(torch.bfloat16, 2, 4, 128, 16, [2000, 64, 65, 1, 0, 640], 7,
                 id="bf16-gqa4-d128-bs16-uneven-splits"),
    pytest.param(torch.bfloat16, 1, 8, 64, 32, [3000, 129, 63], 16, id="bf16-gqa8-d64-bs32"),
    pytest.param(torch.float16, 1, 3, 256, 128, [1000, 32, 33, 0], 5,
                 id="fp16-gqa3-d256-bs128-tile32"),
    pytest.param(torch.float16, 2, 1, 80, 48, [700, 48, 97], 64, id="fp16-mha-d80-bs48-capped"),
    pytest.param(torch.float32, 1, 4, 64, 8, [500, 17, 16, 0], 6, id="fp32-gqa4-d64-bs8"),
]


@pytest.mark.parametrize("dtype,kv_heads,group,head_dim,block_size,seq_lens,num_splits",
                         SPLIT_KV_CASES)
def test_split_kv_triton_matches_reference(kernel_device: str, dtype, kv_heads, group, head_dim,
                                           block_size, seq_lens, num_splits):
    specs = [PAD if n == 0 else (n - 1, 1) for n in seq_lens]
    b = make_batch(specs, kv_heads, group, head_dim, block_size, dtype)
    args = [b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens]
    ref = paged_attention_decode_split_kv_reference(*args, b.scale, num_splits)
    assert_close_rel(ref, paged_attention_reference(*b.attention_args()))
    out = paged_attention_decode_split_kv_triton(*[t.to(kernel_device) for t in args], b.scale,
                                                 num_splits)
    assert_close_rel(out, ref)
    padding = b.seq_lens == 0
    assert torch.equal(out.cpu()[padding], torch.zeros_like(ref[padding]))


def test_split_kv_more_splits_than_blocks_has_no_nan(kernel_device: str):
    b = make_batch([(0, 1), (2, 1), PAD], 1, 4, 64, 16, torch.float32)
    args = [t.to(kernel_device) for t in (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)]
    out = paged_attention_decode_split_kv_triton(*args, b.scale, 16)
    ref = paged_attention_decode_split_kv_reference(b.q, b.k_cache, b.v_cache, b.block_table,
                                                    b.seq_lens, b.scale, 16)
    assert_close_rel(out, ref)


def test_triton_kernels_write_into_a_callers_buffer(kernel_device: str):
    """``out=``: the kernels fill the buffer the caller keeps (PIECEWISE graphs' attention
    outputs) and return it; whatever it held before, padding rows come back as zeros."""
    b = make_batch(MIXED, 2, 2, 64, 16, torch.float32, extra_rows=3)
    args = b.attention_args(kernel_device)
    out = torch.full_like(args[0], float("nan"))
    assert paged_attention_triton(*args, out=out) is out
    assert_close_rel(out, paged_attention_reference(*b.attention_args()))
    assert torch.equal(out[b.query_start_loc[-1].item():].cpu(), torch.zeros(3, *out.shape[1:]))

    d = make_batch([(30, 1), PAD, (0, 1)], 1, 4, 64, 16, torch.float32)
    split_args = [t.to(kernel_device) for t in (d.q, d.k_cache, d.v_cache, d.block_table, d.seq_lens)]
    split_out = torch.full_like(split_args[0], float("nan"))
    assert paged_attention_decode_split_kv_triton(*split_args, d.scale, 3, out=split_out) is split_out
    assert_close_rel(split_out, paged_attention_decode_split_kv_reference(
        d.q, d.k_cache, d.v_cache, d.block_table, d.seq_lens, d.scale, 3))
    with pytest.raises(ValueError, match="does not match q"):
        paged_attention_triton(*args, out=out[:-1])


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_paged_attention(device: str):
    b = make_batch([(0, 3), (4, 1), PAD], 1, 4, 64, 16, torch.float32, extra_rows=1)
    torch.library.opcheck(torch.ops.vgraph.paged_attention.default, b.attention_args(device))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_split_kv(device: str):
    b = make_batch([(20, 1), PAD, (3, 1)], 2, 2, 64, 16, torch.float32)
    args = [t.to(device) for t in (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)]
    torch.library.opcheck(torch.ops.vgraph.paged_attention_decode_split_kv.default,
                          args + [b.scale, 2])


def _paged_args() -> dict:
    b = make_batch([(2, 2)], 2, 2, 64, 16, torch.float32)
    return dict(q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, block_table=b.block_table,
                query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, max_query_len=2,
                softmax_scale=b.scale)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(q=a["q"].half()), "dtype"),
    (lambda a: a.update(q=a["q"][:, :, :32]), "head_dim"),
    (lambda a: a.update(q=a["q"][:, :3]), "multiple of kv_heads"),
    (lambda a: a.update(block_table=a["block_table"].float()), "block_table"),
    (lambda a: a.update(query_start_loc=a["query_start_loc"][:1]), "query_start_loc"),
    (lambda a: a.update(seq_lens=a["seq_lens"].repeat(2)), "rows for"),
    (lambda a: a.update(v_cache=a["v_cache"].half()), "v_cache"),
    (lambda a: a.update(max_query_len=1), "max_query_len"),
    (lambda a: a.update(seq_lens=torch.ones_like(a["seq_lens"])), "seq_len 1 < query length"),
])
def test_paged_attention_bad_inputs_raise_value_error(change, message):
    args = _paged_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        torch.ops.vgraph.paged_attention(**args)


def test_split_kv_bad_inputs_raise_value_error():
    b = make_batch([(2, 1), (0, 1)], 1, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="one query row per sequence"):
        torch.ops.vgraph.paged_attention_decode_split_kv(
            b.q[:1], b.k_cache, b.v_cache, b.block_table, b.seq_lens, b.scale, 2)
    with pytest.raises(ValueError, match="num_splits"):
        torch.ops.vgraph.paged_attention_decode_split_kv(
            b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, b.scale, 0)
