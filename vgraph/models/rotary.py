"""Rotary position embedding (RoPE), neox style, with Llama 3 and linear frequency scaling.

The cos/sin tables are computed once up to the maximum position and indexed by each token's
position, so the forward pass is two gathers and a few multiplies that Inductor fuses. The
inverse frequencies are computed exactly the way Hugging Face transformers computes them
(in float32, from the same expressions), because fp32 greedy decoding is checked token for
token against transformers and an ulp of difference in a frequency can flip a near-tie.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings of a config as one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``rope_parameters``; older configs (and config.json files
    written by them) use ``rope_scaling`` (possibly None, key ``type`` or ``rope_type``) plus a
    top-level ``rope_theta``. Both shapes are accepted.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    params.setdefault("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    params["rope_theta"] = 10000.0 if theta is None else theta
    if params["rope_type"] == "llama3":
        top_level = getattr(hf_config, "original_max_position_embeddings", None)
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def _base_inv_freq(base: float, dim: int) -> Tensor:
    # Same expression and dtype path as transformers' RoPE init functions.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (base ** exponents)


def _llama3_inv_freq(inv_freq: Tensor, params: Mapping[str, Any]) -> Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, a smooth ramp in between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(params: Mapping[str, Any], head_dim: int) -> Tensor:
    """Inverse frequencies [head_dim // 2] (float32, CPU) for a supported RoPE type."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; vgraph supports "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are "
                         "not supported")
    inv_freq = _base_inv_freq(params["rope_theta"], head_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """The cos/sin tables [max_position, D/2], gathered by position once per forward.

    The tables are float32 and non-persistent (not weights); cos/sin are cast to the
    activation dtype before use, as transformers does.
    """

    def __init__(self, head_dim: int, max_position: int, params: Mapping[str, Any],
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(params, head_dim)
        inv_freq = inv_freq.to(device=device)
        positions = torch.arange(max_position, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, D/2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, D/2] for ``positions``, in the activation dtype (as transformers)."""
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] by the per-token angles in cos/sin [T, 1, D/2]."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * [cos|cos] + rotate_half(x) * [sin|sin]``, written per half (same fp result)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
