"""``vgraph::packed_linear`` (ops/linear.py, csrc/linear_cpu.cpp) against ``F.linear``.

The kernel tiles rows by 6 and columns by 16 in groups of four panels, and the last one to
five rows take tiles spanning one, two or four panels (only in a whole group). So every
remainder 1-5, column counts that leave a partial last panel, and panel counts that leave a
partial last group are where an indexing slip would show.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vgraph.ops import linear
from vgraph.ops.linear import pack_weight, packed_linear_reference, unpack_weight

# (1024: whole groups; 100: 7 panels, partial last panel and group; 120: 8 panels, whole groups
# ending on a partial panel; 17, 1, 16: a single panel; 600: a long k with a partial group).
SHAPES = [(1024, 512), (100, 80), (120, 24), (17, 33), (1, 5), (16, 16), (100, 600)]


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 sums over k in another order: compare against the output's own scale."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.numel() == 0:
        return
    scale = ref.abs().max().clamp_min(1.0)
    assert ((out - ref).abs().max() / scale).item() < 1e-5


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_pack_round_trips_and_pads_with_zeros(out_features, in_features):
    w = torch.randn(out_features, in_features)
    packed = pack_weight(w)
    panels = -(-out_features // 16)
    assert packed.shape == (panels, in_features, 16) and packed.is_contiguous()
    assert torch.equal(unpack_weight(packed, out_features), w)
    assert not packed.transpose(1, 2).reshape(panels * 16, in_features)[out_features:].any()


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 64, 97, 197, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(out_features, in_features, rows, with_bias):
    w, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    bias = torch.randn(out_features) if with_bias else None
    out = torch.ops.vgraph.packed_linear(x, pack_weight(w), bias, out_features)
    close(out, F.linear(x, w, bias))


def test_leading_dims_and_strided_rows():
    w = torch.randn(40, 64)
    x = torch.randn(3, 5, 64)
    close(torch.ops.vgraph.packed_linear(x, pack_weight(w), None, 40), F.linear(x, w))
    wide = torch.randn(9, 100)
    x = wide[:, 10:74]  # rows 100 apart, unit stride inside
    close(torch.ops.vgraph.packed_linear(x, pack_weight(w), None, 40), F.linear(x, w))
    x = torch.randn(64, 9).t()  # column-major rows
    close(torch.ops.vgraph.packed_linear(x, pack_weight(w), None, 40), F.linear(x, w))


@pytest.mark.parametrize("out_features", [1024, 100, 120])
def test_a_rows_result_does_not_depend_on_its_batch(out_features):
    """Every output is one in-order sum over k whatever tile computed it, so a sequence's
    logits are the same alone or in any decode batch (greedy tokens never depend on batching)."""
    w, x = torch.randn(out_features, 72), torch.randn(13, 72)
    packed = pack_weight(w)
    alone = torch.cat([torch.ops.vgraph.packed_linear(x[i:i + 1], packed, None, out_features)
                       for i in range(13)])
    for rows in range(2, 14):
        batched = torch.ops.vgraph.packed_linear(x[:rows], packed, None, out_features)
        assert torch.equal(batched, alone[:rows]), rows


@pytest.mark.parametrize("out_features,in_features", [(100, 600), (1024, 300)])
def test_prefill_calls_give_a_row_the_same_bits_as_a_decode_call(out_features, in_features):
    """A row's output in a prefill-sized call must equal, bit for bit, what it gets alone (a
    prompt's last token and its first decode share a GEMM shape): any blocking of rows or k
    the kernel does must keep each output's in-order sum."""
    w, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(203, in_features)
    packed = pack_weight(w)
    big = torch.ops.vgraph.packed_linear(x, packed, bias, out_features)
    for i in (0, 95, 96, 101, 198, 202):
        assert torch.equal(big[i:i + 1], torch.ops.vgraph.packed_linear(x[i:i + 1], packed, bias, out_features)), i
    close(big, F.linear(x, w, bias))


