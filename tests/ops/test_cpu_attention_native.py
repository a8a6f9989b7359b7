"""The C++ CPU paged-attention kernels (``ops/csrc/paged_attention_cpu.cpp`` for short
segments, ``ops/csrc/prefill_attention_cpu.cpp`` for long ones), their ctypes binding
(``cpu_attention_native``) and their builder (``native_build``).

``paged_attention_cpu`` sends segments of at most ``MAX_QUERY_ROWS`` query rows to the short
kernel and longer ones to the prefill kernel; without them, everything goes to gather + SDPA.
Here the routes are checked against the per-sequence reference and against each other
(``VGRAPH_CPU_ATTENTION=torch`` forces SDPA for all rows), spies prove which segments took
which route, and the kernels' own contract is checked: arbitrary cache strides, bit-identical
results for any thread count, out-of-range block ids reported as a ValueError naming the
sequence. The builder's cache (one file per key, reuse
without a compiler call, a private fallback when the cache is not writable, clear errors)
and the op's fallback to the torch path without a compiler are checked last.

Batches come from test_attention's builder: NaN-filled caches and shuffled blocks, so a read
of a slot the kernel should not touch shows up as NaN.
"""
from __future__ import annotations

import ctypes
import logging
import os
import random
import shutil
import threading
import types
from pathlib import Path

import pytest
import torch

from tests.ops.test_attention import PAD, make_batch
from tests.ops.tolerances import assert_close_rel
from vgraph.ops import cpu_attention, cpu_attention_native as native, native_build
from vgraph.ops.attention import paged_attention_reference
from vgraph.ops.cpu_attention import paged_attention_cpu
from vgraph.ops.native_build import NativeBuildError

M = native.MAX_QUERY_ROWS
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NO_CXX = "/nonexistent/vgraph-no-such-c++"

requires_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX") or "c++") is None,
    reason="no C++ compiler: the kernel cannot be built here")

# Decode rows, short chunks of 2..M rows (after a context and from scratch), segments of
# exactly M and M + 1 rows, a long prefill, padding sequences, and decode rows whose
# seq_len sits on either side of a block boundary for both block sizes.
MIXED = [(0, 1), (20, 1), PAD, (5, 2), (13, 5), (0, 9), (16, M), (0, M), (0, M + 1),
         (16, M + 1), PAD, (100, 1), (31, 1), (32, 1), (63, 1), (64, 1), (37, 12), (3, 40)]


def segment_tuples(b, short: bool) -> set[tuple[int, int, int, int]]:
    """(sequence, first row, rows, seq_len) of the batch's short (<= M rows) or long segments."""
    starts, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    result = set()
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if seq_len == 0 or q_len == 0 or (q_len <= M) != short:
            continue
        result.add((i, starts[i], q_len, seq_len))
    return result


def assert_zero_rows_outside_sequences(b, out: torch.Tensor) -> None:
    """Padding sequences' rows and rows past the last sequence are exactly zero."""
    starts = b.query_start_loc.tolist()
    assert torch.equal(out[starts[-1]:], torch.zeros_like(out[starts[-1]:]))
    for i in (b.seq_lens == 0).nonzero().flatten().tolist():
        rows = out[starts[i]:starts[i + 1]]
        assert torch.equal(rows, torch.zeros_like(rows))


