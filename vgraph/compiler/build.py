"""Builds the compiled forward for an engine: the ladder of loaders, and what its rungs share
(pass manager, cache key, cache, backend).

The ladder, cheapest rung first (loaders.py says what each one reads; ladder.py climbs it on
the first call, the warm-up, and the startup log names the rung that served):

  runnables -> captured graph -> Inductor artifacts -> full compile

Importing this module imports neither Dynamo nor Inductor: the runnables rung needs neither,
and the rungs below it build their compile session (``_session``, which imports both) only
when they are reached.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

import torch

from ..config import EngineConfig
from ..distributed.state import pp_stage
from ..paths import cache_dir
from .cache import CompileCache, stable_hash
from .cache_key import (RANK, WORLD_SIZE, identity_problems, is_user_pass, key_fields, key_summary, model_layout,
                        named_passes, pass_uuids, short_uuid)
from .counters import CompileCounters
from .ladder import LadderForward
from .loaders import (ArtifactsLoader, CapturedGraphLoader, CompileSession, FullCompileLoader, OnFirstUse,
                      RunnablesLoader)
from .warm_start import warm_key

logger = logging.getLogger("vgraph")


def build_pass_manager(config: EngineConfig) -> Optional[Any]:
    """The user's passes placed "before", vgraph's fusion passes (when enabled), then the
    user's other passes (vgraph/passes/loading.py); None if there are none."""
    if not config.compile.enable_fusion and not config.compile.passes:
        return None
    from vgraph.passes import PassManager, arrange, default_passes
    own = default_passes(lift_plain_torch=config.compile.custom_ops is not False,
                         all_reduce=config.compile.enable_allreduce_fusion)
    passes = arrange(own if config.compile.enable_fusion else [], config.compile.passes)
    return PassManager(passes, dump_dir=config.compile.dump_graphs_dir)


def linear_packing(model: torch.nn.Module) -> str:
    """``packed`` when the projections run vgraph's packed GEMM, else ``plain``."""
    return "packed" if any(name.startswith("PackedLinear") for name in model_layout(model)) else "plain"


def config_key(config: EngineConfig, hf_config: Any, dtype: torch.dtype, pass_uuid: Optional[str],
               device: torch.device, layout: Optional[dict[str, int]] = None, rank: int = RANK,
               world_size: int = WORLD_SIZE) -> str:
    """Hash of everything outside the captured graph that changes the generated code (see
    cache_key.py); ``layout`` is ``model_layout`` of the model as built (None only for
    key-only callers)."""
    return stable_hash(key_fields(config, hf_config, dtype, pass_uuid, device, layout, rank, world_size))


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


def build_forward(model: torch.nn.Module, config: EngineConfig, hf_config: Any,
                  device: torch.device) -> LadderForward:
    """The compiled forward: the ladder, climbed on its first call."""
    counters = CompileCounters()
    session = OnFirstUse(lambda: _session(model, config, hf_config, device, counters))
    loaders = (RunnablesLoader(model, config, hf_config, device, counters), CapturedGraphLoader(model, session),
               ArtifactsLoader(session), FullCompileLoader(session))
    return LadderForward(loaders, counters, lambda: session().cache.compile_lock())


def _session(model: torch.nn.Module, config: EngineConfig, hf_config: Any, device: torch.device,
             counters: CompileCounters) -> CompileSession:
    """Pass manager, full cache key, cache and backend: imports Dynamo and Inductor."""
    from .backend import VgraphBackend
    from .compiled_forward import CompiledForward
    manager = build_pass_manager(config)
    compile_config = _cache_policy(config.compile, manager)
    ranks = pp_stage()  # each rank compiles its own shard's (and stage's) graph: its own cache entry
    fields = key_fields(config, hf_config, model.dtype, manager.uuid() if manager else None, device,
                        model_layout(model), ranks.rank, ranks.world_size)
    key = stable_hash(fields)
    description = {**entry_description(model, config, hf_config, manager, device),
                   "key": key_summary(fields, pass_uuids(manager))}
    cache = CompileCache(cache_dir() if compile_config.use_cache else None, key, description,
                         warm_key(config, hf_config, model, device))
    _log_key(key, manager, compile_config.use_cache)
    backend = VgraphBackend(compile_config, manager, cache, counters)
    return CompileSession(model, cache, backend, CompiledForward(model, backend))


def _cache_policy(compile_config: Any, manager: Optional[Any]) -> Any:
    """The compile config with the cache off when a pass has no reliable identity: a key
    without its uuid cannot tell the pass from an edited version of it, and the entry would
    serve the old pass's code and match counts. One warning names every such pass."""
    problems = identity_problems(manager)
    if not problems or not compile_config.use_cache:
        return compile_config
    which = "; ".join(f"{name}: {why}" for name, why in problems.items())
    logger.warning("the compile cache is off for this compile: a pass has no reliable identity (%s), so "
                   "a cached result could be from an older version of it; every start compiles. Define "
                   "the pass in a .py file, or give it a uuid() that changes whenever it does "
                   "(cache_dir.md, 'Passes and the key')", which)
    return dataclasses.replace(compile_config, use_cache=False)


def _log_key(key: str, manager: Optional[Any], use_cache: bool) -> None:
    """The key, and each user pass's uuid next to it: which version of a pass an entry holds."""
    users = [f"{name} uuid {short_uuid(p.uuid()) or 'none'}" for name, p in named_passes(manager)
             if is_user_pass(p)]
    logger.info("compile cache key %s%s%s", key, "" if use_cache else " (cache not used)",
                f"; user passes: {', '.join(users)}" if users else "")
