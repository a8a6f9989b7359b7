"""vgraph: an LLM inference runtime built around torch.compile and CUDA graphs.

Attributes load lazily, so that ``import vgraph`` (and the CLI) can decide environment
switches such as ``TRITON_INTERPRET`` before torch or triton are imported. Importing
``vgraph.ops`` registers the ``torch.ops.vgraph`` custom ops. Importing the package sets up
vgraph's default logging (``vgraph.logging_setup``: INFO to stderr, ``VGRAPH_LOGGING_LEVEL``).
"""
from __future__ import annotations

import importlib
from typing import Any

from . import omp_policy
from .logging_setup import configure_default_logging

omp_policy.apply_default()  # before torch loads OpenMP: see omp_policy.py

__version__ = "0.1.0"

configure_default_logging()  # INFO on stderr unless the application configured logging

_LAZY = {
    "ops": ("vgraph.ops", None),
    "passes": ("vgraph.passes", None),
    "SamplingParams": ("vgraph.sampling_params", "SamplingParams"),
    "StructuredOutputsParams": ("vgraph.structured.params", "StructuredOutputsParams"),
    "GuidedDecodingParams": ("vgraph.structured.params", "GuidedDecodingParams"),
    "LLM": ("vgraph.engine.llm", "LLM"),
    "LLMEngine": ("vgraph.engine.llm_engine", "LLMEngine"),
    "RequestOutput": ("vgraph.engine.outputs", "RequestOutput"),
    "EngineConfig": ("vgraph.config", "EngineConfig"),
    "LoRARequest": ("vgraph.lora.request", "LoRARequest"),
    "PoolingParams": ("vgraph.pooling_params", "PoolingParams"),
    "EmbeddingRequestOutput": ("vgraph.engine.outputs", "EmbeddingRequestOutput"),
}
__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams",
           "PoolingParams", "RequestOutput", "EmbeddingRequestOutput", "EngineConfig", "LoRARequest", "ops", "passes"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'vgraph' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module
