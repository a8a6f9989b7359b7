"""The startup choice of prefill GEMM per weight shape (``ops/linear_tuning.py``) and the
packed op's dense path that a BLAS choice turns on."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vgraph.ops import linear_tuning
from vgraph.ops.linear import DENSE_MIN_ROWS, pack_weight
from vgraph.ops.linear_tuning import ShapeChoice, choose_prefill_kernels


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(linear_tuning.ENV_SWITCH, raising=False)
    return tmp_path


def test_a_shape_is_measured_once_per_machine_then_read_from_the_cache(kernel_cache, monkeypatch):
    first = choose_prefill_kernels([(48, 32), (48, 32), (16, 32)])
    assert sorted(first) == [(16, 32), (48, 32)]
    for c in first.values():
        assert c.kernel in ("packed", "blas") and c.packed_ms > 0 and c.blas_ms > 0
        assert (c.kernel == "blas") == (c.packed_ms >= c.blas_ms * linear_tuning.MARGIN)
    monkeypatch.setattr(linear_tuning, "measure_shape", lambda *a: pytest.fail("measured again"))
    assert choose_prefill_kernels([(16, 32), (48, 32)]) == first


def test_the_switch_forces_a_kernel_without_measuring(kernel_cache, monkeypatch):
    monkeypatch.setattr(linear_tuning, "measure_shape", lambda *a: pytest.fail("measured"))
    for kernel in ("packed", "blas"):
        monkeypatch.setenv(linear_tuning.ENV_SWITCH, kernel)
        assert {c.kernel for c in choose_prefill_kernels([(8, 8), (16, 8)]).values()} == {kernel}
    monkeypatch.setenv(linear_tuning.ENV_SWITCH, "fastest")
    with pytest.raises(ValueError, match="auto, packed or blas"):
        choose_prefill_kernels([(8, 8)])


def test_blas_is_chosen_only_past_the_margin():
    assert ShapeChoice(8, 8, 1.0, 0.9, "blas").speedup == pytest.approx(1 / 0.9)
    assert ShapeChoice(8, 8, 1.0, 0.99, "packed").speedup == 1.0


@pytest.mark.parametrize("rows", [1, DENSE_MIN_ROWS - 1, DENSE_MIN_ROWS, 300])
def test_dense_weight_serves_prefill_rows_and_the_kernel_the_rest(rows, monkeypatch):
    w, b = torch.randn(40, 64), torch.randn(40)
    x = torch.randn(rows, 64)
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a[1].shape) or real_linear(*a))
    out = torch.ops.vgraph.packed_linear(x, pack_weight(w), b, 40, w)
    torch.testing.assert_close(out, real_linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert bool(calls) == (rows >= DENSE_MIN_ROWS)


def test_a_dense_weight_of_the_wrong_shape_is_a_value_error():
    with pytest.raises(ValueError, match="dense weight shape"):
        torch.ops.vgraph.packed_linear(torch.randn(2, 64), pack_weight(torch.randn(40, 64)), None, 40,
                                       torch.randn(40, 32))


def test_opcheck_with_a_dense_weight():
    w = torch.randn(40, 64)
    args = (torch.randn(DENSE_MIN_ROWS, 64), pack_weight(w), None, 40, w)
    torch.library.opcheck(torch.ops.vgraph.packed_linear.default, args)


def test_big_weights_are_timed_at_fewer_rows():
    assert linear_tuning.tuning_rows(1024, 512) == linear_tuning.TUNING_ROWS
    assert linear_tuning.tuning_rows(28672, 4096) == linear_tuning.MIN_TUNING_ROWS
    assert linear_tuning.MIN_TUNING_ROWS <= linear_tuning.tuning_rows(9728, 896) <= linear_tuning.TUNING_ROWS


def test_the_lm_head_is_never_timed(kernel_cache, monkeypatch):
    from tests.checkpoints import tiny_checkpoint
    from vgraph.config import ModelConfig
    from vgraph.models.linear import PackedLinear
    from vgraph.models.loader import load_model

    timed = []
    real = linear_tuning.measure_shape
    monkeypatch.setattr(linear_tuning, "measure_shape", lambda *a: timed.append(a) or real(*a))
    model = load_model(ModelConfig(tiny_checkpoint(arch="llama")), "cpu")[0]
    decoder = {(m.out_features, m.in_features) for n, m in model.named_modules()
               if isinstance(m, PackedLinear) and n != "lm_head"}
    assert isinstance(model.lm_head, PackedLinear) and set(timed) == decoder


def test_processes_starting_together_share_one_measurement(kernel_cache):
    """Four processes at once: one measures under the lock, the others read its choice."""
    import subprocess
    import sys

    code = ("import json, vgraph.ops; from vgraph.ops import linear_tuning as t; "
            "c = t.choose_prefill_kernels([(64, 32), (96, 32)]); "
            "print(json.dumps({f'{k[0]}x{k[1]}': v.packed_ms for k, v in c.items()}))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = {p.communicate(timeout=300)[0] for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outputs) == 1, "every process used the same measured choice"


def test_a_dense_weight_changes_the_compile_layout(monkeypatch):
    from tests.checkpoints import tiny_checkpoint
    from vgraph.compiler.build import linear_packing, model_layout
    from vgraph.config import ModelConfig
    from vgraph.models.loader import load_model

    path = tiny_checkpoint(arch="llama")
    layouts = {}
    for kernel in ("packed", "blas"):
        monkeypatch.setenv(linear_tuning.ENV_SWITCH, kernel)
        model = load_model(ModelConfig(path), "cpu")[0]
        layouts[kernel] = model_layout(model)
        assert linear_packing(model) == "packed"
    assert layouts["packed"] != layouts["blas"] and "PackedLinear+dense" in layouts["blas"]
