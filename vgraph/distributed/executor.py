"""The multiprocessing executor: tensor and pipeline parallelism over T x P spawned worker processes.

Design: every rank, rank 0 included, is its own process, and the engine process holds no model.
Why not rank 0 inside the engine: a rank blocked in a collective cannot notice that another rank
died (gloo and NCCL wait until their timeout), and the engine must. Here the engine only ever
waits on pipes, together with every worker's process sentinel, so a worker that dies at any
moment (startup, a step, a collective) is seen at once: the engine names the rank, kills the
others (they may be stuck in a collective with the dead one) and raises ``WorkerFailed``; the
executor then refuses every later step. It costs one pickled message per rank per step: the
scheduler's plan (core/step_plan.py), which carries only what changed since the last step.

The scheduler runs once, in the engine; each step is broadcast to all ranks, which build the
same batch and run the same forward (their all-reduces meet in the middle) and the same sampler
on the same gathered logits; the output rank's result is the step's (rank 0, or with pipeline
stages tp rank 0 of the last stage, whose stage 0 starts step N + 1 while the last stage still
runs step N: the ranks read their connections in order). Workers are spawned (never forked: a
forked child would share the parent's torch/OpenMP/CUDA state) and always cleaned up: ``close``
asks each to stop, then terminates what is left; it runs at interpreter exit too.

``RankExecutor`` is the engine's side of that protocol, shared with the Ray executor
(ray_executor.py), whose ranks are actors on other machines reached over TCP; it also lets the
engine keep several steps in flight (``submit`` now, ``collect`` the oldest result later).
"""
from __future__ import annotations

import abc
import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

from ..config import EngineConfig
from ..core.outputs import ModelRunnerOutput
from ..core.step_plan import StepPlan
from ..structured.bitmask import GrammarMasks
from ..worker.startup import StartupReport
from .worker import ADD_LORA, COUNTERS, REMOVE_LORA, SHUTDOWN, STEP, WorkerArgs, WorkerInfo, worker_main

logger = logging.getLogger("vgraph")

# Seconds a collective may wait for the other ranks before it fails (torch.distributed's timeout):
# long enough for one rank compiling while another loads from the cache.
COLLECTIVE_TIMEOUT_ENV = "VGRAPH_TP_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
_GRACE_S = 5.0  # how long close() lets a worker stop by itself before terminating it


