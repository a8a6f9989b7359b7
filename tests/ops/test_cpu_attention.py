"""The batched CPU paged attention (``ops/cpu_attention.py``) against the per-sequence reference.

Batches come from test_attention's builder: NaN caches, shuffled blocks, decode rows, plain
prefills, prefills after a cached prefix, padding sequences and rows past the last sequence.
The fast path pads every sequence to the longest, so a slot it should not read (NaN) or a
padded row it fails to drop shows up here. Tiny budgets force the tiling and grouping paths.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from tests.ops.test_attention import PAD, make_batch
from tests.ops.tolerances import assert_close_rel
from vgraph.ops import cpu_attention
from vgraph.ops.attention import (paged_attention_decode_split_kv_reference,
                                  paged_attention_reference)
from vgraph.ops.cpu_attention import (Segment, group_segments, paged_attention_cpu,
                                      paged_attention_decode_split_kv_cpu, tile_segment)

MIXED = [(0, 1), (20, 1), PAD, (0, 9), (16, 16), (13, 5), PAD, (100, 1), (37, 12)]
BOUNDARY_16 = [(31, 1), (32, 1), (15, 1), (0, 16), (0, 17), (16, 17), (47, 1), (48, 1)]
BOUNDARY_32 = [(0, 32), (0, 33), (63, 1), (64, 1), (32, 2), (31, 1), PAD]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check_against_reference(b, **budgets) -> torch.Tensor:
    """Runs the fast path, compares it with the reference and checks the zero rows."""
    ref = paged_attention_reference(*b.attention_args())
    out = paged_attention_cpu(*b.attention_args(), **budgets)
    assert out.dtype == ref.dtype
    assert_close_rel(out, ref)
    tail = int(b.query_start_loc[-1])
    assert torch.equal(out[tail:], torch.zeros_like(out[tail:]))
    starts = b.query_start_loc.tolist()
    for i in (b.seq_lens == 0).nonzero().flatten().tolist():
        rows = out[starts[i]:starts[i + 1]]
        assert torch.equal(rows, torch.zeros_like(rows))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 4), (2, 4), (1, 7)])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size,specs", [
    (16, MIXED), (32, MIXED), (16, BOUNDARY_16), (32, BOUNDARY_32),
], ids=["bs16-mixed", "bs32-mixed", "bs16-boundaries", "bs32-boundaries"])
def test_matches_reference(dtype, kv_heads, group, head_dim, block_size, specs):
    b = make_batch(specs, kv_heads, group, head_dim, block_size, dtype, extra_rows=3)
    check_against_reference(b)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_reference(seed):
    rng = random.Random(seed)
    specs = [PAD if rng.random() < 0.1 else
             (rng.randint(0, 70), 1 if rng.random() < 0.6 else rng.randint(1, 40))
             for _ in range(rng.randint(1, 24))]
    kv_heads, group = rng.choice([(1, 1), (2, 4), (1, 7), (4, 2)])
    b = make_batch(specs, kv_heads, group, rng.choice([64, 80]), rng.choice([16, 32]),
                   torch.float32, extra_rows=rng.randint(0, 4), pad_query_len=rng.randint(0, 3))
    check_against_reference(b)


@pytest.mark.parametrize("budgets", [
    dict(pair_budget=64), dict(pair_budget=1), dict(kv_budget_bytes=1),
    dict(pair_budget=300, kv_budget_bytes=64 * 2 * 64 * 4),
], ids=["tiled", "one-row-tiles", "one-seq-groups", "both"])
def test_small_budgets_tile_and_group_without_changing_results(budgets):
    b = make_batch(MIXED + BOUNDARY_16, 2, 4, 64, 16, torch.float32, extra_rows=2)
    check_against_reference(b, **budgets)


def test_padding_sequences_with_several_or_no_query_rows():
    for pad_query_len in (0, 3):
        b = make_batch([PAD, (5, 3), PAD, (0, 1), PAD], 1, 4, 64, 16, torch.float32,
                       extra_rows=1, pad_query_len=pad_query_len)
        check_against_reference(b)


def test_only_padding_gives_zeros():
    b = make_batch([PAD, PAD], 1, 2, 64, 16, torch.float32, extra_rows=2)
    out = check_against_reference(b)
    assert torch.equal(out, torch.zeros_like(out))


def test_stale_block_table_entries_past_the_end_are_never_read():
    b = make_batch([(3, 1), (40, 2), (0, 5)], 2, 2, 64, 16, torch.float32)
    width = b.block_table.shape[1]
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        b.block_table[i, -(-seq_len // 16):] = 10 ** 6 + torch.arange(width - (-(-seq_len // 16)))
    check_against_reference(b)


def test_strided_q_and_loose_max_query_len():
    b = make_batch([(5, 3), (0, 2), (9, 1)], 2, 2, 64, 16, torch.float32)
    ref = paged_attention_reference(*b.attention_args())
    args = b.attention_args()
    args[0] = torch.cat([b.q, torch.randn(b.q.shape[0], 4, 64)], dim=1)[:, :4]
    args[6] = 40
    assert_close_rel(paged_attention_cpu(*args), ref)


def test_gathers_too_big_for_the_workspace_use_fresh_tensors(monkeypatch):
    monkeypatch.setattr(cpu_attention, "KV_BUDGET_BYTES", 4096)
    b = make_batch(MIXED, 2, 4, 64, 16, torch.float32, extra_rows=1)
    check_against_reference(b)


def test_workspace_made_in_inference_mode_works_outside_it():
    """A new thread gets fresh buffers; made under inference_mode they must still be writable."""
    b = make_batch(MIXED, 1, 4, 64, 16, torch.float32)
    ref = paged_attention_reference(*b.attention_args())
    results, errors = [], []

    def run() -> None:
        try:
            with torch.inference_mode():
                results.append(torch.ops.vgraph.paged_attention(*b.attention_args()))
            results.append(torch.ops.vgraph.paged_attention(*b.attention_args()))
        except Exception as exc:  # re-raised in the test thread below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors, errors
    for out in results:
        assert_close_rel(out, ref)


def test_the_cpu_op_dispatches_to_the_batched_kernel(monkeypatch):
    calls = []
    original = cpu_attention.paged_attention_cpu
    monkeypatch.setattr(cpu_attention, "paged_attention_cpu",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    b = make_batch([(4, 1), (0, 3)], 1, 4, 64, 16, torch.float32)
    assert_close_rel(torch.ops.vgraph.paged_attention(*b.attention_args()),
                     paged_attention_reference(*b.attention_args()))
    b = make_batch([(4, 1), (9, 1)], 1, 4, 64, 16, torch.float32)
    args = [b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, b.scale, 3]
    assert_close_rel(torch.ops.vgraph.paged_attention_decode_split_kv(*args),
                     paged_attention_decode_split_kv_reference(*args))
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens", [[100, 0, 1, 32, 33], [64, 65, 0, 7, 16, 17]])
def test_split_kv_matches_reference(dtype, seq_lens):
    specs = [PAD if n == 0 else (n - 1, 1) for n in seq_lens]
    b = make_batch(specs, 1, 4, 80, 16, dtype)
    args = [b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, b.scale]
    ref = paged_attention_decode_split_kv_reference(*args, 4)
    out = paged_attention_decode_split_kv_cpu(*args, 4)
    assert_close_rel(out, ref)
    padding = b.seq_lens == 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))


def test_block_table_too_narrow_raises_value_error():
    b = make_batch([(20, 1)], 1, 1, 64, 16, torch.float32)
    args = b.attention_args()
    args[3] = args[3][:, :1]
    with pytest.raises(ValueError, match="block table"):
        torch.ops.vgraph.paged_attention(*args)


def test_opcheck_on_a_mixed_batch():
    b = make_batch(MIXED, 2, 4, 80, 32, torch.float32, extra_rows=2)
    torch.library.opcheck(torch.ops.vgraph.paged_attention.default, b.attention_args())


def test_tiles_cover_the_rows_with_their_causal_keys():
    seg = Segment(seq=3, start=10, q_len=7, seq_len=12)  # 5 cached keys, then 7 new rows
    tiles = tile_segment(seg, pair_budget=24)  # 24 // 12 = 2 rows per tile
    assert [(t.start, t.q_len, t.seq_len) for t in tiles] == [
        (10, 2, 7), (12, 2, 9), (14, 2, 11), (16, 1, 12)]
    assert all(t.seq == 3 for t in tiles)
    assert tile_segment(seg, pair_budget=10 ** 6) == [seg]


def test_groups_keep_decodes_away_from_long_prefills():
    decodes = [Segment(i, i, 1, 50 + 10 * i) for i in range(32)]
    prefill = Segment(32, 32, 2000, 2000)
    groups = list(group_segments([prefill] + decodes, pair_budget=1 << 24, kv_rows_budget=1 << 20))
    assert groups == [decodes, [prefill]]


def test_groups_respect_the_budgets():
    segments = [Segment(i, 4 * i, 4, 100) for i in range(10)]
    groups = list(group_segments(segments, pair_budget=1200, kv_rows_budget=10 ** 6))
    assert [len(g) for g in groups] == [3, 3, 3, 1]
    groups = list(group_segments(segments, pair_budget=10 ** 6, kv_rows_budget=250))
    assert [len(g) for g in groups] == [2] * 5


def test_the_plan_is_made_once_per_forward_and_only_for_its_own_metadata(monkeypatch):
    """Every layer of a forward shares the metadata, so the host-side plan is reused; a
    new forward (even re-entering the same context, whose buffers may have been refilled in
    place), or tensors that are not the forward's metadata, get a fresh plan."""
    from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context
    b = make_batch(MIXED, 2, 4, 64, 16, torch.float32)
    q, k_cache, v_cache, block_table, query_start_loc, seq_lens, max_q, scale = b.attention_args()
    plans = []
    real = cpu_attention.plan_batch
    monkeypatch.setattr(cpu_attention, "plan_batch", lambda *a: plans.append(a) or real(*a))
    meta = AttentionMetadata(slot_mapping=torch.zeros(q.shape[0], dtype=torch.long), block_table=block_table,
                             query_start_loc=query_start_loc, seq_lens=seq_lens, max_query_len=max_q,
                             max_seq_len=int(seq_lens.max()))
    ref = paged_attention_reference(*b.attention_args())
    ctx = ForwardContext(meta, [(k_cache, v_cache)], scale)
    for _ in range(2):  # two forwards in one context object (as a graph body is re-run)
        with set_forward_context(ctx):
            for _ in range(3):  # three layers
                assert_close_rel(paged_attention_cpu(*b.attention_args()), ref)
    assert len(plans) == 2
    with set_forward_context(ForwardContext(meta, [(k_cache, v_cache)], scale)):
        other = seq_lens.clone()  # equal values, but not the forward's tensor
        paged_attention_cpu(q, k_cache, v_cache, block_table, query_start_loc, other, max_q, scale)
        paged_attention_cpu(q, k_cache, v_cache, block_table, query_start_loc, other, max_q, scale)
    assert len(plans) == 4
    paged_attention_cpu(*b.attention_args())  # outside any forward
    assert len(plans) == 5


