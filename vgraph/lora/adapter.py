"""Reads a Hugging Face PEFT LoRA folder into per-projection (A, B) pairs, checked against the
base model's shapes.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (older ones
``adapter_model.bin``), with keys like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` ([r, in]) and
``...lora_B.weight`` ([out, r]). PEFT computes ``base(x) + scaling * B(A(x))``, with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` under rsLoRA); the scaling is folded
into B here once, so the op never multiplies by it.

Everything an adapter could ask for that vgraph does not compute (DoRA, LoRA biases, extra
trained modules, per-module rank patterns, other targets) is refused with an error naming the
file and the field or key: silently dropping part of an adapter would serve wrong outputs.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from .request import LoRARequest

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

# HF projection -> the block it lives in (PEFT keys name both).
SUPPORTED_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                     "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields that must be off (falsy) for vgraph to compute the adapter exactly.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a trained bias on lora_B",
    "fan_in_fan_out": "Conv1D-style (fan_in_fan_out) weights",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer replication",
}


class LoRAAdapterError(ValueError):
    """An adapter folder vgraph cannot serve; the message names the file and field or key."""


@dataclass(frozen=True)
class LoRATargets:
    """What adapters may target in a model: its layer count and, per HF projection name,
    ``(in_features, out_features)`` of the full (unsharded) projection."""

    num_layers: int
    shapes: Mapping[str, tuple[int, int]]


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: ``weights[(layer, hf_module)] = (A [r, in], B [out, r] * scaling)``."""

    request: LoRARequest
    rank: int
    scaling: float
    weights: Mapping[tuple[int, str], tuple[Tensor, Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _error(request: LoRARequest, file: str, problem: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {request.lora_name!r} ({os.path.join(request.lora_path, file)}): {problem}")


def read_adapter_config(request: LoRARequest, max_rank: int) -> dict[str, Any]:
    """The adapter's config, checked: a LoRA of rank <= max_rank using only supported features."""
    path = os.path.join(request.lora_path, CONFIG_FILE)
    if not os.path.isdir(request.lora_path):
        raise _error(request, "", "the adapter folder does not exist")
    if not os.path.isfile(path):
        raise _error(request, CONFIG_FILE, "missing: a PEFT adapter folder needs its adapter_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise _error(request, CONFIG_FILE, f"not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise _error(request, CONFIG_FILE, "expected a JSON object")
    _check_config_fields(request, config, max_rank)
    return config


def _check_config_fields(request: LoRARequest, config: dict[str, Any], max_rank: int) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _error(request, CONFIG_FILE, f"field peft_type is {peft_type!r}; only LORA adapters are supported")
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if config.get(flag):
            raise _error(request, CONFIG_FILE, f"field {flag} is set: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise _error(request, CONFIG_FILE, f"field bias is {config['bias']!r}: trained biases are not "
                                           "supported (only 'none')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _error(request, CONFIG_FILE, f"field r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _error(request, CONFIG_FILE, f"field r is {rank}, above max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _error(request, CONFIG_FILE, f"field lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) - set(SUPPORTED_MODULES))
        if unsupported:
            raise _error(request, CONFIG_FILE, f"field target_modules names {unsupported}; supported: "
                                               f"{sorted(SUPPORTED_MODULES)}")


def scaling_of(config: dict[str, Any]) -> float:
    """PEFT's scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def read_adapter_tensors(request: LoRARequest) -> tuple[str, dict[str, Tensor]]:
    """(file name, tensors) from the safetensors file, else the .bin one."""
    safetensors_path = os.path.join(request.lora_path, SAFETENSORS_FILE)
    bin_path = os.path.join(request.lora_path, BIN_FILE)
    if os.path.isfile(safetensors_path):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return SAFETENSORS_FILE, load_file(safetensors_path, device="cpu")
        except (SafetensorError, OSError) as exc:
            raise _error(request, SAFETENSORS_FILE, f"not a readable safetensors file ({exc})") from exc
    if os.path.isfile(bin_path):
        try:
            tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load raises pickle, zip and runtime errors alike
            raise _error(request, BIN_FILE, f"not a readable torch file ({exc})") from exc
        if not isinstance(tensors, dict):
            raise _error(request, BIN_FILE, "expected a dict of tensors")
        return BIN_FILE, tensors
    raise _error(request, SAFETENSORS_FILE, f"missing (and no {BIN_FILE} either): the adapter has no weights")


def _parse_key(request: LoRARequest, file: str, key: str, targets: LoRATargets) -> tuple[int, str, str]:
    """``(layer, hf_module, "A" | "B")`` for a supported key; an error naming it otherwise."""
    match = _KEY.match(key)
    if match is None:
        raise _error(request, file, f"weight {key} is not a LoRA A/B weight of a decoder projection: "
                                    "only q/k/v/o and gate/up/down projections can be adapted")
    layer, block, module, which = int(match[1]), match[2], match[3], match[4]
    if SUPPORTED_MODULES.get(module) != block or module not in targets.shapes:
        raise _error(request, file, f"weight {key} targets {block}.{module}, which is not supported; "
                                    f"supported: {sorted(SUPPORTED_MODULES)}")
    if layer >= targets.num_layers:
        raise _error(request, file, f"weight {key} is for layer {layer}; the model has {targets.num_layers}")
    return layer, module, which


def _pair_up(request: LoRARequest, file: str, tensors: dict[str, Tensor],
             targets: LoRATargets) -> dict[tuple[int, str], dict[str, tuple[str, Tensor]]]:
    pairs: dict[tuple[int, str], dict[str, tuple[str, Tensor]]] = {}
    for key, tensor in tensors.items():
        layer, module, which = _parse_key(request, file, key, targets)
        pairs.setdefault((layer, module), {})[which] = (key, tensor)
    for (layer, module), pair in pairs.items():
        if len(pair) != 2:
            present = next(iter(pair.values()))[0]
            raise _error(request, file, f"weight {present} has no lora_{'B' if 'A' in pair else 'A'} partner")
    if not pairs:
        raise _error(request, file, "holds no LoRA weights")
    return pairs


def _checked_pair(request: LoRARequest, file: str, module: str, pair: dict[str, tuple[str, Tensor]],
                  rank: int, targets: LoRATargets) -> tuple[Tensor, Tensor]:
    (a_key, a), (b_key, b) = pair["A"], pair["B"]
    in_features, out_features = targets.shapes[module]
    if tuple(a.shape) != (rank, in_features):
        raise _error(request, file, f"weight {a_key} has shape {tuple(a.shape)}, expected "
                                    f"{(rank, in_features)} (r={rank}, the base {module}'s input)")
    if tuple(b.shape) != (out_features, rank):
        raise _error(request, file, f"weight {b_key} has shape {tuple(b.shape)}, expected "
                                    f"{(out_features, rank)} (the base {module}'s output, r={rank})")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise _error(request, file, f"weights {a_key} / {b_key} must be floating point")
    return a, b


def load_adapter(request: LoRARequest, targets: LoRATargets, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Reads and checks ``request``'s folder; weights on the host in ``dtype``, B pre-scaled.

    The scaling is applied in float32 before the cast, so an fp32 adapter matches PEFT's
    ``B(A(x)) * scaling`` to rounding."""
    config = read_adapter_config(request, max_rank)
    rank, scaling = config["r"], scaling_of(config)
    file, tensors = read_adapter_tensors(request)
    weights = {}
    for (layer, module), pair in _pair_up(request, file, tensors, targets).items():
        a, b = _checked_pair(request, file, module, pair, rank, targets)
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return LoRAAdapter(request, rank, scaling, weights)
