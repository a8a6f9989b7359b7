"""``vgraph::lora_add``: opcheck, the reference against a per-row loop, the CPU kernels (dense
and masked; grouped by slot) and the Triton shrink/expand kernels against the reference."""
from __future__ import annotations

import pytest
import torch

from vgraph.ops.lora import lora_add_dense, lora_add_grouped, lora_add_reference

# (tokens, in, slice outputs, rank, slots): a fused q|k|v-like layer, a single slice, odd sizes.
CASES = [(9, 40, (24, 8, 8), 4, 3), (5, 64, (64,), 16, 4), (1, 33, (17, 17), 3, 2), (0, 16, (8,), 2, 2)]


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
def test_cpu_kernel_matches_reference(case):
    args = _inputs(*case)
    expected = lora_add_reference(*args)
    torch.testing.assert_close(lora_add_grouped(*args), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lora_add_dense(*args), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.ops.vgraph.lora_add(*args), expected, atol=1e-4, rtol=1e-5)


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
