"""The hot CPU ops' C++ dispatcher kernels (ops/cpu_dispatch.py, csrc/dispatch_cpu.cpp): they
serve the plain float32 calls (decode, for attention) bit for bit as the Python kernels do, and
hand every other call to them (fallbacks, errors) unchanged."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from vgraph.ops import cpu_attention, cpu_dispatch, linear
from vgraph.ops.linear import DENSE_MIN_ROWS, pack_weight


@pytest.fixture(scope="module", autouse=True)
def native_dispatch():
    assert cpu_dispatch.install(), cpu_dispatch.unavailable()


def cpu_kernel_origin(op: str) -> str:
    return next(line for line in torch._C._dispatch_dump(f"vgraph::{op}").splitlines() if line.startswith("CPU"))


def test_the_cpu_calls_reach_the_cpp_kernels():
    for op in ("packed_linear", "rowmajor_linear", "reshape_and_cache", "paged_attention"):
        assert "dispatch_cpu.cpp" in cpu_kernel_origin(op)
    assert cpu_dispatch.install() and cpu_dispatch.installed()  # idempotent


def _views(rows: int, k: int) -> list[torch.Tensor]:
    """x as a model hands it: contiguous, 3-D, a transposed copy's view, a slice of wider rows."""
    return [torch.randn(rows, k), torch.randn(1, rows, k), torch.randn(k, rows).t(), torch.randn(rows, k + 8)[:, :k]]


@pytest.mark.parametrize("rows", [1, 5, 64, 65, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_the_python_kernel_bit_for_bit(rows, with_bias):
    w = torch.randn(40, 64)
    packed, bias = pack_weight(w), (torch.randn(40) if with_bias else None)
    for x in _views(rows, 64):
        out = torch.ops.vgraph.packed_linear(x, packed, bias, 40)
        assert out.shape == (*x.shape[:-1], 40)
        assert torch.equal(out, torch.ops.vgraph.packed_linear_python(x, packed, bias, 40))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rowmajor_linear_equals_the_python_kernel_bit_for_bit(rows):
    w, bias = torch.randn(50, 32), torch.randn(50)
    for weight in (w, torch.randn(32, 50).t()):  # a weight stored transposed is made row-major
        for x in _views(rows, 32):
            out = torch.ops.vgraph.rowmajor_linear(x, weight, bias)
            assert torch.equal(out, torch.ops.vgraph.rowmajor_linear_python(x, weight, bias))
            torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_no_rows_give_an_empty_output():
    assert torch.ops.vgraph.packed_linear(torch.randn(0, 64), pack_weight(torch.randn(40, 64)), None, 40).shape == (0, 40)
    assert torch.ops.vgraph.rowmajor_linear(torch.randn(0, 8), torch.randn(3, 8), None).shape == (0, 3)


def test_a_dense_copy_is_used_from_its_row_threshold_on():
    w = torch.randn(40, 64)
    packed = pack_weight(w)
    dense = w * 2  # a different weight: shows which one ran
    few, many = torch.randn(DENSE_MIN_ROWS - 1, 64), torch.randn(DENSE_MIN_ROWS, 64)
    torch.testing.assert_close(torch.ops.vgraph.packed_linear(few, packed, None, 40, dense), F.linear(few, w))
    assert torch.equal(torch.ops.vgraph.packed_linear(many, packed, None, 40, dense), F.linear(many, dense))


def test_other_dtypes_take_the_python_kernel():
    w = torch.randn(24, 32)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    out = torch.ops.vgraph.packed_linear(x, pack_weight(w), None, 24)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, linear.packed_linear_reference(x, pack_weight(w), None, 24))
    assert torch.equal(torch.ops.vgraph.rowmajor_linear(x, w.bfloat16(), None), F.linear(x, w.bfloat16()))


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 32), torch.randn(2, 32, 8), None, 24), "packed weight"),
    ((torch.randn(2, 31), pack_weight(torch.randn(24, 32)), None, 24), "features"),
    ((torch.randn(2, 32), pack_weight(torch.randn(24, 32)), None, 40), "panels"),
    ((torch.randn(2, 32), pack_weight(torch.randn(24, 32)), torch.randn(23), 24), "bias"),
    ((torch.randn(2, 32), pack_weight(torch.randn(24, 32)), None, 24, torch.randn(24, 31)), "dense"),
])
def test_bad_inputs_raise_the_python_kernels_value_errors(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.vgraph.packed_linear(*args)


def test_bad_rowmajor_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="features"):
        torch.ops.vgraph.rowmajor_linear(torch.randn(2, 7), torch.randn(3, 8), None)
    with pytest.raises(ValueError, match="bias"):
        torch.ops.vgraph.rowmajor_linear(torch.randn(2, 8), torch.randn(3, 8), torch.randn(4))