@pytest.fixture
def routes(monkeypatch):
    """Records the segments each route gets: ``native`` (the short-segment C++ kernel),
    ``tiled`` (the C++ prefill kernel) and ``sdpa`` (grouped masked SDPA, or causal SDPA for a
    prefill without cached context)."""
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    calls = types.SimpleNamespace(native=[], tiled=[], sdpa=[])
    real_native, real_group = native.attend_segments, cpu_attention.attend_group

    def native_spy(q, k_cache, v_cache, block_table, segments, scale, out, long_segments=False, *rest):
        rows = segments.tolist() if isinstance(segments, torch.Tensor) else segments
        (calls.tiled if long_segments else calls.native).extend(tuple(s) for s in rows)
        return real_native(q, k_cache, v_cache, block_table, segments, scale, out, long_segments, *rest)

    def group_spy(q, k_cache, v_cache, block_table, segments, scale, out, *rest):
        calls.sdpa.extend((s.seq, s.start, s.q_len, s.seq_len) for s in segments)
        return real_group(q, k_cache, v_cache, block_table, segments, scale, out, *rest)

    real_fresh = cpu_attention.attend_fresh_prefill

    def fresh_spy(q, k_cache, v_cache, block_table, seg, scale, out, new_kv=None, *rest):
        calls.sdpa.append((seg.seq, seg.start, seg.q_len, seg.seq_len))
        return real_fresh(q, k_cache, v_cache, block_table, seg, scale, out, new_kv, *rest)

    monkeypatch.setattr(cpu_attention.native, "attend_segments", native_spy)
    monkeypatch.setattr(cpu_attention, "attend_group", group_spy)
    monkeypatch.setattr(cpu_attention, "attend_fresh_prefill", fresh_spy)

    def reset() -> None:
        calls.native.clear()
        calls.tiled.clear()
        calls.sdpa.clear()

    calls.reset = reset
    return calls


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_load_library():
    """``load_library`` forgets what it loaded, before and after: the next caller loads again
    (from its cache dir, without compiling when the library is there)."""
    native_build.load_library.cache_clear()
    yield
    native_build.load_library.cache_clear()


# --- 1. kernel and SDPA routes against the reference and each other -------------------------

