"""Model definitions (plain torch modules over vgraph ops), the architecture registry and
the checkpoint loader."""
from __future__ import annotations

from .llama import LlamaForCausalLM
from .loader import (LoadStats, load_generation_config, load_model, load_tokenizer,
                     resolve_model_path)
from .registry import get_model_class, supported_architectures

__all__ = [
    "LlamaForCausalLM", "LoadStats", "load_model", "load_tokenizer", "load_generation_config",
    "resolve_model_path", "get_model_class", "supported_architectures",
]