# Workers are spawned: each re-imports the script that started the engine. A script that builds
# the LLM at import time, unguarded, makes every worker die at once before it can say why.
_STARTUP_HINT = ("\nWorkers are spawned processes that import your main module again: a script that "
                 "creates the LLM at top level must do it under `if __name__ == \"__main__\":`.")


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or raised; the executor has stopped every rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class _Worker:
    rank: int
    process: Any  # multiprocessing.Process (spawn context)
    conn: Connection
    place: str = ""  # where it is, for messages: its pipeline stage and tp rank when there are stages


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(world_size: int) -> int:
    """torch threads each worker uses: the machine's cores shared evenly (at least one)."""
    return max(1, (os.cpu_count() or 1) // world_size)


class RankExecutor(abc.ABC):
    """The engine's side of the ranks, whatever starts them: one duplex connection per rank (a
    pipe to a local process, a TCP connection to a Ray actor), over which every rank runs the
    same loop (worker.run_rank). Stands where a ModelRunner stands for the engine
    (``num_blocks``, ``max_model_len``, ``vocab_size``, ``startup``, ``execute``, ``submit`` /
    ``collect``, ``add_lora``, ``remove_lora``, ``close``).

    A subclass starts the ranks, sets ``_conns`` (by rank) and calls ``_start``; it says how to
    wait for replies while watching for dead ranks (``_wait``), how to name a rank and tell how
    it died, and how to stop every rank."""

    def __init__(self, config: EngineConfig) -> None:
        if not config.is_resolved:
            raise ValueError(f"{type(self).__name__} takes a resolved EngineConfig (EngineConfig.resolved)")
        self.world_size = config.parallel.world_size
        self._output_rank = config.parallel.output_rank
        self._failure: Optional[WorkerFailed] = None
        self._closed = False
        self._conns: list[Connection] = []
        # One entry per submitted step, oldest first: its result, or None while its replies are
        # still in the connections.
        self._in_flight: deque[Optional[ModelRunnerOutput]] = deque()
        # What the ranks report once ready (``_start``).
        self.pids: list[int] = []
        self.num_blocks = 0
        self.max_model_len = 0
        self.vocab_size = 0
        self.startup: Optional[StartupReport] = None
        self.compile_counters: Any = None
        self.compile_cache = None  # lives in the workers: one entry per rank
        self.compile_cache_folders: list[Optional[str]] = []

    def _start(self, startup_hint: str = "") -> None:
        """Waits for every rank's report (closing everything if any fails) and takes it in."""
        atexit.register(_close_at_exit, weakref.ref(self))
        try:
            infos: list[WorkerInfo] = self._gather()
        except WorkerFailed as failure:
            self.close()
            if " died " not in str(failure) or not startup_hint:  # it reported its own error
                raise
            raise WorkerFailed(failure.rank, f"{failure}{startup_hint}") from None
        except BaseException:
            self.close()
            raise
        self.pids = [info.pid for info in infos]
        # Ranks may size their caches differently (CUDA memory): the scheduler uses what all have.
        self.num_blocks = min(info.num_blocks for info in infos)
        self.max_model_len = min(info.max_model_len for info in infos)
        self.vocab_size = infos[0].vocab_size
        self.startup = infos[0].startup
        self.compile_counters = infos[0].compile_counters
        self.compile_cache_folders = [info.compile_cache_folder for info in infos]

    # ------------------------------------------------------------------ the engine's calls

    def execute(self, plan: StepPlan, grammar_masks: Optional[GrammarMasks] = None) -> ModelRunnerOutput:
        """Broadcasts the step; returns the output rank's result."""
        self.submit(plan, grammar_masks)
        return self.collect()

    def submit(self, plan: StepPlan, grammar_masks: Optional[GrammarMasks] = None) -> None:
        """Sends the step to every rank and returns at once: the engine may schedule the next
        step while this one runs. Each rank answers its connection in order, so ``collect``
        returns the steps' results in the order submitted. A step sent while a rank still runs
        the previous one waits in the connection's buffer; a plan larger than that buffer makes
        this call wait until the rank reads it (after it has sent its previous reply)."""
        if not plan.chunks:
            self._in_flight.append(ModelRunnerOutput({}, None))
            return
        self._check_running()
        self._send((STEP, (plan, grammar_masks)))
        self._in_flight.append(None)  # its replies are still in the connections

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's result (waits for it)."""
        if not self._in_flight:
            raise RuntimeError("collect() without a submitted step")
        done = self._in_flight.popleft()
        if done is not None:
            return done
        self._check_running()
        return self._gather()[self._output_rank]

    @property
    def steps_in_flight(self) -> int:
        return len(self._in_flight)

    def add_lora(self, lora: Any) -> None:
        """Every rank reads and checks the adapter (each keeps its shard); a bad adapter raises
        ValueError with the first rank's reason, and every rank serves on."""
        self._check_running()
        refusals = [r for r in self._broadcast((ADD_LORA, lora)) if r is not None]
        if refusals:
            raise ValueError(refusals[0])

    def remove_lora(self, lora_int_id: int) -> bool:
        self._check_running()
        return any(self._broadcast((REMOVE_LORA, lora_int_id)))

    def collect_compile_counters(self) -> list[Any]:
        """Every rank's CompileCounters now (None per rank when eager): recompiles are per rank."""
        self._check_running()
        return self._broadcast((COUNTERS, None))

    def close(self) -> None:
        """Stops every rank (idempotent): asks them to finish, then stops what is left."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a rank already gone: the stop says the rest
                    conn.send((SHUTDOWN, None))
            self._wait_stopped(_GRACE_S)
        self._stop_ranks()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ what a subclass says

    @abc.abstractmethod
    def _wait(self, pending: list[Connection]) -> list[Connection]:
        """The connections among ``pending`` with a reply (or EOF) to read; raises
        ``WorkerFailed`` for a rank that died with its reply pending."""

    @abc.abstractmethod
    def _died(self, rank: int) -> WorkerFailed:
        """The failure of a rank whose connection closed (it died)."""

    @abc.abstractmethod
    def _find_dead(self) -> Optional[WorkerFailed]:
        """A rank that is no longer running, if any (after a connection broke)."""

    @abc.abstractmethod
    def _label(self, rank: int) -> str:
        """How errors name a rank, e.g. "tensor-parallel worker rank 1 (pid 42)"."""

    @abc.abstractmethod
    def _wait_stopped(self, timeout: float) -> None:
        """Lets the ranks that were told SHUTDOWN finish, for at most ``timeout`` seconds."""

    @abc.abstractmethod
    def _stop_ranks(self) -> None:
        """Stops every rank still running and releases what the executor holds (idempotent)."""

    # ------------------------------------------------------------------ the connections

    def _check_running(self) -> None:
        if self._failure is not None:
            raise WorkerFailed(self._failure.rank, f"the tensor-parallel executor has stopped: {self._failure}")
        if self._closed:
            raise RuntimeError("the tensor-parallel executor is closed")

    def _broadcast(self, command: tuple[str, Any]) -> list[Any]:
        """Sends ``command`` to every rank and returns every rank's reply, by rank. Steps still
        in flight are received first (kept for ``collect``): their replies are ahead of this
        one in the connections."""
        self._finish_in_flight()
        self._send(command)
        return self._gather()

    def _finish_in_flight(self) -> None:
        for i in range(len(self._in_flight)):
            if self._in_flight[i] is None:
                self._in_flight[i] = self._gather()[self._output_rank]

    def _send(self, command: tuple[str, Any]) -> None:
        self._guarded(lambda: [conn.send(command) for conn in self._conns])

    def _gather(self) -> list[Any]:
        """Every rank's next reply, by rank. Any rank dying or failing first stops them all."""
        return self._guarded(self._replies)

    def _guarded(self, io: Callable[[], Any]) -> Any:
        """Runs connection I/O; a dead or failed rank becomes ``WorkerFailed`` and stops every rank."""
        try:
            return io()
        except WorkerFailed as failure:
            self._fail(failure)
            raise
        except (BrokenPipeError, ConnectionResetError, EOFError):
            failure = self._find_dead() or WorkerFailed(-1, "a tensor-parallel worker's connection closed")
            self._fail(failure)
            raise failure from None

    def _replies(self) -> list[Any]:
        rank_of = {conn: rank for rank, conn in enumerate(self._conns)}
        pending = list(self._conns)
        replies: list[Any] = [None] * self.world_size
        while pending:
            for ready in self._wait(pending):
                pending.remove(ready)
                replies[rank_of[ready]] = self._receive(rank_of[ready])
        return replies

    def _receive(self, rank: int) -> Any:
        try:
            status, payload = self._conns[rank].recv()
        except (EOFError, OSError):
            raise self._died(rank) from None
        if status == "error":
            killed = self._killed_other(rank)
            if killed is not None:  # the cause: a neighbouring stage's send/recv failed because it is gone
                raise killed
            raise WorkerFailed(rank, f"{self._label(rank)} failed; the engine stopped every rank.\n{payload}")
        return payload

    def _killed_other(self, reporter: int) -> Optional[WorkerFailed]:
        """The failure of another rank killed by a signal (it could not say why), if the
        executor can tell: a pipeline stage's error is then only the consequence."""
        return None

    def _fail(self, failure: WorkerFailed) -> None:
        self._failure = failure
        logger.error("%s", failure)
        self._closed = True
        self._stop_ranks()


class MultiprocExecutor(RankExecutor):
    """Runs ``config.parallel.world_size`` ranks as spawned processes on this machine; a rank's
    death is seen on its process sentinel, waited on together with the pipes."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._workers = self._spawn(config)
        self._conns = [w.conn for w in self._workers]
        self._start(_STARTUP_HINT)
        logger.info("%s: %d ranks (pids %s), %s backend, %d torch threads each", parallelism_kind(config.parallel),
                    self.world_size, ", ".join(map(str, self.pids)), config.parallel.distributed_backend,
                    threads_per_rank(self.world_size))

    def _spawn(self, config: EngineConfig) -> list[_Worker]:
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        timeout = collective_timeout_s()
        level = logging.getLogger("vgraph").getEffectiveLevel()
        workers = []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            args = WorkerArgs(config, rank, self.world_size, init_method, threads_per_rank(self.world_size),
                              timeout, level)
            process = ctx.Process(target=worker_main, args=(args, child), name=f"vgraph-tp-rank-{rank}", daemon=True)
            process.start()
            child.close()  # the worker's end lives in the worker: EOF here when it dies
            workers.append(_Worker(rank, process, parent, _place(config, rank)))
        return workers

    def _wait(self, pending: list[Connection]) -> list[Connection]:
        by_sentinel = {self._workers[self._conns.index(c)].process.sentinel: c for c in pending}
        ready = wait([*pending, *by_sentinel])
        for sentinel, conn in by_sentinel.items():
            if sentinel in ready and conn not in ready and not conn.poll():
                raise self._died(self._conns.index(conn))
        return [r for r in ready if r in pending]

    def _died(self, rank: int) -> WorkerFailed:
        # A rank that exited because a neighbouring stage was killed (its send/recv broke) is
        # only the consequence: the killed one is named.
        return self._killed_other(rank) or _died(self._workers[rank])

    def _find_dead(self) -> Optional[WorkerFailed]:
        for w in self._workers:
            w.process.join(0.5)
            if not w.process.is_alive():
                return self._died(w.rank)  # a killed rank first: the others may have died of it
        return None

    def _label(self, rank: int) -> str:
        worker = self._workers[rank]
        return f"tensor-parallel worker rank {rank} (pid {worker.process.pid}){worker.place}"

    def _killed_other(self, reporter: int) -> Optional[WorkerFailed]:
        for w in self._workers:  # one that fails by itself reports, then exits with code 1
            if w.rank != reporter and not w.process.is_alive() and (w.process.exitcode or 0) < 0:
                return _died(w)
        return None

    def _wait_stopped(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))

    def _stop_ranks(self) -> None:
        _stop(self._workers)


def collective_timeout_s() -> float:
    """Seconds a collective may wait for the other ranks ($VGRAPH_TP_COLLECTIVE_TIMEOUT_S)."""
    return float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S))


def _died(worker: _Worker) -> WorkerFailed:
    worker.process.join(_GRACE_S)  # reaped, so that its exit code is known
    code = worker.process.exitcode
    how = f"exit code {code}"
    if code is not None and code < 0:
        how = f"signal {signal.Signals(-code).name}"
    return WorkerFailed(worker.rank, f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) died "
                                     f"({how}){worker.place}; the engine stopped every rank")


def parallelism_kind(par: Any) -> str:
    """The parallelism, as the startup line names it."""
    t, p = par.tensor_parallel_size, par.pipeline_parallel_size
    if p == 1:
        return "tensor parallelism"
    if t == 1:
        return f"pipeline parallelism ({p} stages)"
    return f"tensor x pipeline parallelism ({t} ranks x {p} stages)"


def _place(config: EngineConfig, rank: int) -> str:
    """``, pipeline stage s of P, tp rank t`` with stages; empty without."""
    par = config.parallel
    if par.pipeline_parallel_size == 1:
        return ""
    stage, tp_rank = divmod(rank, par.tensor_parallel_size)
    return f", pipeline stage {stage} of {par.pipeline_parallel_size}, tp rank {tp_rank}"


def _stop(workers: list[_Worker]) -> None:
    """Terminates (then kills) every worker still running, and reaps them all."""
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
    for w in workers:
        w.process.join(_GRACE_S)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()


def _close_at_exit(ref: "weakref.ref[RankExecutor]") -> None:
    executor = ref()
    if executor is not None:
        executor.close()