@requires_compiler
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 2), (2, 4), (1, 7)],
                         ids=["mha", "gqa2", "gqa4", "gqa7"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_and_sdpa_routes_match_reference(monkeypatch, routes, dtype, kv_heads, group,
                                                head_dim, block_size, table_dtype):
    b = make_batch(MIXED, kv_heads, group, head_dim, block_size, dtype, extra_rows=3,
                   pad_query_len=2)
    args = b.attention_args()
    args[3] = args[3].to(table_dtype)
    ref = paged_attention_reference(*args)
    short, long = segment_tuples(b, short=True), segment_tuples(b, short=False)
    assert {s[2] for s in short} >= {1, 2, M} and {s[2] for s in long} >= {M + 1}

    out_native = paged_attention_cpu(*args)
    assert out_native.dtype == dtype
    assert_close_rel(out_native, ref)
    assert_zero_rows_outside_sequences(b, out_native)
    # Every short segment went to the short kernel, once, every long one to the prefill
    # kernel, and SDPA got nothing.
    assert sorted(routes.native) == sorted(short)
    assert sorted(routes.tiled) == sorted(long)
    assert routes.sdpa == []

    routes.reset()
    monkeypatch.setenv(native.ENV_SWITCH, "torch")
    out_torch = paged_attention_cpu(*args)
    assert routes.native == routes.tiled == []
    assert {s[0] for s in routes.sdpa} == {s[0] for s in short | long}
    assert_close_rel(out_torch, ref)
    assert_close_rel(out_native, out_torch)
    assert_zero_rows_outside_sequences(b, out_torch)


@requires_compiler
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_writes_exactly_its_segments_rows(dtype):
    """Called directly: the segments' rows hold the reference's result in float32, and every
    other row of ``out`` is left as it was (it holds the SDPA route's rows in the op)."""
    b = make_batch([(7, 1), (0, 3), (40, M), (2, 5), PAD, (70, 1)], 2, 4, 64, 16, dtype,
                   extra_rows=2)
    ref = paged_attention_reference(*b.attention_args())
    chosen = [(0, 0, 1, 8), (2, 4, M, 40 + M), (5, 4 + M + 5 + 1, 1, 71)]
    assert all(seg in segment_tuples(b, short=True) for seg in chosen)
    out = torch.full(b.q.shape, 7.0)
    native.attend_segments(b.q, b.k_cache, b.v_cache, b.block_table, chosen, b.scale, out)
    written = torch.zeros(b.q.shape[0], dtype=torch.bool)
    for _, start, q_len, _ in chosen:
        written[start:start + q_len] = True
        assert_close_rel(out[start:start + q_len], ref[start:start + q_len], dtype)
    assert torch.equal(out[~written], torch.full_like(out[~written], 7.0))


@requires_compiler
@pytest.mark.parametrize("block_size", [1, 24, 48, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_kernel_across_softmax_chunks(dtype, block_size):
    """The short kernel updates its softmax once per chunk of blocks (64 keys, or one block
    when a block is longer): block sizes that fill a chunk exactly, partly (24: two blocks
    are 48 keys) or exceed it, and segments whose causal edge falls inside, on, and across
    a chunk boundary (a 12-row chunk over keys 59..70, decode rows at 64, 65, 128, 129)."""
    specs = [(63, 1), (64, 1), (127, 1), (128, 1), (58, 12), (120, M), (200, 1)]
    b = make_batch(specs, 2, 4, 64, block_size, dtype, extra_rows=1)
    ref = paged_attention_reference(*b.attention_args())
    chosen = sorted(segment_tuples(b, short=True))
    assert len(chosen) == len(specs)
    out = torch.full(b.q.shape, 7.0)
    native.attend_segments(b.q, b.k_cache, b.v_cache, b.block_table, chosen, b.scale, out)
    for _, start, q_len, _ in chosen:
        assert_close_rel(out[start:start + q_len], ref[start:start + q_len], dtype)


@requires_compiler
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4), (1, 7), (1, 40)],
                         ids=["mha", "gqa4", "gqa7", "gqa40"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_kernel_writes_exactly_its_segments_rows(dtype, kv_heads, group):
    """The prefill kernel called directly, on segments of every length class: one query tile
    or several, key tiles before the diagonal or not, with and without cached context, and
    GQA groups whose rows fill a vector, several, or part of one (40 query heads per KV head
    make one tile of 64 rows plus padding). Other rows of ``out`` are left as they were."""
    specs = [(0, M + 1), (5, 200), PAD, (64, 63), (0, 64), (130, 65), (1, 129), (7, 1)]
    b = make_batch(specs, kv_heads, group, 64, 16, dtype, extra_rows=2)
    ref = paged_attention_reference(*b.attention_args())
    chosen = sorted(segment_tuples(b, short=False))
    assert len(chosen) == 6
    out = torch.full(b.q.shape, 7.0)
    native.attend_segments(b.q, b.k_cache, b.v_cache, b.block_table, chosen, b.scale, out,
                           long_segments=True)
    written = torch.zeros(b.q.shape[0], dtype=torch.bool)
    for _, start, q_len, _ in chosen:
        written[start:start + q_len] = True
        assert_close_rel(out[start:start + q_len], ref[start:start + q_len], dtype)
    assert torch.equal(out[~written], torch.full_like(out[~written], 7.0))


@requires_compiler
@pytest.mark.parametrize("head_dim", [7, 17, 40, 129])
def test_head_dims_off_the_vector_width(routes, head_dim):
    """Scalar tails of the dot products and the V accumulation (the AVX2 loops take 8-32 lanes;
    the prefill kernel's micro-tiles take 6 head-dim values at a time)."""
    b = make_batch([(0, 1), (9, 3), (33, 1), (20, M), (0, 50), (11, 30)], 2, 2, head_dim, 16,
                   torch.float32, extra_rows=1)
    assert_close_rel(paged_attention_cpu(*b.attention_args()),
                     paged_attention_reference(*b.attention_args()))
    assert len(routes.native) == 4 and len(routes.tiled) == 2


@requires_compiler
def test_peaked_softmax_matches_reference(routes):
    """Scores spanning hundreds: the kernels' exp approximation and running-max rescaling."""
    b = make_batch([(0, 1), (50, 1), (17, 6), (90, M), (5, 2), (0, 150), (70, 90)], 2, 4, 64,
                   16, torch.float32)
    b.q *= 30.0
    assert_close_rel(paged_attention_cpu(*b.attention_args()),
                     paged_attention_reference(*b.attention_args()))
    assert len(routes.native) == 5 and len(routes.tiled) == 2


@requires_compiler
def test_float16_subnormal_cache_values(routes):
    """K/V made only of float16 subnormals: the kernel's half-to-float conversion must keep
    them (flushing them to zero would give zero outputs)."""
    b = make_batch([(12, 1), (30, 4), (3, 2), (0, 40)], 2, 2, 64, 16, torch.float16)
    tiny = torch.finfo(torch.float16).tiny  # smallest normal; values below it are subnormal
    for cache in (b.k_cache, b.v_cache):
        finite = ~cache.isnan()
        cache[finite] = (cache[finite].float() * tiny / 8).to(torch.float16)
    v = b.v_cache[~b.v_cache.isnan()]
    assert (v.abs() < tiny).all() and (v != 0).float().mean() > 0.9
    ref = paged_attention_reference(*b.attention_args())
    out = paged_attention_cpu(*b.attention_args())
    assert ref.abs().max() > 0
    assert_close_rel(out, ref)
    assert len(routes.native) == 3 and len(routes.tiled) == 1


# --- 2. caches and block tables read through their strides ----------------------------------

def restride(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The same [blocks, block_size, kv_heads, head_dim] values in another memory layout;
    memory outside the view is NaN."""
    nb, bs, heads, dim = cache.shape
    nan = float("nan")
    if layout == "head_dim_slice":      # the cache is part of a wider row (fused K|V rows)
        big = torch.full((nb, bs, heads, dim + 24), nan, dtype=cache.dtype)
        big[..., 8:8 + dim] = cache
        return big[..., 8:8 + dim]
    if layout == "kv_head_slice":       # a tensor-parallel shard of the heads
        big = torch.full((nb, bs, heads + 2, dim), nan, dtype=cache.dtype)
        big[:, :, 1:1 + heads] = cache
        return big[:, :, 1:1 + heads]
    if layout == "head_major":          # stored [blocks, kv_heads, block_size, dim]
        return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    if layout == "interleaved_blocks":  # K and V blocks alternating in one tensor
        big = torch.full((2 * nb, bs, heads, dim), nan, dtype=cache.dtype)
        big[1::2] = cache
        return big[1::2]
    if layout == "strided_head_dim":    # head_dim itself not unit-stride
        big = torch.full((nb, bs, heads, dim, 2), nan, dtype=cache.dtype)
        big[..., 1] = cache
        return big[..., 1]
    raise AssertionError(layout)


@requires_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_layout,v_layout", [
    ("head_dim_slice", "head_dim_slice"), ("kv_head_slice", "head_major"),
    ("head_major", "interleaved_blocks"), ("interleaved_blocks", "kv_head_slice"),
    ("head_dim_slice", "strided_head_dim"), ("strided_head_dim", "head_dim_slice"),
])
def test_strided_caches_match_reference(monkeypatch, routes, dtype, k_layout, v_layout):
    b = make_batch([(0, 1), (20, 1), (13, 5), (16, M), (3, M + 4), PAD, (45, 1)], 3, 2, 64,
                   16, dtype, extra_rows=1)
    ref = paged_attention_reference(*b.attention_args())
    args = b.attention_args()
    args[1], args[2] = restride(b.k_cache, k_layout), restride(b.v_cache, v_layout)
    assert not args[1].is_contiguous() and not args[2].is_contiguous()
    assert torch.equal(args[1].nan_to_num(), b.k_cache.nan_to_num())

    out = paged_attention_cpu(*args)
    assert_close_rel(out, ref)
    # The kernels take any cache strides with a unit-stride head_dim in K (V is copied when
    # needed); a K cache without one goes to SDPA whole.
    strided_k = k_layout == "strided_head_dim"
    assert set(routes.native) == (set() if strided_k else segment_tuples(b, True))
    assert set(routes.tiled) == (set() if strided_k else segment_tuples(b, False))

    monkeypatch.setenv(native.ENV_SWITCH, "torch")
    assert_close_rel(paged_attention_cpu(*args), ref)


@requires_compiler
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["row_slice", "column_major", "shared_row_offset"])
def test_strided_block_tables(routes, table_dtype, layout):
    b = make_batch([(0, 1), (40, 1), (13, 5), (70, 3), (20, 45)], 1, 4, 64, 16, torch.float32)
    ref = paged_attention_reference(*b.attention_args())
    table = b.block_table.to(table_dtype)
    n, width = table.shape
    if layout == "row_slice":           # rows of a wider table: stride(0) > width
        big = torch.full((n, width + 5), -7, dtype=table_dtype)
        big[:, 2:2 + width] = table
        table = big[:, 2:2 + width]
    elif layout == "column_major":      # stride(1) != 1
        table = table.t().contiguous().t()
    else:                               # a view starting mid-storage
        big = torch.full((n + 3, width), -7, dtype=table_dtype)
        big[3:] = table
        table = big[3:]
    args = b.attention_args()
    args[3] = table
    assert_close_rel(torch.ops.vgraph.paged_attention(*args), ref)
    assert len(routes.native) == 4 and len(routes.tiled) == 1


# --- 3. threads ------------------------------------------------------------------------------

@requires_compiler
@pytest.mark.parametrize("num_seqs", [1, 3, 20])
@pytest.mark.parametrize("kv_heads,group", [(4, 1), (3, 2), (1, 7)])
def test_two_threads_give_bit_identical_results(routes, restore_threads, num_seqs, kv_heads,
                                                group):
    """With few segments the short kernel splits the KV heads of one segment across threads;
    the prefill kernel gives each (segment, KV head, query tile) to one thread."""
    rng = random.Random(num_seqs * 10 + kv_heads)
    specs = [(rng.randint(0, 80), rng.choice([1, 1, 2, 5, M, 40, 150])) for _ in range(num_seqs)]
    b = make_batch(specs, kv_heads, group, 64, 16, torch.bfloat16, extra_rows=1)
    results = []
    for threads in (1, 2, 1, 2):
        torch.set_num_threads(threads)
        results.append(paged_attention_cpu(*b.attention_args()))
    assert len(routes.native) + len(routes.tiled) == 4 * num_seqs and routes.sdpa == []
    for out in results[1:]:
        assert torch.equal(out, results[0])
    assert_close_rel(results[0], paged_attention_reference(*b.attention_args()))


@requires_compiler
def test_concurrent_callers_get_their_own_results(routes):
    """The kernel's per-thread scratch buffers: two Python threads calling at once (ctypes
    releases the GIL) get what each gets alone."""
    batches = [make_batch([(i * 7, 1 + i % 3) for i in range(n)], 2, 4, 64, 16, torch.float32)
               for n in (5, 9)]
    expected = [paged_attention_cpu(*b.attention_args()) for b in batches]
    results: list[list] = [[], []]
    errors = []

    def work(index: int) -> None:
        try:
            for _ in range(20):
                results[index].append(paged_attention_cpu(*batches[index].attention_args()))
        except Exception as exc:  # re-raised in the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index in range(2):
        assert len(results[index]) == 20
        assert all(torch.equal(out, expected[index]) for out in results[index])


# --- 4. block ids outside the cache ---------------------------------------------------------

@requires_compiler
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bad", ["num_blocks", "-1", "huge"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel", ["short", "prefill"])
def test_block_id_outside_the_cache_raises_naming_the_sequence(restore_threads, table_dtype,
                                                               bad, threads, kernel):
    """Sequences 2 and 4 are short segments, or long ones (the prefill kernel's)."""
    torch.set_num_threads(threads)
    rows = {"short": (3, M), "prefill": (30, 40)}[kernel]
    b = make_batch([(4, 1), (30, 1), (20, rows[0]), (0, 2), (50, rows[1])], 2, 2, 64, 16,
                   torch.float32)
    args = b.attention_args()
    num_blocks = b.k_cache.shape[0]
    value = {"num_blocks": num_blocks, "-1": -1,
             "huge": 2 ** 40 if table_dtype == torch.int64 else 2 ** 31 - 1}[bad]
    table = b.block_table.to(table_dtype, copy=True)
    table[2, 1] = value  # sequence 2 has 23 or 50 keys: block 1 is live
    args[3] = table
    with pytest.raises(ValueError, match=rf"sequence 2\b.*outside the cache's {num_blocks} blocks"):
        torch.ops.vgraph.paged_attention(*args)
    with pytest.raises(ValueError, match=r"sequence 2\b"):
        paged_attention_cpu(*args)
    # Two bad sequences: the first is named, whatever the thread count and work order.
    table[4, 3] = value
    for _ in range(3):
        with pytest.raises(ValueError, match=r"sequence 2\b"):
            paged_attention_cpu(*args)
    table[2, 1] = b.block_table[2, 1]
    with pytest.raises(ValueError, match=r"sequence 4\b"):
        paged_attention_cpu(*args)

    # Entries past a sequence's live blocks may be anything: they are never read.
    table = b.block_table.to(table_dtype, copy=True)
    table[0, 1:] = value
    args[3] = table
    assert_close_rel(torch.ops.vgraph.paged_attention(*args),
                     paged_attention_reference(*b.attention_args()))


# --- 5. native_build -------------------------------------------------------------------------

def probe_source(directory: Path, value: int, name: str = "vgraph_probe") -> tuple[Path, str]:
    """A tiny library (builds in well under a second) whose function returns ``value``."""
    path = directory / f"{name}.cpp"
    text = f'extern "C" int vgraph_probe() {{ return {value}; }}\n'
    path.write_text(text)
    return path, text


def probe_value(path: Path) -> int:
    return ctypes.CDLL(str(path)).vgraph_probe()


@requires_compiler
def test_fresh_build_writes_one_library_and_the_next_build_reuses_it(monkeypatch, tmp_path,
                                                                      compiles):
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path))
    source_file = native_build.CSRC / "paged_attention_cpu.cpp"
    source = source_file.read_text(encoding="utf-8")
    cxx = native_build.compiler()
    path = native_build._build("paged_attention_cpu", cxx, source_file, source)
    kernels = tmp_path / "kernels"
    assert path.parent == kernels
    record = path.name + ".sha256"
    assert sorted(os.listdir(kernels)) == [path.name, record]  # no temporary file left behind
    assert path.name == f"paged_attention_cpu-{native_build.library_key(source, cxx)}.so"
    assert len(compiles) == 1
    lib = ctypes.CDLL(str(path))
    assert lib.vgraph_paged_attention_args_size() == ctypes.sizeof(native._Args)

    mtime = path.stat().st_mtime_ns
    assert native_build._build("paged_attention_cpu", cxx, source_file, source) == path
    assert len(compiles) == 1 and path.stat().st_mtime_ns == mtime
    assert sorted(os.listdir(kernels)) == [path.name, record]


@requires_compiler
def test_load_library_reuses_the_cached_file_after_cache_clear(monkeypatch, tmp_path, compiles,
                                                               fresh_load_library):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    probe_source(csrc, 41)
    monkeypatch.setattr(native_build, "CSRC", csrc)
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    assert native_build.load_library("vgraph_probe").vgraph_probe() == 41
    assert len(compiles) == 1
    assert native_build.load_library("vgraph_probe").vgraph_probe() == 41  # lru_cache
    native_build.load_library.cache_clear()
    assert native_build.load_library("vgraph_probe").vgraph_probe() == 41  # from the disk cache
    assert len(compiles) == 1
    assert len(list((tmp_path / "cache" / "kernels").glob("*.so"))) == 1


@requires_compiler
def test_a_source_change_builds_a_new_library(monkeypatch, tmp_path, compiles):
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    cxx = native_build.compiler()
    source_file, old = probe_source(tmp_path, 1)
    first = native_build._build("vgraph_probe", cxx, source_file, old)
    source_file, new = probe_source(tmp_path, 2)
    assert native_build.library_key(old, cxx) == native_build.library_key(old, cxx)
    assert native_build.library_key(new, cxx) != native_build.library_key(old, cxx)
    second = native_build._build("vgraph_probe", cxx, source_file, new)
    assert second != first and len(compiles) == 2
    assert sorted(os.listdir(tmp_path / "cache" / "kernels")) == sorted(
        [first.name, second.name, first.name + ".sha256", second.name + ".sha256"])
    assert probe_value(second) == 2


def check_private_fallback_build(tmp_path: Path, compiles, caplog) -> None:
    """Builds the probe with an unwritable cache: it lands in a temporary directory."""
    caplog.set_level(logging.WARNING, logger=native_build.__name__)
    source_file, text = probe_source(tmp_path, 5)
    path = native_build._build("vgraph_probe", native_build.compiler(), source_file, text)
    try:
        assert path.is_file() and native_build.kernel_cache_dir() not in path.parents
        assert probe_value(path) == 5
        assert len(compiles) == 1  # the cache attempt fails before the compiler runs
        assert any("cannot write the kernel cache" in r.getMessage() for r in caplog.records)
    finally:
        if path.parent.name.startswith("vgraph-kernels-"):
            shutil.rmtree(path.parent, ignore_errors=True)


@requires_compiler
def test_read_only_cache_dir_builds_elsewhere(monkeypatch, tmp_path, compiles, caplog):
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True)
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    kernels.chmod(0o500)
    try:
        if os.access(kernels, os.W_OK):
            pytest.skip("chmod does not make the directory read-only here (running as root)")
        check_private_fallback_build(tmp_path, compiles, caplog)
        assert os.listdir(kernels) == []
    finally:
        kernels.chmod(0o700)


