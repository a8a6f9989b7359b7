"""The serving topology's one home: from the engine options, what ``vgraph serve`` runs.

One engine is an ``EngineClient`` whose transport is the engine-core process (the default) or
a thread of the server (``in_process``). ``data_parallel_size`` N > 1 puts N such clients,
each its own ``LLMEngine`` on its own device (``cuda:i``, or all on the CPU), behind the
prefix-affine router (``DataParallelEngine``), with ``cores // N`` torch threads each: they
share the machine's cores. Tensor parallelism is inside each engine (its executor).

The CLI parses and calls ``serving_engine``; nothing here recomputes what the config
resolves (the router's block size is the one the engine config resolves to).
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # imported when building: prepare_environment must run before torch loads
    from .client import EngineClient


# The step token budget of a CPU engine that serves streams (``--max-num-batched-tokens`` not
# given): vLLM's own serving default, so that the prompts that arrive together are prefilled
# together, in one step of large, efficient GEMMs, and the streams they start then decode in
# step. Small chunks (128 tokens, the earlier default) staggered the streams: every later
# arrival cut into every running stream's decoding, and the 2-core served suite measured
# 16.3 req/s with ITL p99 30 ms against 21.1 req/s with ITL p99 14 ms at 2048 (the price is the
# time to first token of a wave: TTFT p50 86 -> 214 ms). Small chunks had been a cure for
# ~100 ms stalls that turned out to be page faults in the lazily mapped KV pool, which the
# prefault below removes. ``python -m perf run serving-vllm --device cpu`` measures both.
SERVE_CPU_STEP_TOKENS = 2048


class TopologyError(ValueError):
    """The asked topology cannot run here (a user error: the CLI prints one line)."""


@dataclass(frozen=True)
class ServingTopology:
    """What ``vgraph serve`` was asked to run. ``engine_kwargs`` are ``EngineConfig.from_kwargs``
    keywords (``passes``: loaded pass objects, for engines in this process); ``pass_specs`` the
    same passes as ``--pass`` specs, which an engine-core process loads itself."""

    model: str
    engine_kwargs: dict[str, Any]
    pass_specs: list[str] = field(default_factory=list)
    in_process: bool = False
    data_parallel_size: int = 1
    max_queue_len: Optional[int] = None
    log_level: str = "INFO"


def prepare_environment() -> None:
    """What the serving processes need before torch loads (OpenMP reads it then): vgraph's
    OpenMP wait policy (``omp_policy``), which ``import vgraph`` has normally applied already.

    The engine shares the CPU with the HTTP server and the clients. OpenMP workers that spin
    between parallel regions for libgomp's default ~300,000 polls starve them, and on a busy
    machine every region then waits for descheduled spinners (measured on 2 cores with the
    engine on a thread of the server: inter-token latency at 1 stream ~150 ms spinning, ~10 ms
    passive). ``omp_policy`` waits passively when the machine is busy as vgraph loads and spins
    briefly (``GOMP_SPINCOUNT=1000``) otherwise; an explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT
    from the user wins.
    """
    from .. import omp_policy
    omp_policy.apply_default()


def serving_engine(topology: ServingTopology) -> Any:
    """The engine the server runs (not started): one ``EngineClient``, or N behind the router."""
    topology = with_serving_defaults(topology)
    size = topology.data_parallel_size
    if size == 1:
        return _client(topology, topology.engine_kwargs["device"], None, None)
    import torch

    from ..config import EngineConfig
    from .dp_engine import data_parallel
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // size)
    building = threading.Lock()
    devices = replica_devices(topology.engine_kwargs["device"], size)
    replicas = [_client(topology, device, threads, building) for device in devices]
    # The router hashes prompts in the replicas' KV blocks, the size their config resolves to.
    config = EngineConfig.from_kwargs(topology.model, **{**topology.engine_kwargs, "device": devices[0]})
    return data_parallel(replicas, config.cache.resolved(torch.device(devices[0]).type).block_size)


def with_serving_defaults(topology: ServingTopology) -> ServingTopology:
    """``topology`` with what serving wants on CPU where the user chose nothing:

    - the step budget ``SERVE_CPU_STEP_TOKENS``, but never fewer than ``max_num_seqs`` (each
      running stream must fit its decode row into every step, or the later ones wait while the
      earlier ones run). A budget that must hold whole prompts (``--no-chunked-prefill``) is
      left to the engine;
    - the KV cache prefaulted in the background (``kv_cache_prefault``): the pool hands out
      fresh blocks until all of it has been used once, and a step that first touches a new
      2 MiB page in every layer waited ~100 ms for it in a VM (ITL p99, issue 33)."""
    from dataclasses import replace

    from ..config import SchedulerConfig, resolve_device
    kwargs = topology.engine_kwargs
    if resolve_device(kwargs.get("device") or "auto") != "cpu":
        return topology
    chosen: dict[str, Any] = {}
    if kwargs.get("kv_cache_prefault") is None:
        chosen["kv_cache_prefault"] = True
    if kwargs.get("max_num_batched_tokens") is None and kwargs.get("enable_chunked_prefill") is not False:
        seats = kwargs.get("max_num_seqs") or SchedulerConfig.max_num_seqs
        chosen["max_num_batched_tokens"] = max(SERVE_CPU_STEP_TOKENS, seats)
    return replace(topology, engine_kwargs={**kwargs, **chosen}) if chosen else topology


def _client(topology: ServingTopology, device: str, threads: Optional[int], building: Any) -> "EngineClient":
    """One engine on ``device``: an engine-core process, or (``in_process``) a thread of this
    one. ``threads``: torch's thread count (None: its default). Threads of one process share
    one torch thread pool, so the count is set here, once, for all of them, and they build one
    at a time under the lock ``building`` (loading and compiling touch process-wide state:
    Dynamo, the compile cache)."""
    from .client import EngineClient
    from .transports import ProcessTransport, ThreadTransport
    kwargs = {**topology.engine_kwargs, "device": device}
    if topology.in_process:
        if threads is not None:
            import torch
            torch.set_num_threads(threads)

        def build_engine():
            """Runs on the engine thread, so /health answers 503 while this loads and compiles."""
            from ..config import EngineConfig
            from .llm_engine import LLMEngine
            with building if building is not None else contextlib.nullcontext():
                return LLMEngine(EngineConfig.from_kwargs(topology.model, **kwargs))

        return EngineClient(ThreadTransport(build_engine), max_queue_len=topology.max_queue_len)
    from .core_process import CoreProcessConfig
    engine_kwargs = {name: value for name, value in kwargs.items() if name != "passes"}
    config = CoreProcessConfig(model=topology.model, engine_kwargs=engine_kwargs, pass_specs=list(topology.pass_specs),
                               log_level=topology.log_level, num_threads=threads)
    return EngineClient(ProcessTransport(config), max_queue_len=topology.max_queue_len)


def replica_devices(device: str, size: int) -> list[str]:
    """The device of each data-parallel replica: on CUDA one GPU each (``cuda:0`` ..), on CPU
    the CPU for all (they split its threads)."""
    import torch

    from ..config import resolve_device
    device = resolve_device(device)
    if device == "cpu":
        return ["cpu"] * size
    if device != "cuda":
        raise TopologyError(f"--data-parallel-size {size} places replica i on cuda:i; --device {device} names a "
                            "single GPU (use --device cuda)")
    found = torch.cuda.device_count()
    if found < size:
        raise TopologyError(f"--data-parallel-size {size} needs {size} GPUs (one per replica), found {found}")
    return [f"cuda:{index}" for index in range(size)]