@pytest.mark.parametrize("rows", [11, 12, 16, 23, 64, 65])
def test_decode_batches_that_prefetch_the_next_group_keep_every_bit(rows):
    """12-64 rows over a single-pass K prefetch each thread's next group of panels while they
    compute (csrc/linear_cpu.cpp, rows_pass): a hint that must change no output, on one thread
    or two, for a weight of many groups with a partial last one."""
    w, bias = torch.randn(1000, 512), torch.randn(1000)
    x = torch.randn(rows, 512)
    packed = pack_weight(w)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(torch.ops.vgraph.packed_linear(x, packed, bias, 1000))
        alone = torch.cat([torch.ops.vgraph.packed_linear(x[i:i + 1], packed, bias, 1000) for i in range(rows)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], alone)
    close(outs[0], F.linear(x, w, bias))


def test_threads_split_panels_without_changing_a_bit():
    for rows, in_features in ((20, 96), (250, 600)):  # decode-sized and prefill-sized
        w, x, bias = torch.randn(300, in_features), torch.randn(rows, in_features), torch.randn(300)
        packed = pack_weight(w)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = torch.ops.vgraph.packed_linear(x, packed, bias, 300)
            torch.set_num_threads(2)
            two = torch.ops.vgraph.packed_linear(x, packed, bias, 300)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, two)


def test_the_cpu_kernel_runs_and_other_dtypes_use_the_reference(monkeypatch):
    assert linear._KERNEL.load() is not None, linear._KERNEL.unavailable
    w = torch.randn(24, 32)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    out = torch.ops.vgraph.packed_linear(x, pack_weight(w), None, 24)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, packed_linear_reference(x, pack_weight(w), None, 24))


def test_without_the_kernel_the_op_falls_back_to_the_reference(monkeypatch):
    missing = linear._kernel()
    missing.unavailable = "no compiler (test)"
    monkeypatch.setattr(linear, "_KERNEL", missing)
    w, x = torch.randn(24, 32), torch.randn(4, 32)
    close(torch.ops.vgraph.packed_linear(x, pack_weight(w), None, 24), F.linear(x, w))
    assert not linear.packing_enabled()


def test_switch_turns_packing_off(monkeypatch):
    monkeypatch.setenv(linear.ENV_SWITCH, "torch")
    assert not linear.packing_enabled()


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 32), torch.randn(2, 32, 8), None, 24), "packed weight"),
    ((torch.randn(2, 32), pack_weight(torch.randn(24, 32)).double(), None, 24), "packed weight"),
    ((torch.randn(2, 31), pack_weight(torch.randn(24, 32)), None, 24), "features"),
    ((torch.randn(2, 32), pack_weight(torch.randn(24, 32)), None, 40), "panels"),
    ((torch.randn(2, 32), pack_weight(torch.randn(24, 32)), None, 16), "panels"),
    ((torch.randn(2, 32), pack_weight(torch.randn(24, 32)), torch.randn(23), 24), "bias"),
])
def test_bad_inputs_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.vgraph.packed_linear(*args)


def test_opcheck():
    args = (torch.randn(3, 64), pack_weight(torch.randn(40, 64)), torch.randn(40), 40)
    torch.library.opcheck(torch.ops.vgraph.packed_linear.default, args)


def test_every_row_count_runs_the_kernel(monkeypatch):
    """Decode and prefill sizes alike: no call falls back to F.linear on an unpacked copy."""
    w = torch.randn(40, 64)
    packed = pack_weight(w)
    kernel_rows = []
    function = linear._KERNEL.load()

    def spy(*args):
        kernel_rows.append(args[2])
        return function(*args)
    monkeypatch.setattr(linear._KERNEL, "function", spy)
    monkeypatch.setattr(linear, "packed_linear_reference", None)  # a fallback would fail
    for rows in (1, 64, 65, 2000):  # the Python kernel (the C++ one calls the tiles directly)
        x = torch.randn(rows, 64)
        close(torch.ops.vgraph.packed_linear_python(x, packed, None, 40), F.linear(x, w))
    assert kernel_rows == [1, 64, 65, 2000]
