"""The CPU linear ops' C++ dispatcher kernels (ops/linear.py ``install_native_dispatch``,
csrc/linear_dispatch_cpu.cpp): they serve the plain float32 calls bit for bit as the Python
kernels do, and hand every other call to them (fallbacks, errors) unchanged."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from vgraph.ops import linear
from vgraph.ops.linear import DENSE_MIN_ROWS, pack_weight


@pytest.fixture(scope="module", autouse=True)
def native_dispatch():
    assert linear.install_native_dispatch(), linear._DISPATCH.unavailable


def cpu_kernel_origin(op: str) -> str:
    return next(line for line in torch._C._dispatch_dump(f"vgraph::{op}").splitlines() if line.startswith("CPU"))


def test_the_cpu_calls_reach_the_cpp_kernels():
    for op in ("packed_linear", "rowmajor_linear"):
        assert "linear_dispatch_cpu.cpp" in cpu_kernel_origin(op)
    assert linear.install_native_dispatch()  # idempotent


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
        from vgraph.ops import linear
        from vgraph.ops.linear import pack_weight
        w, x = torch.randn(24, 32), torch.randn(3, 32)
        print("installed", linear.install_native_dispatch())
        print("origin", [l for l in torch._C._dispatch_dump("vgraph::packed_linear").splitlines() if l.startswith("CPU")])
        out = torch.ops.vgraph.packed_linear(x, pack_weight(w), None, 24)
        print("close", torch.allclose(out, torch.nn.functional.linear(x, w), atol=1e-5))
    """)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "VGRAPH_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "installed False" in result.stdout
    assert "linear.py" in result.stdout and "close True" in result.stdout
    assert "stay on their Python kernels" in result.stderr
