"""``vgraph::rotary_qk``: its numerics are those of the compiled plain-torch rotation (what a
model without the op gets from Inductor), and the Triton kernel matches them on the head
views a model passes (strided slices of one qkv row per token)."""
from __future__ import annotations

import pytest
import torch

from vgraph.models.rotary import _rotate, apply_rotary
from vgraph.ops.kernels.rotary import rotary_qk_triton
from vgraph.ops.rotary import rotary_qk_reference

# (tokens, q heads, k heads, head dim): the 0.5B and 8B decode shapes, a prefill chunk, a head
# dim whose half is not a power of two, and no tokens at all.
SHAPES = [(1, 14, 2, 64), (1, 32, 8, 128), (37, 14, 2, 64), (3, 5, 5, 80), (0, 4, 2, 64)]


def head_views(tokens: int, q_heads: int, k_heads: int, dim: int, dtype: torch.dtype):
    """q and k as Attention.forward makes them: views into one [T, (Hq + 2 Hk) D] qkv."""
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, dtype=dtype)
    q = qkv[:, :q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim:(q_heads + k_heads) * dim].view(tokens, k_heads, dim)
    angles = torch.randn(tokens, 1, dim // 2) * 50
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_the_compiled_plain_torch_rotation(dtype):
    q, k, cos, sin = head_views(37, 14, 2, 64, dtype)
    compiled = torch.compile(_rotate, fullgraph=True)
    q_ref, k_ref = rotary_qk_reference(q, k, cos, sin)
    assert torch.equal(q_ref, compiled(q, cos, sin)) and torch.equal(k_ref, compiled(k, cos, sin))


def test_in_fp32_it_is_the_eager_rotation():
    q, k, cos, sin = head_views(5, 4, 2, 64, torch.float32)
    for got, want in zip(torch.ops.vgraph.rotary_qk(q, k, cos, sin), apply_rotary(q, k, cos, sin)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(kernel_device, shape, dtype):
    q, k, cos, sin = head_views(*shape, dtype)
    half = shape[3] // 2
    dev = [t.to(kernel_device) for t in (q, k, cos.reshape(-1, half), sin.reshape(-1, half))]
    q_out, k_out = rotary_qk_triton(*dev)
    q_ref, k_ref = rotary_qk_reference(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.is_contiguous()
    # Interpreted, the kernel's fp32 math is the reference's exactly; compiled, a multiply-add
    # may be fused, which can move a value by its last bit.
    tol = {} if kernel_device == "cpu" else {"atol": 1e-2 if dtype != torch.float32 else 1e-5, "rtol": 1e-2}
    torch.testing.assert_close(q_out.cpu(), q_ref, **(tol or {"atol": 0, "rtol": 0}))
    torch.testing.assert_close(k_out.cpu(), k_ref, **(tol or {"atol": 0, "rtol": 0}))


def test_opcheck():
    q, k, cos, sin = head_views(3, 4, 2, 16, torch.float32)
    torch.library.opcheck(torch.ops.vgraph.rotary_qk.default, (q, k, cos, sin))


def test_bad_shapes_raise():
    q, k, cos, sin = head_views(3, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="even D"):
        torch.ops.vgraph.rotary_qk(q[..., :15], k[..., :15], cos, sin)
    with pytest.raises(ValueError, match="T, Hq, D"):
        torch.ops.vgraph.rotary_qk(q, k[:2], cos, sin)
    with pytest.raises(ValueError, match="cos and sin"):
        torch.ops.vgraph.rotary_qk(q, k, cos[:2], sin[:2])


def test_traces_once_for_any_token_count():
    """The fake implementation's shape checks add no guard on the token count: one trace
    serves every prefill size (the engine compiles the forward once and fails on recompiles)."""
    torch._dynamo.reset()
    rotate = torch.compile(lambda q, k, c, s: torch.ops.vgraph.rotary_qk(q, k, c, s), dynamic=True, fullgraph=True)
    for tokens in (3, 5, 9):  # none equal to a head count: duck sizing would tie them
        inputs = head_views(tokens, 4, 2, 16, torch.float32)
        with torch.compiler.set_stance("fail_on_recompile" if tokens > 3 else "default"):
            got = rotate(*inputs)
        for out, want in zip(got, rotary_qk_reference(*inputs)):
            assert torch.equal(out, want)
