"""Test-wide setup.

Without CUDA, Triton kernels are tested under the interpreter, which must be switched on
before triton is imported; this module is imported by pytest before any test module.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
