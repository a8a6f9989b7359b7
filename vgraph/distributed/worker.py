"""One tensor-parallel rank: a spawned process that joins the group, builds its ModelRunner over
its shard and KV cache, then runs whatever the engine sends, step by step.

The conversation over the pipe is request/reply, in order: the worker reads one command, runs it
and replies before it reads the next, so when the engine keeps several steps in flight
(``submit`` before the previous ``collect``) the replies come back in the order sent. Replies are ``("ok", payload)`` or, when anything fails, ``("error", traceback)`` and
the process exits. Rank 0 replies with the step's result; the others with None (their sampled
tokens equal rank 0's: the logits are the same after the gather).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
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
    world_size: int
    init_method: str
    threads: int
    collective_timeout_s: float
    log_level: int
    # This rank's CUDA device on its node: None is the rank itself (one node, rank r on cuda:r);
    # a Ray actor sees only its own GPU, as cuda:0.
    device_index: Optional[int] = None


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


def worker_device(config: EngineConfig, rank: int, device_index: Optional[int] = None) -> torch.device:
    """Rank r runs on ``cuda:r`` (the local rank: one machine) unless told its device on its
    node (``device_index``), or on the CPU."""
    if config.torch_device.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", rank if device_index is None else device_index)


def worker_main(args: WorkerArgs, conn: Connection) -> None:
    """The process's entry point (spawned: nothing is inherited but these arguments)."""
    sys.exit(run_rank(args, conn))


def run_rank(args: WorkerArgs, conn: Connection) -> int:
    """Serves the engine over ``conn`` (a pipe, or a TCP connection to a Ray actor) until it
    says SHUTDOWN (0) or anything fails (1: reported over ``conn`` when the engine can hear)."""
    code = 0
    try:
        _serve(args, conn)
    except EOFError:  # the engine is gone: nothing to report to
        code = 1
    except BaseException:  # noqa: BLE001  (everything is reported to the engine, then the rank ends)
        code = 1
        with contextlib.suppress(OSError):  # the engine is gone: nobody to tell
            conn.send(("error", f"rank {args.rank}: {traceback.format_exc()}"))
    finally:
        # A broken group cannot be left cleanly; the rank ends anyway.
        with contextlib.suppress(Exception):
            destroy_tensor_parallel()
        conn.close()
    return code


def _serve(args: WorkerArgs, conn: Connection) -> None:
    rank = RankWorker(args)
    replies = _Replies(conn)
    try:
        replies.send(("ok", rank.info()))
        while True:
            command, payload = conn.recv()
            replies.send(("ok", rank.handle(command, payload)))
            if command == SHUTDOWN:
                return
    finally:
        replies.close()


class _Replies:
    """Sends the rank's replies from a thread of their own, in order, while the rank reads on.

    With steps in flight the engine may be writing the next step while this rank writes the
    previous reply: were both larger than the connection's buffer and both sides blocked in
    ``send``, neither would read. Here the rank's reading never waits on its writing."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vgraph-rank-replies")
        self._last: Optional[Future] = None

    def send(self, message: Any) -> None:
        if self._last is not None and self._last.done():
            self._last.result()  # a failed send (the engine is gone) ends the rank now
        self._last = self._pool.submit(self._conn.send, message)

    def close(self) -> None:
        """Waits for the queued replies (their errors are the engine's absence: the rank ends)."""
        self._pool.shutdown(wait=True)


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
        device = worker_device(args.config, args.rank, args.device_index)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        config = replace(args.config, device=str(device))
        init_tensor_parallel(args.rank, args.world_size, args.init_method, config.parallel.distributed_backend,
                             args.collective_timeout_s, device)
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
