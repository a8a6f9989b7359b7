"""The compile cache's key: what it is made of, and the passes whose identity is part of it.

The key is content-based: versions, the device, the model's config and dtype, quantization,
the KV cache dtype (a FULL CUDA graph holds the attention op, whose kernels differ for an fp8
cache: a graph captured over a bf16 cache must never serve an fp8 one), the compile config, each pass's uuid (a hash of its source and settings, passes/identity.py),
the module layout the model was built with, and the tensor-parallel rank and world size (each
rank compiles its own shard's graph, whose shapes and collectives differ; 0 and 1 without
tensor parallelism). Nothing in it names a place: the
checkpoint's path and the home directory are left out, so a checkpoint copied elsewhere, or a
cache copied to another machine with the same versions, is used as it is.

A pass without a reliable identity (no uuid: its source cannot be read) cannot be part of a
key, so the compile runs without the cache; ``identity_problems`` says which and why.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import torch

from ..config import EngineConfig
from .cache import ARTIFACT_FORMAT, environment_fingerprint, stable_hash
from .captured_graph import RECORD_FORMAT

# Key-only callers (``vgraph cache``) without a tensor-parallel group describe rank 0 of 1.
RANK, WORLD_SIZE = 0, 1


def model_fields(hf_config: Any) -> dict[str, Any]:
    """The model's config.json as it affects compiled code: without ``_name_or_path`` (where it
    was loaded from) and the other bookkeeping fields transformers prefixes with ``_``."""
    return {k: v for k, v in hf_config.to_dict().items() if not k.startswith("_") and k != "name_or_path"}


def key_fields(config: EngineConfig, hf_config: Any, dtype: torch.dtype, pass_uuid: Optional[str],
               device: torch.device, layout: Optional[dict[str, int]] = None, rank: int = RANK,
               world_size: int = WORLD_SIZE) -> dict[str, Any]:
    """Everything outside the captured graph that changes the generated code."""
    c = config.compile
    return {
        "env": environment_fingerprint(device), "formats": {"artifact": ARTIFACT_FORMAT, "record": RECORD_FORMAT},
        "model": model_fields(hf_config), "dtype": str(dtype), "quantization": config.model.quantization,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "passes": pass_uuid, "layout": layout, "rank": rank, "world_size": world_size,
        "compile": {"splitting_ops": c.splitting_ops, "compile_sizes": sorted(c.compile_sizes),
                    "custom_ops": c.custom_ops, "enable_fusion": c.enable_fusion},
    }


def key_summary(fields: dict[str, Any], uuids: dict[str, Optional[str]]) -> dict[str, Any]:
    """The key fields as ``vgraph cache ls`` shows them: versions and device in full, the model
    config and layout as short hashes, each pass's uuid (shortened) by name."""
    return {**fields["env"], "model_type": fields["model"].get("model_type"),
            "model_config": stable_hash(fields["model"], 12), "dtype": fields["dtype"].removeprefix("torch."),
            "quantization": fields["quantization"], "kv_cache_dtype": fields["kv_cache_dtype"],
            "compile": fields["compile"],
            "layout": stable_hash(fields["layout"], 12), "rank": fields["rank"], "world_size": fields["world_size"],
            "pass_uuids": {name: short_uuid(u) for name, u in uuids.items()}}


def short_uuid(uuid: Any) -> Optional[str]:
    return None if uuid is None else str(uuid)[:16]


def named_passes(manager: Optional[Any]) -> list[tuple[str, Any]]:
    """(name, pass) in run order; names as in match counts (``Name#2`` for a repeat)."""
    if manager is None:
        return []
    return list(zip(manager.match_counts(), manager.passes))


def pass_uuids(manager: Optional[Any]) -> dict[str, Optional[str]]:
    return {name: p.uuid() for name, p in named_passes(manager)}


def identity_problems(manager: Optional[Any]) -> dict[str, str]:
    """Pass name -> why it has no reliable identity, for each such pass."""
    if manager is None:
        return {}
    from vgraph.passes.identity import identity_problem
    problems = {name: identity_problem(p) for name, p in named_passes(manager)}
    return {name: why for name, why in problems.items() if why is not None}


def is_user_pass(p: Any) -> bool:
    """Whether a pass comes from outside vgraph (its class, or its callable's module)."""
    owner = getattr(p, "fn", p)
    module = getattr(owner, "__module__", None) or type(owner).__module__
    return not (module == "vgraph" or module.startswith("vgraph."))


def model_layout(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of each kind the model was built with. Loading can swap modules
    (packed linears on CPU unless ``VGRAPH_CPU_LINEAR=torch`` or the C++ kernel is missing,
    fp8 linears) or give them other inputs (a packed linear keeping its unpacked weight for
    BLAS prefill): the same config.json then traces another graph over other weights. A
    module names its variant with ``layout_name``, else its class name counts."""
    return dict(sorted(Counter(getattr(m, "layout_name", type(m).__name__) for m in model.modules()).items()))