@requires_compiler
def test_cache_dir_that_cannot_be_created_builds_elsewhere(monkeypatch, tmp_path, compiles,
                                                           caplog):
    """The same fallback, in a form that holds even for root: the cache path runs through a
    regular file, so its kernels directory cannot be made."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(blocker))
    check_private_fallback_build(tmp_path, compiles, caplog)


@requires_compiler
def test_a_failing_compile_raises_and_leaves_no_file(monkeypatch, tmp_path):
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    source_file = tmp_path / "broken.cpp"
    source_file.write_text("extern \"C\" int vgraph_probe() { return undeclared_name; }\n")
    with pytest.raises(NativeBuildError, match=r"(?s)failed to build broken\.cpp.*undeclared_name"):
        native_build._build("broken", native_build.compiler(), source_file,
                            source_file.read_text())
    assert os.listdir(tmp_path / "cache" / "kernels") == []


def test_missing_compiler_raises_a_clear_error(monkeypatch, fresh_load_library):
    monkeypatch.setenv("CXX", NO_CXX)
    with pytest.raises(NativeBuildError, match=r"no C\+\+ compiler.*vgraph-no-such-c\+\+.*\$CXX"):
        native_build.load_library("paged_attention_cpu")


# --- 6. fallback without a kernel ------------------------------------------------------------

def fresh_kernel(library: str):
    """A not-yet-loaded kernel object like ``cpu_attention_native._KERNEL``."""
    kernel = native._kernel(library, library.replace("_cpu", "").replace("_", " "))
    assert kernel.function is None and kernel.unavailable is None
    return kernel


def test_without_a_compiler_the_torch_route_serves_every_row_with_one_warning(
        monkeypatch, caplog, routes, fresh_load_library):
    """One warning per kernel, whatever the number of calls."""
    monkeypatch.setattr(native, "_KERNEL", fresh_kernel("paged_attention_cpu"))
    monkeypatch.setattr(native, "_PREFILL_KERNEL", fresh_kernel("prefill_attention_cpu"))
    monkeypatch.setenv("CXX", NO_CXX)
    caplog.set_level(logging.WARNING, logger="vgraph")
    b = make_batch(MIXED, 2, 4, 64, 16, torch.bfloat16, extra_rows=2)
    ref = paged_attention_reference(*b.attention_args())
    for _ in range(3):
        assert_close_rel(paged_attention_cpu(*b.attention_args()), ref)
    assert_close_rel(torch.ops.vgraph.paged_attention(*b.attention_args()), ref)
    assert routes.native == routes.tiled == []
    assert {s[0] for s in routes.sdpa} == {s[0] for s in segment_tuples(b, True)
                                           | segment_tuples(b, False)}
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "falls back" in r.getMessage()
                and "attention" in r.getMessage()]
    assert len(warnings) == 2 and {w.split()[0] for w in warnings} == {"paged", "prefill"}, warnings
    assert all("torch" in w and "no C++ compiler" in w for w in warnings)
    assert not native.enabled() and not native.prefill_enabled()
    for long_segments in (False, True):
        with pytest.raises(NativeBuildError, match="no C\\+\\+ compiler"):
            native.attend_segments(b.q, b.k_cache, b.v_cache, b.block_table, [(0, 0, 1, 1)],
                                   b.scale, torch.zeros(b.q.shape), long_segments)
