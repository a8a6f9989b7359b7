"""``vgraph::rotary_qk``: rotary position embedding of a layer's q and k, in one op.

What a model with custom ops on CUDA calls (vgraph/models/llama.py ``rotary_by_op``) instead
of the plain-torch rotation, so that on CUDA it is one kernel a layer, launched with programmatic dependent
launch (ops/kernels/rotary.py), where Inductor makes two of the plain form. The numerics are
those of Inductor's kernels for that form: fp32 math rounded once to the activation dtype
(checked in tests/ops/test_rotary.py against ``torch.compile`` of models/rotary.py's form).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kernels import lazy
from .registration import vgraph_op

kernels = lazy("rotary")


def _checked(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin as [T, D/2] views; raises on shapes that do not fit together."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"rotary_qk wants q [T, Hq, D] and k [T, Hk, D] with an even D; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}")
    tokens, half = q.shape[0], q.shape[2] // 2
    if cos.numel() != tokens * half or sin.shape != cos.shape:
        raise ValueError(f"rotary_qk wants cos and sin of {tokens} x {half} values; got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    return cos.reshape(tokens, half), sin.reshape(tokens, half)


def rotary_qk_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = _checked(q, k, cos, sin)
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]

    def rotate(x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


@vgraph_op("vgraph::rotary_qk", mutates_args=())
def rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] rotated by the per-token angles cos/sin ([T, 1, D/2] or
    [T, D/2]): ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`` per head, new tensors."""
    return rotary_qk_reference(q, k, cos, sin)


@rotary_qk.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    _checked(q, k, cos, sin)
    return q.new_empty(q.shape), k.new_empty(k.shape)


@rotary_qk.register_kernel("cuda")
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = _checked(q, k, cos, sin)
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        return rotary_qk_reference(q, k, cos, sin)
    return kernels.rotary_qk_triton(q, k, cos, sin)
