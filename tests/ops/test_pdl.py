"""Programmatic dependent launch (on by default on sm_90+, ops/kernels/common.py), without a GPU:
when a launch asks for it, and that every kernel of a decode step is launched through it,
waiting (``pdl_enter``) before it reads anything an earlier kernel may have written. That each one compiles for sm_90 with the wait
in its PTX is checked by sm90_compile.py; the GPU runs are ``scripts/gpu_checks.sh pdl``."""
from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.ops.launches import recording
from tests.ops.sm90_compile import PREFETCHING, cases
from vgraph.ops.kernels import activation, attention, common, gemv, kv_cache, norm, rotary

DECODE_KERNELS = {(norm, "_rms_norm_kernel"), (activation, "_silu_and_mul_kernel"),
                  (kv_cache, "_reshape_and_cache_kernel"), (gemv, "_gemv_kernel"), (gemv, "_gemv_silu_mul_kernel"),
                  (attention, "_paged_attention_kernel"), (attention, "_split_kv_stage1_kernel"),
                  (attention, "_split_kv_stage2_kernel"), (rotary, "_rotary_qk_kernel")}


@pytest.fixture
def pdl_asked(monkeypatch):
    monkeypatch.setattr(common, "PDL_REQUESTED", True)
    monkeypatch.setattr(common, "INTERPRETED", False)
    monkeypatch.setattr(common, "_pdl_capable", lambda index: index != 7)  # device 7: before sm_90


def test_pdl_is_on_only_where_asked_and_the_device_has_it(pdl_asked, monkeypatch):
    assert common.pdl_launch(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}
    assert common.pdl_launch(torch.device("cuda", 7)) == {"USE_PDL": False}
    assert common.pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(common, "INTERPRETED", True)
    assert common.pdl_launch(torch.device("cuda", 0)) == {"USE_PDL": False}
    monkeypatch.setattr(common, "INTERPRETED", False)
    monkeypatch.setattr(common, "PDL_REQUESTED", False)
    assert common.pdl_launch(torch.device("cuda", 0)) == {"USE_PDL": False}


@pytest.mark.parametrize("value,asked", [(None, True), ("0", False), ("1", True)])
def test_on_unless_vgraph_pdl_is_0(value, asked):
    env = {k: v for k, v in os.environ.items() if k != "VGRAPH_PDL"} | ({} if value is None else {"VGRAPH_PDL": value})
    out = subprocess.run([sys.executable, "-c", "from vgraph.ops.kernels import common; print(common.PDL_REQUESTED)"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(asked), out.stderr[-2000:]


# What may run before the wait: index arithmetic, and (the GEMVs only) loads of the weight,
# which no kernel of a step writes.
INDEX_CALLS = {"tl.program_id", "tl.arange", "tl.where", "to"}


def _calls(statement: ast.stmt) -> list[ast.Call]:
    return [node for node in ast.walk(statement) if isinstance(node, ast.Call)]


def _call_name(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) and call.func.attr == "to" else ast.unparse(call.func)


@pytest.mark.parametrize("module,name", sorted(DECODE_KERNELS, key=lambda k: k[1]))
def test_each_decode_kernel_waits_before_reading_earlier_writes(module, name):
    """``pdl_enter`` comes before anything that loads or stores, and no program returns early
    before it; only the GEMVs load before it, and only from the weight (``w_ptr``)."""
    source = textwrap.dedent(inspect.getsource(getattr(module, name).fn))
    body = ast.parse(source).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    wait = next(i for i, statement in enumerate(body) if ast.unparse(statement) == "pdl_enter(USE_PDL)")
    weight_loads = 0
    for statement in body[:wait]:
        assert isinstance(statement, ast.Assign), ast.unparse(statement)
        for call in _calls(statement):
            if _call_name(call) == "_load_w_tile":
                assert name in PREFETCHING and ast.unparse(call.args[0]) == "w_ptr", ast.unparse(statement)
                weight_loads += 1
            else:
                assert _call_name(call) in INDEX_CALLS, ast.unparse(statement)
    assert (weight_loads > 0) == (name in PREFETCHING)


def test_every_decode_kernel_launch_passes_the_switch():
    """Each launcher of a decode kernel hands the kernel ``pdl_launch``'s arguments (here, on a
    CPU: off), so turning PDL on reaches every one of them."""
    seen = set()
    for _, module, names, call in cases():
        with recording(module, *names) as recorders:
            call()
        for name, recorder in recorders.items():
            for launch in recorder.launches:
                if (module, name) in DECODE_KERNELS:
                    assert launch.kwargs.get("USE_PDL") is False, name
                    seen.add((module, name))
    assert seen == DECODE_KERNELS
