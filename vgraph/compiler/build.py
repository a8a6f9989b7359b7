"""Builds the compiled forward for an engine: pass manager, cache key, cache, backend."""
from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any, Optional

import torch

from ..config import EngineConfig
from ..paths import cache_dir
from .backend import VgraphBackend
from .cache import CompileCache, environment_fingerprint, stable_hash
from .compiled_forward import CompiledForward
from .counters import CompileCounters

logger = logging.getLogger("vgraph")


def build_pass_manager(config: EngineConfig) -> Optional[Any]:
    """vgraph's fusion passes (when enabled) followed by the user's passes; None if none."""
    if not config.compile.enable_fusion and not config.compile.passes:
        return None
    from vgraph.passes import PassManager, default_passes
    own = default_passes(lift_plain_torch=config.compile.custom_ops is not False)
    passes = (own if config.compile.enable_fusion else []) + list(config.compile.passes)
    return PassManager(passes, dump_dir=config.compile.dump_graphs_dir)


def model_layout(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of each class the model was built with. Loading can swap modules
    (packed linears on CPU unless ``VGRAPH_CPU_LINEAR=torch`` or the C++ kernel is missing,
    fp8 linears): the same config.json then traces another graph over other weights."""
    return dict(sorted(Counter(type(m).__name__ for m in model.modules()).items()))


def linear_packing(model: torch.nn.Module) -> str:
    """``packed`` when the projections run vgraph's packed GEMM, else ``plain``."""
    return "packed" if "PackedLinear" in model_layout(model) else "plain"


def config_key(config: EngineConfig, hf_config: Any, dtype: torch.dtype, pass_uuid: Optional[str],
               device: torch.device, layout: Optional[dict[str, int]] = None) -> str:
    """Hash of everything outside the captured graph that changes the generated code;
    ``layout`` is ``model_layout`` of the model as built (None only for key-only callers)."""
    model = {k: v for k, v in hf_config.to_dict().items() if k not in ("_name_or_path", "name_or_path")}
    c = config.compile
    return stable_hash({
        "env": environment_fingerprint(device), "model": model, "dtype": str(dtype),
        "quantization": config.model.quantization, "passes": pass_uuid, "layout": layout,
        "compile": {"splitting_ops": c.splitting_ops, "compile_sizes": sorted(c.compile_sizes),
                    "custom_ops": c.custom_ops, "enable_fusion": c.enable_fusion},
    })


def entry_description(model: torch.nn.Module, config: EngineConfig, hf_config: Any,
                      manager: Optional[Any], device: torch.device) -> dict[str, Any]:
    """What a new cache entry records about itself in meta.json (``vgraph cache list``)."""
    name = config.model.model
    local = os.path.abspath(os.path.expanduser(name)) if os.path.isdir(os.path.expanduser(name)) else None
    return {"model": name, "model_path": local,
            "architecture": (getattr(hf_config, "architectures", None) or ["?"])[0],
            "dtype": str(model.dtype).removeprefix("torch."), "quantization": _quantization(model, config),
            "passes": list(manager.match_counts()) if manager is not None else [],
            "linears": linear_packing(model), "device": device.type}


def _quantization(model: torch.nn.Module, config: EngineConfig) -> Optional[str]:
    """The quantization asked for, or fp8 when the checkpoint brought fp8 layers itself."""
    if config.model.quantization:
        return config.model.quantization
    return "fp8" if any(name.startswith("Fp8") for name in model_layout(model)) else None


def build_compiled_forward(model: torch.nn.Module, config: EngineConfig, hf_config: Any,
                           device: torch.device) -> tuple[CompiledForward, CompileCounters, CompileCache]:
    manager = build_pass_manager(config)
    key = config_key(config, hf_config, model.dtype, manager.uuid() if manager else None, device,
                     model_layout(model))
    description = entry_description(model, config, hf_config, manager, device)
    cache = CompileCache(cache_dir() if config.compile.use_cache else None, key, description)
    counters = CompileCounters()
    backend = VgraphBackend(config.compile, manager, cache, counters)
    return CompiledForward(model, backend), counters, cache


def log_compile_summary(counters: CompileCounters, cache: CompileCache, seconds: float) -> None:
    c = counters
    if c.captured_graph == "loaded":
        logger.info("loaded the compiled model from the cache in %.2f s (%d pieces, %d compiled, %d distinct): "
                    "captured graph and %d artifacts in %.2f s, no Dynamo trace, no Inductor compilation",
                    seconds, c.pieces, c.compiled_pieces, c.unique_piece_graphs, c.cache_loads,
                    c.captured_load_seconds)
    else:
        logger.info("compiled %d pieces (%d compiled, %d distinct) in %.2f s: Dynamo %.2f s, "
                    "Inductor %.2f s (%d compilations), cache %d loads (%.2f s), %d saves",
                    c.pieces, c.compiled_pieces, c.unique_piece_graphs, seconds, c.dynamo_seconds,
                    c.inductor_seconds, c.inductor_compilations, c.cache_loads, c.cache_load_seconds,
                    c.cache_saves)
    if c.pass_matches:
        logger.info("pass matches: %s", ", ".join(f"{k}={v}" for k, v in c.pass_matches.items()))
    if cache.writable:
        logger.info("compile cache: %s", cache.folder)
    elif cache.root is not None:
        logger.info("compile cache: none this run (compiled in memory; see the warning above)")
