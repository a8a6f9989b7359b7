"""Maps a checkpoint's ``architectures`` (from config.json) to the vgraph module that runs it."""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: Sequence[str] | None) -> type[nn.Module]:
    """The class for the first supported entry; ValueError naming them if none is."""
    for arch in architectures or ():
        if arch in _MODELS:
            return _MODELS[arch]
    named = ", ".join(architectures) if architectures else "none listed in config.json"
    raise ValueError(f"unsupported model architecture ({named}); vgraph supports "
                     f"{', '.join(supported_architectures())}")
