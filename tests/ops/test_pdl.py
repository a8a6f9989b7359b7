"""Programmatic dependent launch (``VGRAPH_PDL=1``, ops/kernels/common.py), without a GPU: when
a launch asks for it, and that every kernel of a decode step is launched through it, its
first statement being the wait (``pdl_enter``). That each one compiles for sm_90 with the wait
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
from tests.ops.sm90_compile import cases
from vgraph.ops.kernels import activation, attention, common, gemv, kv_cache, norm

DECODE_KERNELS = {(norm, "_rms_norm_kernel"), (activation, "_silu_and_mul_kernel"),
                  (kv_cache, "_reshape_and_cache_kernel"), (gemv, "_gemv_kernel"), (gemv, "_gemv_silu_mul_kernel"),
                  (attention, "_paged_attention_kernel"), (attention, "_split_kv_stage1_kernel"),
                  (attention, "_split_kv_stage2_kernel")}


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


@pytest.mark.parametrize("module,name", sorted(DECODE_KERNELS, key=lambda k: k[1]))
def test_each_decode_kernel_waits_first(module, name):
    """``pdl_enter`` is the body's first statement: nothing is loaded or stored, and no
    program returns early, before the kernel before it has finished."""
    source = textwrap.dedent(inspect.getsource(getattr(module, name).fn))
    body = ast.parse(source).body[0].body
    first = body[1] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body[0]
    assert ast.unparse(first) == "pdl_enter(USE_PDL)"


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
