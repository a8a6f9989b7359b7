"""Test-wide setup.

Without CUDA, Triton kernels are tested under the interpreter, which must be switched on
before triton is imported; this module is imported by pytest before any test module.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One compile cache for the whole test session, away from the user's: tests that build the
# same model and config load each other's artifacts instead of compiling again.
_SESSION_CACHE = tempfile.mkdtemp(prefix="vgraph-test-cache-")
atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
os.environ["VGRAPH_CACHE_DIR"] = _SESSION_CACHE

import vgraph.ops  # noqa: E402  (registers torch.ops.vgraph after the interpreter switch)
from vgraph.ops.kernels.common import INTERPRETED  # noqa: E402


def kernel_devices() -> list:
    """Where Triton kernels can run in this process: interpreted CPU and/or compiled CUDA."""
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is off")),
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs CUDA")]),
    ]


@pytest.fixture(params=kernel_devices())
def kernel_device(request) -> str:
    """Device on which to run a Triton launcher; references always run on CPU."""
    return request.param


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