def test_opcheck():
    torch.library.opcheck(torch.ops.vgraph.packed_linear.default,
                          (torch.randn(3, 64), pack_weight(torch.randn(40, 64)), torch.randn(40), 40))
    torch.library.opcheck(torch.ops.vgraph.rowmajor_linear.default, (torch.randn(3, 64), torch.randn(40, 64), None))


def test_without_a_compiler_the_python_kernels_keep_serving(tmp_path):
    """A fresh process whose library cannot be built: one warning, and the ops still answer."""
    script = textwrap.dedent("""
        import torch
        from vgraph.ops import cpu_dispatch
        from vgraph.ops.linear import pack_weight
        w, x = torch.randn(24, 32), torch.randn(3, 32)
        print("installed", cpu_dispatch.install())
        print("origin", [l for l in torch._C._dispatch_dump("vgraph::packed_linear").splitlines() if l.startswith("CPU")])
        out = torch.ops.vgraph.packed_linear(x, pack_weight(w), None, 24)
        print("close", torch.allclose(out, torch.nn.functional.linear(x, w), atol=1e-5))
    """)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "VGRAPH_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "installed False" in result.stdout
    assert "cpu_dispatch.py" in result.stdout and "close True" in result.stdout  # the Python kernel
    assert "stay on their Python kernels" in result.stderr


# ---------------------------------------------------------------------- KV cache write, attention

BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCKS = 16, 2, 6, 32, 12


