"""The capture-safety check (vgraph/compiler/capture_safety.py): one tiny body per fault kind
is refused with the op named, and the same bodies written the capture-safe way pass. The real
FULL and PIECEWISE bodies run under it in test_cudagraph_emulated.py."""
from __future__ import annotations

import contextlib
from typing import Callable

import pytest
import torch

from vgraph.compiler import capture_safety, piecewise_graphs
from vgraph.compiler.capture_safety import CaptureRegion, CaptureSafetyError, call_opaque


def _run(body: Callable[[], object], owned=(), device="cpu", generators=()) -> None:
    CaptureRegion(device, owned, generators).checked(body)()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.arange(1.0, 7.0)


@pytest.fixture
def out() -> torch.Tensor:
    return torch.zeros(6)


def test_a_safe_body_passes_and_writes_its_output(x, out):
    _run(lambda: out.copy_(torch.relu(x * 2 + 1)[:6]), owned=[x, out])
    torch.testing.assert_close(out, x * 2 + 1)


def test_item_is_refused(x, out):
    with pytest.raises(CaptureSafetyError, match=r"aten::_local_scalar_dense .*\.item\(\)"):
        _run(lambda: out.fill_(x.sum().item()), owned=[x, out])


def test_python_bool_of_a_tensor_is_refused(x):
    with pytest.raises(CaptureSafetyError, match="aten::_local_scalar_dense"):
        _run(lambda: bool((x > 3).any()), owned=[x])


@pytest.mark.parametrize("copy", [lambda d, host: d.cpu(), lambda d, host: host.copy_(d),
                                  lambda d, host: d.to("cpu", non_blocking=True)],
                         ids=["cpu()", "copy_", "to(cpu)"])
def test_device_to_host_copies_are_refused(copy):
    # The region's device is named explicitly: "meta" stands for the GPU on a CPU-only machine.
    on_device, host = torch.empty(4, device="meta"), torch.empty(4)
    with pytest.raises(CaptureSafetyError, match=r"aten::(_to_copy|copy_) copies from meta to host memory"):
        _run(lambda: copy(on_device, host), owned=[on_device, host], device="meta")


def test_reading_host_memory_from_a_device_region_is_refused():
    on_device, host = torch.empty(4, device="meta"), torch.ones(4)
    with pytest.raises(CaptureSafetyError, match=r"aten::add reads a torch.float32 tensor \(4,\) on cpu"):
        _run(lambda: on_device + host, owned=[on_device, host], device="meta")


def test_a_cpu_scalar_tensor_is_a_kernel_argument_not_a_host_read():
    on_device, scalar = torch.empty(4, device="meta"), torch.tensor(2.0)
    _run(lambda: on_device.mul_(scalar), owned=[on_device, scalar], device="meta")


@pytest.mark.parametrize("op, name", [
    (lambda x: torch.nonzero(x), "aten::nonzero"),
    (lambda x: torch.argwhere(x), "aten::nonzero"),
    (lambda x: torch.masked_select(x, x > 2), "aten::masked_select"),
    (lambda x: torch.unique(x), "aten::_unique2"),
    (lambda x: torch.unique_consecutive(x), "aten::unique_consecutive"),
    (lambda x: torch.repeat_interleave(x, x.long()), "aten::repeat_interleave"),
    (lambda x: torch.bincount(x.long()), "aten::bincount"),
    (lambda x: x[x > 2], "aten::index"),
], ids=["nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "repeat_interleave",
        "bincount", "bool_mask_index"])
def test_data_dependent_shapes_are_refused(x, op, name):
    with pytest.raises(CaptureSafetyError, match=f"{name} "):
        _run(lambda: op(x), owned=[x])


def test_data_dependent_ops_with_a_static_shape_pass(x, out):
    long = torch.tensor([0, 2, 4])
    def body() -> None:
        out[:3].copy_(x[long])  # integer indexing: the shape is the index's
        out.copy_(torch.repeat_interleave(x[:3], torch.full((3,), 2), output_size=6))
        out.masked_fill_(out > 2, 0.0)
    _run(body, owned=[x, out, long])
    assert out.tolist() == [1.0, 1.0, 2.0, 2.0, 0.0, 0.0]


