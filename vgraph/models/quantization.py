"""fp8 (e4m3) linear layers, and which quantization scheme a checkpoint runs with.

Two ways to get an fp8 model, as in vLLM:

- ``quantization="fp8"`` on an ordinary checkpoint: the model loads in its activation dtype and
  every linear layer (not the embedding or the lm_head, whose precision matters most for the
  sampled distribution) is then quantized to e4m3 with one per-tensor scale ``amax / 448``.
  Activations have no calibrated range, so they are quantized per token at run time.
- A checkpoint that is already fp8 (config.json ``quantization_config`` with
  ``quant_method: "fp8"``): e4m3 ``*.weight`` with ``*.weight_scale`` and, for
  ``activation_scheme: "static"``, ``*.input_scale``, used as one static activation scale.

Scale choice for the fused q|k|v and gate|up layers: an fp8 checkpoint quantized q, k and v
separately, so their weight scales differ. They are collapsed to one per-tensor scale (the
largest; each shard is requantized to it, which only shrinks values, so nothing saturates)
rather than kept as a per-output-channel vector. One scalar per operand is the form
``torch._scaled_mm`` runs in every output dtype (row-wise scales need bf16 output), so static
fp16 models stay on the fp8 tensor-core path; the cost is one extra rounding of the smaller
shards, which the layer-level tests bound. Static input scales of the shards collapse to
their maximum for the same reason (and so no shard's activations saturate).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

import vgraph.ops  # noqa: F401  (registers torch.ops.vgraph.*)
from vgraph.ops.fp8 import (dynamic_per_token_scaled_fp8_quant_reference,
                            static_scaled_fp8_quant_reference)
from vgraph.ops.kernels.host import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

SUPPORTED_QUANTIZATION = ("fp8",)
ACTIVATION_SCHEMES = ("static", "dynamic")


@dataclass(frozen=True)
class Fp8Config:
    """How a model's linear layers are quantized to fp8.

    ``serialized``: the checkpoint already stores e4m3 weights with ``weight_scale`` (else
    they are quantized after loading). ``static_activations``: per-tensor ``input_scale``
    tensors come with the checkpoint (else activations are quantized per token at run time).
    """

    serialized: bool
    static_activations: bool


def resolve_quantization(requested: Optional[str], hf_config: Any) -> Optional[Fp8Config]:
    """The scheme the model runs with; the checkpoint's own quantization_config decides.

    A checkpoint stored in fp8 can only run in fp8, so it is fp8 even when ``requested`` is
    None. Raises ValueError for a ``requested`` value or a checkpoint format vgraph lacks.
    """
    if requested is not None and requested not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"unsupported quantization {requested!r}; vgraph supports "
                         f"{', '.join(SUPPORTED_QUANTIZATION)} (or None for none)")
    stored = getattr(hf_config, "quantization_config", None)
    if stored is not None:
        return _checkpoint_scheme(stored if isinstance(stored, dict) else stored.to_dict())
    return Fp8Config(serialized=False, static_activations=False) if requested == "fp8" else None


def _checkpoint_scheme(config: dict[str, Any]) -> Fp8Config:
    method = config.get("quant_method")
    if method != "fp8":
        raise ValueError(f"the checkpoint is quantized with {method!r}; vgraph loads "
                         f"{', '.join(SUPPORTED_QUANTIZATION)} checkpoints only")
    if config.get("weight_block_size"):
        raise ValueError("block-wise fp8 checkpoints (weight_block_size) are not supported; "
                         "vgraph loads per-tensor fp8 scales")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"unsupported fp8 activation_scheme {scheme!r}; choose one of "
                         f"{', '.join(ACTIVATION_SCHEMES)}")
    return Fp8Config(serialized=True, static_activations=scheme == "static")


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-tensor e4m3: ``scale = amax / 448`` puts the largest weight at the top of the range.

    Returns ``(q, scale[1] float32)``; an all-zero weight gets the floor scale, not 0/0.
    """
    scale = (weight.detach().float().abs().amax() / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    scale = scale.reshape(1)
    return static_scaled_fp8_quant_reference(weight.detach(), scale), scale


def _param(tensor: Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Fp8Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with W in e4m3 and a per-tensor scale.

    The input is quantized on every call: with ``input_scale`` set (a static scheme) by that
    one scale, else per token. ``use_custom_ops=False`` writes the quantization in plain torch
    (the ops' references) so that Inductor generates and fuses it; the GEMM stays an op,
    since there is no plain-torch fp8 GEMM that runs everywhere. Parameters are created
    uninitialized for the loader to fill; ``bias`` is in the activation ``dtype``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: Any, static: bool, use_custom_ops: bool = True,
                 num_scales: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.use_custom_ops = use_custom_ops
        self.weight = _param(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.weight_scale = _param(torch.ones(num_scales, dtype=torch.float32, device=device))
        self.input_scale: Optional[nn.Parameter] = (
            _param(torch.ones(num_scales, dtype=torch.float32, device=device)) if static else None)
        self.bias: Optional[nn.Parameter] = (
            _param(torch.empty(out_features, dtype=dtype, device=device)) if bias else None)

    def forward(self, x: Tensor) -> Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        q, a_scale = self._quantize_input(x2d)
        out = torch.ops.vgraph.fp8_gemm(q, a_scale, self.weight, self.weight_scale, x.dtype,
                                        self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _quantize_input(self, x2d: Tensor) -> tuple[Tensor, Tensor]:
        if self.input_scale is not None:
            scale = self.input_scale
            if self.use_custom_ops:
                return torch.ops.vgraph.static_scaled_fp8_quant(x2d, scale), scale
            return static_scaled_fp8_quant_reference(x2d, scale), scale
        if self.use_custom_ops:
            return torch.ops.vgraph.dynamic_per_token_scaled_fp8_quant(x2d)
        return dynamic_per_token_scaled_fp8_quant_reference(x2d)

    def finalize(self) -> None:
        """Checks the loaded scales; called once after loading (a no-op beyond that here)."""
        _check_scales(self.weight_scale, "weight_scale")
        if self.input_scale is not None:
            _check_scales(self.input_scale, "input_scale")

    def extra_repr(self) -> str:
        scheme = "static" if self.input_scale is not None else "dynamic"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activations={scheme}")


class Fp8MergedLinear(Fp8Linear):
    """Several fp8 projections of one input (q|k|v, gate|up) run as one fp8 GEMM.

    While loading, ``weight_scale`` (and ``input_scale``) hold one entry per shard, as the
    checkpoint stores them; :meth:`finalize` collapses them to one per-tensor scale (see the
    module docstring for why), requantizing the rows of shards with a smaller scale.
    """

    def __init__(self, in_features: int, shards: list[tuple[str, int]], bias: bool,
                 dtype: torch.dtype, device: Any, static: bool,
                 use_custom_ops: bool = True) -> None:
        super().__init__(in_features, sum(size for _, size in shards), bias, dtype, device,
                         static, use_custom_ops, num_scales=len(shards))
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards:
            self.shards[name] = (start, size)
            start += size
        self._finalized = False

    def shard_view(self, param_name: str, shard: str) -> Tensor:
        """Where the loader copies ``shard``'s part of ``param_name``: rows, or one scale."""
        if param_name in ("weight_scale", "input_scale"):
            index = list(self.shards).index(shard)
            return getattr(self, param_name).data.narrow(0, index, 1)
        start, size = self.shards[shard]
        return getattr(self, param_name).data.narrow(0, start, size)

    @torch.no_grad()
    def finalize(self) -> None:
        """One weight scale and one input scale for the fused GEMM: the shards' maxima."""
        super().finalize()
        if self._finalized:
            return
        scales = self.weight_scale.data
        top = scales.max().reshape(1)
        for (start, size), scale in zip(self.shards.values(), scales):
            rows = self.weight.data.narrow(0, start, size)
            rows.copy_(static_scaled_fp8_quant_reference(rows.float() * scale, top))
        self.weight_scale = _param(top)
        if self.input_scale is not None:
            self.input_scale = _param(self.input_scale.data.max().reshape(1))
        self._finalized = True


def _check_scales(scales: Tensor, name: str) -> None:
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise ValueError(f"fp8 {name} must be finite and positive; got {scales.tolist()}")


@torch.no_grad()
def fp8_linear_from(linear: nn.Module, use_custom_ops: bool = True) -> Fp8Linear:
    """The fp8 form of a loaded high-precision (fused) linear layer, dynamic activations.

    A fused layer keeps its shards and is quantized as a whole: its amax is the largest
    shard amax, so this is the max-scale rule applied before rounding rather than after.
    """
    out_features, in_features = linear.weight.shape
    shards = getattr(linear, "shards", None)
    common = dict(bias=linear.bias is not None, dtype=linear.weight.dtype,
                  device=linear.weight.device, static=False, use_custom_ops=use_custom_ops)
    layer = (Fp8MergedLinear(in_features, [(n, size) for n, (_, size) in shards.items()], **common)
             if shards else Fp8Linear(in_features, out_features, **common))
    q, scale = quantize_weight(linear.weight)
    layer.weight.copy_(q)
    layer.weight_scale.fill_(scale.item())  # every shard's entry: finalize leaves rows as they are
    if linear.bias is not None:
        layer.bias.copy_(linear.bias)
    layer.finalize()
    return layer
