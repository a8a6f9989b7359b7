"""The packed GEMM's instruction-set paths (csrc/linear_cpu.cpp): AVX-512 (6 rows x 4 panels
in zmm registers, k in passes of 1024 that continue each sum from y) where the CPU has
avx512f, AVX2 6x16 tiles elsewhere. Against ``F.linear`` over every row remainder and tile
shape, odd K and N, K across pass boundaries; the ISA is reported, and keys the tuning cache.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vgraph.ops import linear, linear_tuning
from vgraph.ops.linear import kernel_isa, pack_weight


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    scale = ref.abs().max().clamp_min(1.0)
    assert ((out - ref).abs().max() / scale).item() < 1e-5


def cpu_flags() -> set[str]:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    flags = next((line for line in lines if line.startswith("flags")), "")
    return set(flags.partition(":")[2].split())


def test_the_isa_follows_the_cpu():
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this machine")
    expected = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    assert kernel_isa() == expected


def test_the_isa_is_none_without_the_kernel(monkeypatch):
    missing = linear._kernel()
    missing.unavailable = "no compiler (test)"
    monkeypatch.setattr(linear, "_KERNEL", missing)
    assert kernel_isa() is None


def test_the_tuning_cache_is_keyed_by_the_kernel_build(tmp_path, monkeypatch):
    """A prefill choice measured against the AVX2 tiles must not be reused by the AVX-512 ones."""
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path))
    here = linear_tuning._cache_file()
    monkeypatch.setattr(linear_tuning, "build_name", lambda name: f"{name}-another-build")
    assert linear_tuning._cache_file() != here


# Odd N (partial last panel; 1-3 panels in the last group) and odd K; 1030 and 2100 cross the
# 1024-step pass boundary once and twice.
@pytest.mark.parametrize("out_features,in_features", [(81, 37), (147, 1030), (35, 2100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_1_to_600_match_f_linear(out_features, in_features, with_bias):
    w, x = torch.randn(out_features, in_features), torch.randn(600, in_features)
    bias = torch.randn(out_features) if with_bias else None
    packed = pack_weight(w)
    ref = F.linear(x, w, bias)
    for rows in [*range(1, 14), 63, 64, 65, 127, 128, 129, 511, 599, 600]:
        close(torch.ops.vgraph.packed_linear(x[:rows], packed, bias, out_features), ref[:rows])


def test_k_passes_keep_a_rows_bits_across_batch_sizes():
    """k in passes continues each output's float32 sum from y: a row gets the same bits
    whatever rows share its call, and with 1 or 2 threads."""
    w, x, bias = torch.randn(200, 2100), torch.randn(70, 2100), torch.randn(200)
    packed = pack_weight(w)
    big = torch.ops.vgraph.packed_linear(x, packed, bias, 200)
    for i in (0, 5, 6, 41, 69):
        assert torch.equal(big[i:i + 1], torch.ops.vgraph.packed_linear(x[i:i + 1], packed, bias, 200)), i
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.vgraph.packed_linear(x, packed, bias, 200)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, big)


# ``vgraph::rowmajor_linear``: the same tiles over a weight packed group by group as it runs.
@pytest.mark.parametrize("out_features,in_features", [(81, 37), (147, 1030), (1, 5)])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 64, 129])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rowmajor_gives_the_packed_kernels_bits(out_features, in_features, rows, with_bias):
    w, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    bias = torch.randn(out_features) if with_bias else None
    out = torch.ops.vgraph.rowmajor_linear(x, w, bias)
    assert torch.equal(out, torch.ops.vgraph.packed_linear(x, pack_weight(w), bias, out_features))
    if rows:
        close(out, F.linear(x, w, bias))


def test_rowmajor_takes_strided_weights_and_other_dtypes():
    wide = torch.randn(40, 100)
    w, x = wide[:, 10:74], torch.randn(3, 5, 64)  # weight rows 100 apart
    close(torch.ops.vgraph.rowmajor_linear(x, w, None), F.linear(x, w))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(torch.ops.vgraph.rowmajor_linear(xb, wb, None), F.linear(xb, wb))


def test_rowmajor_bad_inputs_and_opcheck():
    with pytest.raises(ValueError, match="features"):
        torch.ops.vgraph.rowmajor_linear(torch.randn(2, 31), torch.randn(24, 32), None)
    with pytest.raises(ValueError, match="bias"):
        torch.ops.vgraph.rowmajor_linear(torch.randn(2, 32), torch.randn(24, 32), torch.randn(23))
    args = (torch.randn(3, 64), torch.randn(40, 64), torch.randn(40))
    torch.library.opcheck(torch.ops.vgraph.rowmajor_linear.default, args)
