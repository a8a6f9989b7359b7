"""One tensor-parallel rank: a spawned process that joins the group, builds its ModelRunner over
its shard and KV cache, then runs whatever the engine sends, step by step.

The conversation over the pipe is in order: one reply per command, in the order the commands
came. The engine may send several steps before it reads their replies (pipeline parallelism
keeps several in flight: stage 0 starts step N + 1 while stage 1 runs step N); everything else
it sends once the steps before are answered. Replies are ``("ok", payload)`` or, when anything
fails, ``("error", traceback)`` and the process exits. The output rank (tp rank 0 of the last
stage) replies with the step's result; the others with None (their sampled tokens equal its
own: the logits are the same after the gather; earlier stages sample nothing).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch

from ..config import EngineConfig
from ..worker.startup import StartupReport
from .state import destroy_tensor_parallel, init_tensor_parallel

logger = logging.getLogger("vgraph")

# Commands the engine sends.
STEP, COUNTERS, SHUTDOWN = "step", "counters", "shutdown"
ADD_LORA, REMOVE_LORA = "add_lora", "remove_lora"


@dataclass(frozen=True)
class WorkerArgs:
    config: EngineConfig  # resolved; the device is this rank's on CUDA
    rank: int
    world_size: int  # every rank of every stage
    init_method: str
    threads: int
    collective_timeout_s: float
    log_level: int


@dataclass(frozen=True)
class WorkerInfo:
    """What a rank reports once it is ready."""

    rank: int
    pid: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    startup: StartupReport
    compile_counters: Optional[Any]  # CompileCounters (None when eager)
    compile_cache_folder: Optional[str]  # this rank's compile cache entry (None when eager or unsaved)


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r runs on ``cuda:r`` (the local rank: one machine), or on the CPU."""
    return torch.device("cuda", rank) if config.torch_device.type == "cuda" else torch.device("cpu")


def worker_main(args: WorkerArgs, conn: Connection) -> None:
    """The process's entry point (spawned: nothing is inherited but these arguments)."""
    code = 0
    try:
        _serve(args, conn)
    except EOFError:  # the engine is gone: nothing to report to
        code = 1
    except BaseException:  # noqa: BLE001  (everything is reported to the engine, then the process ends)
        code = 1
        with contextlib.suppress(OSError):  # the engine is gone: nobody to tell
            conn.send(("error", f"rank {args.rank}: {traceback.format_exc()}"))
    finally:
        # A broken group cannot be left cleanly; the process ends anyway.
        with contextlib.suppress(Exception):
            destroy_tensor_parallel()
        conn.close()
    sys.exit(code)


def _serve(args: WorkerArgs, conn: Connection) -> None:
    rank = RankWorker(args)
    conn.send(("ok", rank.info()))
    while True:
        command, payload = conn.recv()
        conn.send(("ok", rank.handle(command, payload)))
        if command == SHUTDOWN:
            return


class RankWorker:
    """One rank's body, whatever carries its commands: joins the group, builds the rank's
    ModelRunner, and answers each command. The ``mp`` executor's process loops over a pipe
    (``worker_main``); any other executor (an actor on another node) calls the same two methods."""

    def __init__(self, args: WorkerArgs) -> None:
        from ..worker.runner import ModelRunner

        # Only rank 0 tells the startup story; the others speak up for warnings.
        logging.getLogger("vgraph").setLevel(args.log_level if args.rank == 0
                                             else max(args.log_level, logging.WARNING))
        torch.set_num_threads(args.threads)
        device = worker_device(args.config, args.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        config = replace(args.config, device=str(device))
        init_tensor_parallel(args.rank, args.world_size, args.init_method, config.parallel.distributed_backend,
                             args.collective_timeout_s, device, config.parallel.pipeline_parallel_size)
        torch.manual_seed(config.model.seed)
        self.rank = args.rank
        self.is_output_rank = args.rank == config.parallel.output_rank
        self.runner = ModelRunner(config)

    def info(self) -> WorkerInfo:
        runner = self.runner
        return WorkerInfo(self.rank, os.getpid(), runner.num_blocks, runner.max_model_len, runner.vocab_size,
                          runner.startup, runner.compile_counters, _cache_folder(runner))

    def handle(self, command: str, payload: Any) -> Any:
        """The reply to one command (raises on an unknown one)."""
        runner = self.runner
        if command == STEP:
            result = runner.execute(*payload)  # (the scheduler's plan, the grammar masks)
            return result if self.is_output_rank else None
        if command == COUNTERS:
            return runner.compile_counters
        if command == ADD_LORA:
            return _add_lora(runner, payload)
        if command == REMOVE_LORA:
            return runner.remove_lora(payload)
        if command == SHUTDOWN:
            return None
        raise RuntimeError(f"unknown command {command!r} from the engine")


def _add_lora(runner: Any, lora: Any) -> Optional[str]:
    """None once the adapter is in this rank's host cache; else why not (a bad adapter is the
    request's error, never this process's: it replies and serves on)."""
    try:
        runner.add_lora(lora)
    except ValueError as exc:
        return str(exc)
    return None


def _cache_folder(runner: Any) -> Optional[str]:
    cache = runner.compile_cache
    return str(cache.folder) if cache is not None and cache.folder is not None else None
