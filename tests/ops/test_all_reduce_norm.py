"""The all-reduce + add + RMSNorm ops: the op contract on a 1-rank gloo group, and the sum
over two spawned ranks against the norm of the summed partials."""
from __future__ import annotations

import pytest
import torch

from tests.gloo_group import single_rank_group, spawn_ranks
from tests.ops.tolerances import assert_fp8_within_one_step
from vgraph.ops.fused_quant import fused_add_rms_norm_static_fp8_quant_reference
from vgraph.ops.kernels.common import FP8_DTYPE
from vgraph.ops.norm import fused_add_rms_norm_reference

V = torch.ops.vgraph
EPS = 1e-5


@pytest.fixture(scope="module")
def group_name():
    with single_rank_group() as name:
        yield name


def _inputs(dtype: torch.dtype, tokens: int = 7, hidden: int = 48, ranks: int = 1):
    """One partial x per rank, the residual and the weight: the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(1234)
    xs = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(ranks)]
    return xs, torch.randn(tokens, hidden, generator=g).to(dtype), torch.randn(hidden, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_equals_the_unfused_norm(group_name, dtype):
    (x,), r, w = _inputs(dtype)
    out, residual = V.all_reduce_fused_add_rms_norm(x, r, w, EPS, group_name)
    ref_out, ref_residual = fused_add_rms_norm_reference(x, r, w, EPS)
    assert out.dtype == residual.dtype == dtype
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(residual, ref_residual, rtol=0, atol=0)
    assert out.data_ptr() != x.data_ptr() and residual.data_ptr() != r.data_ptr(), "functional"


def test_fp8_variant_equals_the_unfused_norm_and_quant(group_name):
    (x,), r, w = _inputs(torch.float32)
    scale = torch.tensor([0.05])
    q, residual = V.all_reduce_fused_add_rms_norm_static_fp8_quant(x, r, w, scale, EPS, group_name)
    ref_q, ref_residual = fused_add_rms_norm_static_fp8_quant_reference(x, r, w, scale, EPS)
    assert q.dtype == FP8_DTYPE
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(residual, ref_residual)
    with pytest.raises(ValueError, match="one-element float32"):
        V.all_reduce_fused_add_rms_norm_static_fp8_quant(x, r, w, torch.tensor([0.1, 0.2]), EPS, group_name)


def test_opcheck(group_name):
    (x,), r, w = _inputs(torch.float32)
    torch.library.opcheck(V.all_reduce_fused_add_rms_norm.default, (x, r, w, EPS, group_name))
    torch.library.opcheck(V.all_reduce_fused_add_rms_norm_static_fp8_quant.default,
                          (x, r, w, torch.tensor([0.05]), EPS, group_name))


def test_unknown_group_is_an_error():
    (x,), r, w = _inputs(torch.float32)
    with single_rank_group(), pytest.raises(Exception, match="no_such_group"):
        V.all_reduce_fused_add_rms_norm(x, r, w, EPS, "no_such_group")


def two_rank_sum(rank: int, world_size: int, group_name: str) -> None:
    """In each spawned rank: the op over this rank's partial equals the norm of the sum of all
    ranks' partials, in both ops; and the fusion pass's rewrite computes the same."""
    from tests.passes.test_all_reduce_norm import custom_form, fuse_and_run
    xs, r, w = _inputs(torch.float32, ranks=world_size)
    total = sum(xs[1:], xs[0].clone())
    out, residual = V.all_reduce_fused_add_rms_norm(xs[rank], r, w, EPS, group_name)
    ref_out, ref_residual = fused_add_rms_norm_reference(total, r, w, EPS)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(residual, ref_residual)
    scale = torch.tensor([0.05])
    q, _ = V.all_reduce_fused_add_rms_norm_static_fp8_quant(xs[rank], r, w, scale, EPS, group_name)
    ref_q, _ = fused_add_rms_norm_static_fp8_quant_reference(total, r, w, scale, EPS)
    assert_fp8_within_one_step(q, ref_q)  # the sums' rounding may differ from the ranks' order
    fused, unfused, counts = fuse_and_run(custom_form(group_name), xs[rank], r, w)
    assert counts == {"all_reduce_fused_add_rms_norm": 1}
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)
    torch.testing.assert_close(fused[0], ref_out)


def test_two_ranks_sum_their_partials():
    spawn_ranks(two_rank_sum, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_runs_nccl_then_the_triton_norm(group_name, dtype):
    """The CUDA kernel (NCCL all-reduce, then the Triton fused_add_rms_norm) against the
    reference, on a 1-rank NCCL group beside the gloo default group."""
    import torch.distributed as dist
    nccl = dist.new_group([0], backend="nccl")
    (x,), r, w = _inputs(dtype, tokens=33, hidden=4096)
    out, residual = V.all_reduce_fused_add_rms_norm(x.cuda(), r.cuda(), w.cuda(), EPS, nccl.group_name)
    ref_out, ref_residual = fused_add_rms_norm_reference(x, r, w, EPS)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(residual.cpu(), ref_residual, rtol=0, atol=0)
    dist.destroy_process_group(nccl)