def _caches() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), torch.randn(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_the_cache_write_equals_the_python_kernel(index_dtype):
    key, value = torch.randn(5, KV_HEADS, HEAD_DIM), torch.randn(5, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([3, -1, 17, 40, 191], dtype=index_dtype)  # -1: padding, not written
    k1, v1 = _caches()
    k2, v2 = k1.clone(), v1.clone()
    torch.ops.vgraph.reshape_and_cache(key, value, k1, v1, slots)
    torch.ops.vgraph.reshape_and_cache_python(key, value, k2, v2, slots)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(k1.view(-1, KV_HEADS, HEAD_DIM)[17], key[2])


def test_the_cache_write_reports_a_slot_outside_the_cache_as_python_does():
    key = torch.randn(2, KV_HEADS, HEAD_DIM)
    k, v = _caches()
    with pytest.raises(ValueError, match=r"slot 9999 of token 1 is outside the cache's 192 slots"):
        torch.ops.vgraph.reshape_and_cache(key, key, k, v, torch.tensor([0, 9999]))
    with pytest.raises(ValueError, match="slot_mapping"):  # the Python kernel's checks
        torch.ops.vgraph.reshape_and_cache(key, key, k, v, torch.tensor([0, 1, 2]))


def _decode_batch(seq_lens: list[int], rows: int, index_dtype=torch.int32):
    """A decode step: sequence i's one query row is row i; rows past the sequences are padding."""
    q = torch.randn(rows, Q_HEADS, HEAD_DIM)
    table = torch.randperm(BLOCKS)[:len(seq_lens) * 3].view(len(seq_lens), 3).to(index_dtype)
    starts = torch.tensor([min(i, rows) for i in range(len(seq_lens) + 1)], dtype=index_dtype)
    return q, table, starts, torch.tensor(seq_lens, dtype=index_dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seq_lens,rows", [([5], 1), ([1, 17, 48, 30], 4), ([7, 0, 33], 5), ([0, 0], 2)])
def test_decode_attention_equals_the_python_kernel_bit_for_bit(seq_lens, rows, index_dtype):
    k, v = _caches()
    q, table, starts, lens = _decode_batch(seq_lens, rows, index_dtype)
    args = (q, k, v, table, starts, lens, 1, 0.125)
    out = torch.ops.vgraph.paged_attention(*args)
    assert torch.equal(out, torch.ops.vgraph.paged_attention_python(*args))
    empty_rows = [i for i in range(rows) if i >= len(seq_lens) or seq_lens[i] == 0]
    assert all(torch.count_nonzero(out[i]) == 0 for i in empty_rows)  # padding reads zero


def test_prefills_and_the_switch_take_the_python_kernel(monkeypatch):
    k, v = _caches()
    q = torch.randn(9, Q_HEADS, HEAD_DIM)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    args = (q, k, v, table, torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([20, 5], dtype=torch.int32), 5,
            0.125)
    assert torch.equal(torch.ops.vgraph.paged_attention(*args), torch.ops.vgraph.paged_attention_python(*args))
    calls = []
    monkeypatch.setattr(cpu_attention, "paged_attention_cpu",
                        lambda *a, **kw: calls.append(1) or torch.zeros_like(q))
    torch.ops.vgraph.paged_attention(*args)  # a prefill: the Python kernel
    assert calls == [1]
    q1, t1, s1, l1 = _decode_batch([4, 9], 2)
    torch.ops.vgraph.paged_attention(q1, k, v, t1, s1, l1, 1, 0.125)  # a decode: C++
    assert calls == [1]
    monkeypatch.setenv("VGRAPH_CPU_ATTENTION", "torch")
    torch.ops.vgraph.paged_attention(q1, k, v, t1, s1, l1, 1, 0.125)  # switched off: Python again
    assert calls == [1, 1]


def test_bad_decode_metadata_raises_the_python_kernels_errors():
    k, v = _caches()
    q, table, starts, lens = _decode_batch([5, 9], 2)
    with pytest.raises(ValueError, match="sequence 1: seq_len -3 < query length 1"):
        torch.ops.vgraph.paged_attention(q, k, v, table, starts, torch.tensor([5, -3], dtype=torch.int32), 1, 0.1)
    with pytest.raises(ValueError, match="needs more than the block table's 3 blocks"):
        torch.ops.vgraph.paged_attention(q, k, v, table, starts, torch.tensor([5, 49], dtype=torch.int32), 1, 0.1)
    with pytest.raises(ValueError, match="outside q's 2 rows"):
        torch.ops.vgraph.paged_attention(q, k, v, table, torch.tensor([0, 1, 3], dtype=torch.int32), lens, 1, 0.1)
    bad_table = table.clone()
    bad_table[1, 0] = BLOCKS + 5
    with pytest.raises(ValueError, match=rf"sequence 1: its block table points outside the cache's {BLOCKS} blocks"):
        torch.ops.vgraph.paged_attention(q, k, v, bad_table, starts, lens, 1, 0.1)


def test_attention_opcheck():
    k, v = _caches()
    q, table, starts, lens = _decode_batch([5, 9, 30], 3)
    torch.library.opcheck(torch.ops.vgraph.paged_attention.default, (q, k, v, table, starts, lens, 1, 0.125))
    torch.library.opcheck(torch.ops.vgraph.reshape_and_cache.default,
                          (torch.randn(2, KV_HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM), k, v,
                           torch.tensor([1, 50])))
