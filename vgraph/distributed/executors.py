"""Which executor runs the engine's ranks, decided in one place.

- ``uni``: one rank, the ModelRunner in the engine's own process (no pipes, no actors).
- ``mp``: one spawned process per rank on this machine (``executor.MultiprocExecutor``).
- ``ray``: one Ray actor per rank on a Ray cluster's nodes (``ray_executor.RayExecutor``).

``choose_executor_backend`` decides when the user did not (``--distributed-executor-backend``):
the configuration resolves it once, so the resolved config names the executor wherever the
engine runs (its own thread or the engine-core process); ``make_executor`` builds what it names.
Every executor answers the engine the same way (``num_blocks``, ``execute``, ``submit`` /
``collect``, ``add_lora``, ``close``...), so the engine never asks which one it has.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    from ..config import EngineConfig, ParallelConfig

# Set by ``ray start`` users (and by Ray's job submission) to name the cluster to join.
RAY_ADDRESS_ENV = "RAY_ADDRESS"


def choose_executor_backend(parallel: "ParallelConfig", device_type: str,
                            environ: Optional[Mapping[str, str]] = None,
                            local_devices: Optional[int] = None) -> str:
    """The user's choice, else: ``uni`` for one rank; ``ray`` when a Ray cluster is given
    (``RAY_ADDRESS``, or this process already joined one) or, Ray installed, the ranks outnumber
    this machine's GPUs (the world spans nodes); ``mp`` otherwise. ``environ`` and ``local_devices`` default
    to this process's (tests pass their own)."""
    if parallel.distributed_executor_backend is not None:
        return parallel.distributed_executor_backend
    if parallel.world_size == 1:
        return "uni"
    environ = os.environ if environ is None else environ
    if environ.get(RAY_ADDRESS_ENV) or _ray_connected():
        return "ray"
    if device_type == "cuda" and ray_installed():
        if local_devices is None:
            import torch
            local_devices = torch.cuda.device_count()
        if parallel.world_size > local_devices:
            return "ray"
    return "mp"  # without Ray, too many ranks for this machine's GPUs is the config's refusal


def ray_installed() -> bool:
    """Whether Ray can be imported here (asked without importing it)."""
    return importlib.util.find_spec("ray") is not None


def _ray_connected() -> bool:
    """Whether this process already joined a Ray cluster (``ray.init`` ran): looked up only when
    Ray is already imported, so choosing never imports it."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def make_executor(config: "EngineConfig", hf_config: Any) -> Any:
    """The runner the resolved ``config`` names: a ModelRunner in this process (``uni``) or an
    executor of ranks (``mp``, ``ray``), after checking that the model splits evenly so that a
    bad size fails before any process or actor starts."""
    backend = config.parallel.distributed_executor_backend
    if backend is None:
        raise ValueError("make_executor takes a resolved EngineConfig (EngineConfig.resolved)")
    if backend == "uni":
        from ..worker.runner import ModelRunner
        return ModelRunner(config)
    from ..models.llama import arch_spec
    from .sharding import check_divisible
    spec = arch_spec(hf_config)
    check_divisible(config.parallel.tensor_parallel_size, spec.num_heads, spec.num_kv_heads,
                    spec.intermediate_size)
    if backend == "ray":
        from .ray_executor import RayExecutor
        return RayExecutor(config)
    from .executor import MultiprocExecutor
    return MultiprocExecutor(config)