def test_an_allocation_that_escapes_the_region_is_refused(x):
    kept: list[torch.Tensor] = []
    with pytest.raises(CaptureSafetyError, match=r"aten::mul allocated a torch.float32 tensor \(6,\) .* still "
                                                 r"referenced after the region"):
        _run(lambda: kept.append(x * 2), owned=[x])


def test_a_view_of_an_owned_buffer_may_outlive_the_region(x, out):
    kept: list[torch.Tensor] = []
    _run(lambda: kept.append(out[:3].copy_(x[:3] * 2)), owned=[x, out])
    assert kept[0].data_ptr() == out.data_ptr()


def test_random_numbers_without_a_declared_generator_are_refused(out):
    with pytest.raises(CaptureSafetyError, match="aten::rand draws random numbers from a generator the graph"):
        _run(lambda: out.copy_(torch.rand(6)), owned=[out])
    with pytest.raises(CaptureSafetyError, match="aten::exponential_"):
        _run(lambda: out.exponential_(), owned=[out])
    with pytest.raises(CaptureSafetyError, match="aten::(native_dropout|bernoulli_)"):
        _run(lambda: out.copy_(torch.nn.functional.dropout(out, 0.5, training=True)), owned=[out])
    with pytest.raises(CaptureSafetyError, match="aten::rand"):
        _run(lambda: out.copy_(torch.rand(6, generator=torch.Generator())), owned=[out])


def test_random_numbers_from_a_declared_generator_pass(out):
    gen = torch.Generator().manual_seed(0)
    _run(lambda: out.copy_(torch.rand(6, generator=gen)), owned=[out], generators=[gen])
    assert bool((out > 0).all())


def test_reading_a_tensor_the_graph_does_not_own_is_refused(x, out):
    per_call = torch.randn(6)  # e.g. this step's batch tensor: another address next step
    with pytest.raises(CaptureSafetyError, match=r"aten::add reads a torch.float32 tensor \(6,\) on cpu the "
                                                 r"graph does not own"):
        _run(lambda: out.copy_(x + per_call), owned=[x, out])


def test_writing_a_tensor_the_graph_does_not_own_is_refused(x):
    per_call_out = torch.empty(6)
    with pytest.raises(CaptureSafetyError, match="aten::copy_ .*does not own"):
        _run(lambda: per_call_out.copy_(x), owned=[x])


def test_compiled_pieces_are_checked_at_their_boundary(x, out):
    """A compiled piece allocates where the dispatcher does not see: its arguments must be
    owned, its outputs are the region's; inside it only the op-level rules hold."""
    scratch_before = torch.ones(6)  # stands in for an Inductor buffer: unseen by the check
    piece = lambda a: [a * scratch_before]  # noqa: E731
    _run(lambda: out.copy_(call_opaque(piece, [x])[0] + 1), owned=[x, out])
    torch.testing.assert_close(out, x + 1)
    per_call = torch.ones(6)
    with pytest.raises(CaptureSafetyError, match="a compiled piece reads .* does not own"):
        _run(lambda: call_opaque(piece, [per_call]), owned=[out])
    with pytest.raises(CaptureSafetyError, match="aten::_local_scalar_dense"):
        _run(lambda: call_opaque(lambda a: [a * a.sum().item()], [x]), owned=[x])


def test_call_opaque_outside_a_check_is_a_plain_call(x):
    assert call_opaque(lambda a, b: a + b, [x, 1]).tolist() == (x + 1).tolist()


@pytest.mark.parametrize("setting, checked", [("1", True), ("0", False), (None, False)])
def test_record_runs_the_body_under_the_check_when_the_env_var_is_set(monkeypatch, x, setting, checked):
    """On CUDA ``record`` honours VGRAPH_CHECK_CAPTURE; ``torch.cuda.graph`` is stubbed here."""
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    if setting is None:
        monkeypatch.delenv(capture_safety.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(capture_safety.ENV_VAR, setting)
    region = CaptureRegion("cpu", [x])
    ran = []
    body = lambda: ran.append(x.sum().item())  # noqa: E731
    if checked:
        with pytest.raises(CaptureSafetyError, match="aten::_local_scalar_dense"):
            piecewise_graphs.record(object(), None, body, region)
    else:
        piecewise_graphs.record(object(), None, body, region)
        assert ran == [21.0]
