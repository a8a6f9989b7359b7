"""Launch checks that need no GPU.

- Specialization: Triton keys a compiled kernel on its integer arguments' values (== 1, or a
  multiple of 16), so a block table whose width changes between eager steps would compile
  again. The key is computed here with Triton's own binder (the function a launch calls to
  pick a compiled kernel), which runs without a device.
- tl.dot shapes: every dot's M, N, K must be >= 16 on the GPU (the interpreter accepts any),
  for every tile shape the host code can choose.
- Grids: the grids the launchers build for every decode bucket (1..256 sequences) and for a
  long prefill are non-empty and within CUDA's limits.

The int64 offset checks are in test_kernel_offsets.py.
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction

from tests.ops.launches import LaunchRecorder, as_jit_function, specialization_key
from tests.ops.test_attention import make_batch
from vgraph.ops.kernels import activation, attention, fp8, kv_cache, norm
from vgraph.ops.kernels.attention import MIN_DOT, attention_tiles
from vgraph.ops.kernels.common import INTERPRETED
from vgraph.worker.batch import BatchBuilder

KERNEL_DIR = Path(attention.__file__).parent
CUDA_MAX_GRID = (2 ** 31 - 1, 65535, 65535)


def record(monkeypatch, module, *names: str) -> dict[str, LaunchRecorder]:
    recorders = {name: LaunchRecorder(getattr(module, name)) for name in names}
    for name, recorder in recorders.items():
        monkeypatch.setattr(module, name, recorder)
    return recorders


def _decode_inputs(num_seqs: int, width: int, q_heads: int = 8, kv_heads: int = 2,
                   head_dim: int = 64, block_size: int = 16) -> tuple:
    """Launcher inputs of the right shapes; the recorder never reads their contents."""
    q = torch.empty(num_seqs, q_heads, head_dim, dtype=torch.bfloat16)
    cache = torch.empty(8, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    table = torch.empty(num_seqs, width, dtype=torch.int32)
    seq_lens = torch.ones(num_seqs, dtype=torch.int32)
    return q, cache, table, seq_lens


# ------------------------------------------------------------------ specialization


@pytest.mark.parametrize("kernel,params", [
    (attention._paged_attention_kernel, {"stride_bt"}),
    (attention._split_kv_stage1_kernel, {"stride_bt", "num_splits"}),
    (attention._split_kv_stage2_kernel, {"num_splits"}),
])
def test_table_stride_and_split_count_are_not_specialized(kernel, params):
    jit = as_jit_function(kernel)
    assert params <= {p.name for p in jit.params if p.do_not_specialize}


def test_unified_kernel_key_ignores_the_table_width(monkeypatch):
    """Widths 1 (stride 1 would become a constexpr), odd, 16 (divisible) and wide: one key."""
    rec = record(monkeypatch, attention, "_paged_attention_kernel")["_paged_attention_kernel"]
    for width in (1, 3, 16, 17, 64, 2048):
        q, cache, table, seq_lens = _decode_inputs(2, width)
        qsl = torch.arange(3, dtype=torch.int32)
        attention.paged_attention_triton(q, cache, cache, table, qsl, seq_lens, 1, 0.125)
    keys = [specialization_key(rec.kernel, launch) for launch in rec.launches]
    assert len(rec.launches) == 6 and all(key == keys[0] for key in keys)


def test_split_kv_stage1_key_ignores_the_table_width_and_split_count(monkeypatch):
    recs = record(monkeypatch, attention, "_split_kv_stage1_kernel", "_split_kv_stage2_kernel")
    for width, splits in itertools.product((8, 16, 17, 2048), (2, 3, 4)):
        q, cache, table, seq_lens = _decode_inputs(2, width)
        attention.paged_attention_decode_split_kv_triton(q, cache, cache, table, seq_lens, 0.125,
                                                         splits)
    stage1, stage2 = recs["_split_kv_stage1_kernel"], recs["_split_kv_stage2_kernel"]
    keys = [specialization_key(stage1.kernel, launch) for launch in stage1.launches]
    assert len(keys) == 12 and all(key == keys[0] for key in keys)
    # Stage 2 loads all splits in one block, so its key follows next_pow2(num_splits) only.
    keys2 = {repr(specialization_key(stage2.kernel, launch)) for launch in stage2.launches}
    assert len(keys2) == 2  # BLOCK_S 2 and 4


def test_a_value_specialized_width_would_change_the_key(monkeypatch):
    """The check above can fail: without do_not_specialize, width 1 and 16 give new keys."""
    rec = record(monkeypatch, attention, "_paged_attention_kernel")["_paged_attention_kernel"]
    for width in (1, 3, 16):
        q, cache, table, seq_lens = _decode_inputs(2, width)
        attention.paged_attention_triton(q, cache, cache, table, torch.arange(3, dtype=torch.int32),
                                         seq_lens, 1, 0.125)
    jit = as_jit_function(rec.kernel)
    specialized = JITFunction(jit.fn)  # same kernel, every integer specialized
    keys = {repr(specialization_key(specialized, launch)) for launch in rec.launches}
    assert len(keys) == 3


# ------------------------------------------------------------------ tl.dot shapes


def dot_shapes(tiles) -> set[tuple[int, int, int]]:
    """(M, K, N) of the two dots in ``_softmax_step``: q @ k^T and p @ v."""
    return {(tiles.block_m, tiles.block_d, tiles.tile_n), (tiles.block_m, tiles.tile_n, tiles.block_d)}


GROUPS = range(1, 65)
QUERY_LENS = (1, 2, 3, 7, 16, 17, 33, 128, 1000, 8192, 65536)
HEAD_DIMS = (16, 32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256)


def test_every_host_tile_choice_gives_dots_of_at_least_16():
    for group, query_len, head_dim, elem_bytes in itertools.product(GROUPS, QUERY_LENS, HEAD_DIMS,
                                                                    (2, 4)):
        tiles = attention_tiles(group, query_len, head_dim, elem_bytes)
        for m, k, n in dot_shapes(tiles):
            assert min(m, k, n) >= MIN_DOT, (group, query_len, head_dim, tiles)
        for size in (tiles.block_m, tiles.tile_n, tiles.block_d):  # tl.arange lengths
            assert size & (size - 1) == 0, (group, query_len, head_dim, tiles)
        assert 1 <= tiles.block_q and tiles.block_q * group <= tiles.block_m


def _functions_calling(name: str) -> set[str]:
    found = set()
    for path in KERNEL_DIR.glob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef) and any(
                    isinstance(n, ast.Call) and ast.unparse(n.func) == name for n in ast.walk(fn)):
                found.add(f"{path.name}:{fn.name}")
    return found


def test_tl_dot_is_only_in_the_softmax_step():
    """So that the enumeration above covers every dot in the kernels; a new dot elsewhere must
    add its shapes here."""
    assert _functions_calling("tl.dot") == {"attention.py:_softmax_step"}


@pytest.mark.skipif(not INTERPRETED, reason="records dots through the interpreter")
@pytest.mark.parametrize("group,head_dim,specs,dtype", [
    (4, 64, [(0, 40), (10, 3)], torch.bfloat16), (1, 128, [(5, 1), (70, 1)], torch.float16),
    (3, 256, [(0, 30)], torch.bfloat16), (4, 64, [(0, 40)], torch.float32),
    (2, 128, [(9, 1)], torch.float32),
])
def test_the_kernels_dots_are_the_enumerated_shapes(monkeypatch, group, head_dim, specs, dtype):
    shapes = []
    real = interpreter.interpreter_builder.create_dot

    def create_dot(a, b, d, *args):
        shapes.append((a.data.shape[0], a.data.shape[1], b.data.shape[1]))
        return real(a, b, d, *args)

    monkeypatch.setattr(interpreter.interpreter_builder, "create_dot", create_dot)
    b = make_batch(specs, 1, group, head_dim, 16, dtype)
    elem_bytes = b.k_cache.element_size()
    attention.paged_attention_triton(*b.attention_args())
    assert set(shapes) == dot_shapes(attention_tiles(group, b.max_query_len, head_dim, elem_bytes))
    if b.max_query_len == 1:
        shapes.clear()
        attention.paged_attention_decode_split_kv_triton(b.q, b.k_cache, b.v_cache, b.block_table,
                                                         b.seq_lens, b.scale, 2)
        assert set(shapes) == dot_shapes(attention_tiles(group, 1, head_dim, elem_bytes))


# ------------------------------------------------------------------ grids


def _assert_grid_ok(name: str, grid: tuple) -> None:
    assert 1 <= len(grid) <= 3, (name, grid)
    for size, limit in zip(grid, CUDA_MAX_GRID):
        assert isinstance(size, int) and 1 <= size <= limit, (name, grid)


# (q_heads, kv_heads, head_dim): Llama-3-8B/70B, Qwen2-7B, a wide-head MQA model, Qwen2-0.5B.
MODELS = [(32, 8, 128), (64, 8, 128), (28, 4, 128), (8, 1, 256), (14, 2, 64)]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", MODELS)
@pytest.mark.parametrize("max_model_len", [2048, 131072])
def test_decode_bucket_grids_are_within_cuda_limits(monkeypatch, q_heads, kv_heads, head_dim,
                                                    max_model_len):
    """Every decode bucket as the runner launches it: FULL batches have max_model_len's table
    width and the split count the builder chooses (132 SMs); unsplit buckets take the
    unified kernel."""
    recs = record(monkeypatch, attention, "_paged_attention_kernel", "_split_kv_stage1_kernel",
                  "_split_kv_stage2_kernel")
    builder = BatchBuilder(16, torch.device("cuda"), kv_heads, max_model_len)
    for bucket in range(1, 257):
        q, cache, table, seq_lens = _decode_inputs(bucket, max_model_len // 16, q_heads, kv_heads,
                                                   head_dim)
        splits = builder.kv_splits(bucket, 1, max_model_len, num_sms=132)
        if splits > 1:
            attention.paged_attention_decode_split_kv_triton(q, cache, cache, table, seq_lens,
                                                             0.1, splits)
        else:
            attention.paged_attention_triton(q, cache, cache, table,
                                             torch.arange(bucket + 1, dtype=torch.int32),
                                             seq_lens, 1, 0.1)
    launches = [(name, launch) for name, rec in recs.items() for launch in rec.launches]
    assert len(launches) >= 256
    for name, launch in launches:
        _assert_grid_ok(name, launch.grid)
    if max_model_len == 131072 and kv_heads <= 8:
        assert recs["_split_kv_stage1_kernel"].launches, "long contexts must take the split kernel"


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", MODELS)
def test_prefill_grid_puts_query_blocks_on_x(monkeypatch, q_heads, kv_heads, head_dim):
    """A long prompt's query blocks go on grid x, the only axis allowed past 65535; sequences
    and KV heads take y and z."""
    rec = record(monkeypatch, attention, "_paged_attention_kernel")["_paged_attention_kernel"]
    tokens = 8192
    q = torch.empty(tokens, q_heads, head_dim, dtype=torch.bfloat16)
    cache = torch.empty(4, 16, kv_heads, head_dim, dtype=torch.bfloat16)
    attention.paged_attention_triton(q, cache, cache, torch.empty(2, tokens // 16, dtype=torch.int32),
                                     torch.tensor([0, tokens - 1, tokens], dtype=torch.int32),
                                     torch.tensor([tokens - 1, 1], dtype=torch.int32), tokens - 1, 0.1)
    (launch,) = rec.launches
    block_q = attention_tiles(q_heads // kv_heads, tokens - 1, head_dim).block_q
    assert launch.grid == (-(-(tokens - 1) // block_q), 2, kv_heads)
    _assert_grid_ok("_paged_attention_kernel", launch.grid)


@pytest.mark.parametrize("bucket", [1, 2, 4, 8, 64, 256, 8192])
def test_row_kernel_grids_are_within_cuda_limits(monkeypatch, bucket):
    """Norms, quant, activation and the cache write at a bucket's token count (hidden 8192,
    intermediate 28672, 8 KV heads of 128)."""
    recs = {**record(monkeypatch, norm, "_rms_norm_kernel"),
            **record(monkeypatch, fp8, "_static_quant_kernel", "_dynamic_per_token_quant_kernel"),
            **record(monkeypatch, activation, "_silu_and_mul_kernel"),
            **record(monkeypatch, kv_cache, "_reshape_and_cache_kernel")}
    x, w, s = torch.empty(bucket, 8192), torch.empty(8192), torch.ones(1)
    norm.rms_norm_triton(x, w, 1e-6, residual=x, quant=norm.QUANT_STATIC, scale=s)
    fp8.static_scaled_fp8_quant_triton(x, s)
    fp8.dynamic_per_token_scaled_fp8_quant_triton(x)
    activation.silu_and_mul_triton(torch.empty(bucket, 2 * 28672), scale=s)
    kv = torch.empty(bucket, 8, 128)
    cache = torch.empty(4, 16, 8, 128)
    kv_cache.reshape_and_cache_triton(kv, kv, cache, cache, torch.zeros(bucket, dtype=torch.long))
    for name, rec in recs.items():
        assert rec.launches, name
        for launch in rec.launches:
            _assert_grid_ok(name, launch.grid)