def test_prefills_without_context_take_causal_sdpa_and_the_rest_the_masked_groups(monkeypatch):
    b = make_batch([(0, 40), (16, 20), (0, 1), (7, 1)], 2, 4, 64, 16, torch.float32)
    fresh, grouped = [], []
    real_fresh, real_group = cpu_attention.attend_fresh_prefill, cpu_attention.attend_group
    monkeypatch.setattr(cpu_attention, "attend_fresh_prefill",
                        lambda *a: fresh.append(a[4].seq) or real_fresh(*a))
    monkeypatch.setattr(cpu_attention, "attend_group",
                        lambda *a: grouped.extend(s.seq for s in a[4]) or real_group(*a))
    check_against_reference(b, native_kernel=False)
    assert sorted(fresh) == [0, 2] and sorted(grouped) == [1, 3]  # 2: a one-token prompt


def step_rows_of_the_cache(b, cache: torch.Tensor) -> torch.Tensor:
    """The K (or V) row each query row wrote into ``cache``: what unified_attention hands over
    as ``new_kv``. Rows of padding sequences and past the last sequence stay NaN (never read)."""
    block_size = cache.shape[1]
    rows = torch.full((b.q.shape[0], *cache.shape[2:]), float("nan"), dtype=cache.dtype)
    starts, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            pos = seq_len - q_len + j
            rows[starts[i] + j] = cache[int(b.block_table[i, pos // block_size]), pos % block_size]
    return rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_prefills_read_the_steps_own_kv_rows_with_the_same_result(dtype, monkeypatch):
    b = make_batch([(0, 40), (16, 20), (0, 1), PAD, (7, 1), (0, 23)], 2, 4, 64, 16, dtype, extra_rows=2)
    args = b.attention_args()
    new_kv = (step_rows_of_the_cache(b, args[1]), step_rows_of_the_cache(b, args[2]))
    calls = []
    real_gather = cpu_attention.gather_kv
    monkeypatch.setattr(cpu_attention, "gather_kv", lambda *a: calls.append(1) or real_gather(*a))
    out = paged_attention_cpu(*args, native_kernel=False, new_kv=new_kv)
    with_new_kv, calls[:] = len(calls), []
    assert torch.equal(paged_attention_cpu(*args, native_kernel=False), out)
    assert len(calls) == with_new_kv + 6  # the 3 fresh prefills (0, 2, 5) no longer gather K and V
    assert_close_rel(out, paged_attention_reference(*args))
