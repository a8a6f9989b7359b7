"""``vgraph::lora_add``: opcheck, the reference against a per-row loop, the CPU kernels (the C++
kernel, csrc/lora_cpu.cpp; the torch form grouped by slot) and the Triton shrink/expand kernels
against the reference."""
from __future__ import annotations

import pytest
import torch

from vgraph.ops import lora
from vgraph.ops.lora import lora_add_grouped, lora_add_native, lora_add_reference

requires_native = pytest.mark.skipif(lora._NATIVE.load() is None, reason="the C++ lora kernel cannot be built here")

# (tokens, in, slice outputs, rank, slots): a fused q|k|v-like layer, a single slice, odd sizes,
# no rows; then the C++ kernel's fast paths (rank a multiple of 16, whole 64-column blocks,
# rows in tiles of 4) beside their edges (a narrower last block, an odd number of A rows).
CASES = [(9, 40, (24, 8, 8), 4, 3), (5, 64, (64,), 16, 4), (1, 33, (17, 17), 3, 2), (0, 16, (8,), 2, 2),
         (37, 96, (128, 64, 72), 16, 4), (11, 48, (200,), 32, 2), (6, 20, (64, 64), 5, 3)]


def _inputs(tokens, in_features, outs, rank, slots, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=gen)
    lora_a = torch.randn(slots, len(outs) * rank, in_features, generator=gen)
    lora_b = [torch.randn(slots, out, rank, generator=gen) for out in outs]
    base = torch.randn(tokens, sum(outs), generator=gen)
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
    return base, x, lora_a, lora_b, token_slots


def _loop(base, x, lora_a, lora_b, token_slots):
    rank, out = lora_b[0].shape[2], base.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            h = lora_a[slot] @ x[t]
            out[t] += torch.cat([b[slot] @ h[i * rank:(i + 1) * rank] for i, b in enumerate(lora_b)])
    return out


@pytest.mark.parametrize("case", CASES)
def test_reference_is_each_rows_adapter(case):
    args = _inputs(*case)
    torch.testing.assert_close(lora_add_reference(*args), _loop(*args), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("case", CASES[:3])
def test_opcheck(case):
    torch.library.opcheck(torch.ops.vgraph.lora_add.default, _inputs(*case))


@pytest.mark.parametrize("case", CASES)
def test_cpu_kernels_match_reference(case):
    args = _inputs(*case)
    expected = lora_add_reference(*args)
    torch.testing.assert_close(lora_add_grouped(*args), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lora_add_native(*args), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.ops.vgraph.lora_add(*args), expected, atol=1e-4, rtol=1e-5)


@requires_native
@pytest.mark.parametrize("case", CASES[:5])
def test_native_kernel_in_bfloat16(case):
    """bfloat16 operands, float32 accumulation: within bfloat16 rounding of the reference."""
    base, x, lora_a, lora_b, slots = _inputs(*case)
    args = (base.bfloat16(), x.bfloat16(), lora_a.bfloat16(), [b.bfloat16() for b in lora_b], slots.long())
    out = lora_add_native(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), lora_add_reference(*args).float(), atol=0.1, rtol=2e-2)


@requires_native
def test_native_kernel_takes_strided_rows():
    """x and base as column slices of wider tensors (a fused projection's output, say)."""
    base, x, lora_a, lora_b, slots = _inputs(12, 64, (64, 32), 16, 3)
    wide_x, wide_base = torch.randn(12, 100), torch.randn(12, 130)
    wide_x[:, 10:74], wide_base[:, 20:116] = x, base
    out = lora_add_native(wide_base[:, 20:116], wide_x[:, 10:74], lora_a, lora_b, slots)
    torch.testing.assert_close(out, lora_add_reference(base, x, lora_a, lora_b, slots), atol=1e-4, rtol=1e-5)


@requires_native
def test_native_kernel_names_a_slot_out_of_range():
    base, x, lora_a, lora_b, slots = _inputs(5, 32, (16,), 4, 2)
    slots[3] = 2
    with pytest.raises(ValueError, match="token 3 has LoRA slot 2"):
        lora_add_native(base, x, lora_a, lora_b, slots)


def test_torch_switch_runs_the_grouped_form(monkeypatch):
    """VGRAPH_CPU_LORA=torch sends the op to lora_add_grouped (no C++ call at all)."""
    calls = []
    monkeypatch.setenv(lora.ENV_SWITCH, "torch")
    monkeypatch.setattr(lora, "lora_add_grouped", lambda *a: calls.append(1) or lora_add_reference(*a))
    args = _inputs(*CASES[0])
    torch.testing.assert_close(torch.ops.vgraph.lora_add(*args), lora_add_reference(*args))
    assert calls == [1]


def test_rows_without_adapter_are_the_base_exactly():
    base, x, lora_a, lora_b, _ = _inputs(6, 32, (16, 16), 4, 2)
    out = torch.ops.vgraph.lora_add(base, x, lora_a, lora_b, torch.full((6,), -1, dtype=torch.int64))
    assert torch.equal(out, base)


def test_bad_shapes_are_named():
    base, x, lora_a, lora_b, slots = _inputs(4, 32, (16, 16), 4, 2)
    with pytest.raises(ValueError, match="do not sum"):
        torch.ops.vgraph.lora_add(base[:, :20], x, lora_a, lora_b, slots)
    with pytest.raises(ValueError, match="rank rows"):
        torch.ops.vgraph.lora_add(base, x, lora_a[:, :6], lora_b, slots)
    with pytest.raises(ValueError, match="token_slots"):
        torch.ops.vgraph.lora_add(base, x, lora_a, lora_b, slots.float())
    with pytest.raises(ValueError, match="one row per token"):
        torch.ops.vgraph.lora_add(base, x, lora_a, lora_b, slots[:3])


@pytest.mark.parametrize("case", CASES)
def test_triton_kernels_match_reference(case, kernel_device):
    from vgraph.ops.kernels.lora import lora_expand_triton, lora_shrink_triton
    args = _inputs(*case)
    expected = lora_add_reference(*args)
    base, x, lora_a, lora_b, slots = (a.to(kernel_device) if isinstance(a, torch.Tensor)
                                      else [b.to(kernel_device) for b in a] for a in args)
    out = lora_expand_triton(base, lora_shrink_triton(x, lora_a, slots), lora_b, slots)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_matches_reference(dtype):
    args = _inputs(32, 256, (256, 64, 64), 16, 4)
    expected = lora_add_reference(*args)
    cuda = [a.cuda() if isinstance(a, torch.Tensor) else [b.cuda() for b in a] for a in args]
    cuda = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else
            ([b.to(dtype) for b in a] if isinstance(a, list) else a) for a in cuda]
    out = torch.ops.vgraph.lora_add(*cuda)
    tol = 1e-4 if dtype == torch.float32 else 0.5
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol if dtype != torch.float32 else 1e-4)


def test_float16_runs_the_grouped_form():
    """The C++ kernel takes float32 and bfloat16; float16 operands fall back to the torch form."""
    base, x, lora_a, lora_b, slots = _inputs(*CASES[0])
    args = (base.half(), x.half(), lora_a.half(), [b.half() for b in lora_b], slots)
    assert not lora._native_applies(*args[:4])
    out = torch.ops.vgraph.lora_add(*args)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), lora_add_reference(*args).float(), atol=0.1, rtol=2e-2)
