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
stages tp rank 0 of the last stage).

Steps may be in flight (``submit`` now, ``collect`` later, first in first out): the ranks read
their pipes in order, so with pipeline stages stage 0 starts step N + 1 while the last stage
still runs step N. ``execute`` is ``submit`` then ``collect``. Workers are spawned (never forked: a
forked child would share the parent's torch/OpenMP/CUDA state) and always cleaned up: ``close``
asks each to stop, then terminates what is left; it runs at interpreter exit too.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

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
    """A worker (any rank of any stage) died or raised; the executor has stopped every rank."""

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


class MultiprocExecutor:
    """Runs ``config.parallel.world_size`` ranks (T per stage, P stages); stands where a ModelRunner stands
    for the engine (``num_blocks``, ``max_model_len``, ``vocab_size``, ``startup``, ``execute``,
    ``add_lora``, ``remove_lora``)."""

    def __init__(self, config: EngineConfig) -> None:
        if not config.is_resolved:
            raise ValueError("MultiprocExecutor takes a resolved EngineConfig (EngineConfig.resolved)")
        self.world_size = config.parallel.world_size
        self._output_rank = config.parallel.output_rank
        self._failure: Optional[WorkerFailed] = None
        self._closed = False
        # One entry per submitted, uncollected step: whether it went to the ranks (an empty plan
        # does not); and the replies of sent steps read early (before another command), in order.
        self._in_flight: collections.deque[bool] = collections.deque()
        self._answered: collections.deque[ModelRunnerOutput] = collections.deque()
        self._workers = self._spawn(config)
        atexit.register(_close_at_exit, weakref.ref(self))
        try:
            infos: list[WorkerInfo] = self._broadcast(None)
        except WorkerFailed as failure:
            self.close()
            if " died " not in str(failure):  # it reported its own error
                raise
            raise WorkerFailed(failure.rank, f"{failure}{_STARTUP_HINT}") from None
        except BaseException:
            self.close()
            raise
        self.pids = [info.pid for info in infos]
        # Ranks may size their caches differently (CUDA memory): the scheduler uses what all have.
        self.num_blocks = min(info.num_blocks for info in infos)
        self.max_model_len = min(info.max_model_len for info in infos)
        self.vocab_size = infos[0].vocab_size
        self.startup: StartupReport = infos[0].startup
        self.compile_counters = infos[0].compile_counters
        self.compile_cache = None  # lives in the workers: one entry per rank
        self.compile_cache_folders = [info.compile_cache_folder for info in infos]
        par = config.parallel
        logger.info("%s: %d ranks (pids %s), %s backend, %d torch threads each", _kind(par), self.world_size,
                    ", ".join(map(str, self.pids)), par.distributed_backend, threads_per_rank(self.world_size))

    def _spawn(self, config: EngineConfig) -> list[_Worker]:
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        timeout = float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S))
        level = logging.getLogger("vgraph").getEffectiveLevel()
        workers = []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            args = WorkerArgs(config, rank, self.world_size, init_method, threads_per_rank(self.world_size),
                              timeout, level)
            process = ctx.Process(target=worker_main, args=(args, child), name=f"vgraph-rank-{rank}", daemon=True)
            process.start()
            child.close()  # the worker's end lives in the worker: EOF here when it dies
            workers.append(_Worker(rank, process, parent, _place(config, rank)))
        return workers

    # ------------------------------------------------------------------ the engine's calls

    def execute(self, plan: StepPlan, grammar_masks: Optional[GrammarMasks] = None) -> ModelRunnerOutput:
        """Runs one step with nothing else in flight; returns the output rank's result."""
        if self._in_flight:
            raise RuntimeError("execute() while steps are in flight: collect() them first")
        self.submit(plan, grammar_masks)
        return self.collect()

    def submit(self, plan: StepPlan, grammar_masks: Optional[GrammarMasks] = None) -> None:
        """Sends the step to every rank without waiting for it; ``collect`` returns its result."""
        self._check_running()
        if plan.chunks:
            self._guarded(self._send, (STEP, (plan, grammar_masks)))
        self._in_flight.append(bool(plan.chunks))

    def collect(self) -> ModelRunnerOutput:
        """The result of the oldest submitted step, waiting for it."""
        if not self._in_flight:
            raise RuntimeError("collect() without a submitted step")
        sent = self._in_flight.popleft()
        if not sent:
            return ModelRunnerOutput({}, None)
        if self._answered:
            return self._answered.popleft()
        self._check_running()
        return self._guarded(self._replies)[self._output_rank]

    @property
    def num_in_flight(self) -> int:
        """Submitted steps not collected yet."""
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
        """Stops every worker (idempotent): asks them to finish, then terminates the rest."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            for w in self._workers:
                with contextlib.suppress(OSError):  # a rank already gone: its sentinel says the rest
                    w.conn.send((SHUTDOWN, None))
            deadline = time.monotonic() + _GRACE_S
            for w in self._workers:
                w.process.join(max(0.0, deadline - time.monotonic()))
        _stop(self._workers)

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ the pipes

    def _check_running(self) -> None:
        if self._failure is not None:
            raise WorkerFailed(self._failure.rank, f"the multiprocessing executor has stopped: {self._failure}")
        if self._closed:
            raise RuntimeError("the multiprocessing executor is closed")

    def _broadcast(self, command: Optional[tuple[str, Any]]) -> list[Any]:
        """Sends ``command`` to every rank (None: nothing, wait for the startup report) and
        returns every rank's reply, by rank. Replies of steps still in flight are read first
        and kept for ``collect``. Any rank dying or failing first stops them all."""
        self._read_in_flight()
        if command is not None:
            self._guarded(self._send, command)
        return self._guarded(self._replies)

    def _read_in_flight(self) -> None:
        for _ in range(sum(self._in_flight) - len(self._answered)):
            self._answered.append(self._guarded(self._replies)[self._output_rank])

    def _send(self, command: tuple[str, Any]) -> None:
        for w in self._workers:
            w.conn.send(command)

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; a rank that died or failed meanwhile stops them all and is named."""
        try:
            return fn(*args)
        except WorkerFailed as failure:
            self._fail(failure)
            raise
        except (BrokenPipeError, ConnectionResetError, EOFError):
            failure = self._find_dead() or WorkerFailed(-1, "a worker's pipe closed")
            self._fail(failure)
            raise failure from None

    def _replies(self) -> list[Any]:
        pending = {w.conn: w for w in self._workers}
        replies: list[Any] = [None] * self.world_size
        while pending:
            sentinels = {w.process.sentinel: w for w in pending.values()}
            for ready in wait([*pending, *sentinels]):
                if ready in pending:
                    worker = pending.pop(ready)
                    replies[worker.rank] = self._receive(worker)
                elif ready in sentinels and sentinels[ready].conn in pending and not sentinels[ready].conn.poll():
                    raise _died(sentinels[ready])
        return replies

    def _receive(self, worker: _Worker) -> Any:
        try:
            status, payload = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(_GRACE_S)
            raise _died(worker) from None
        if status == "error":
            dead = self._dead_without_word(worker)
            if dead is not None:  # the cause: a neighbouring stage's send/recv failed because it is gone
                raise _died(dead)
            raise WorkerFailed(worker.rank, f"worker rank {worker.rank} (pid {worker.process.pid}){worker.place} "
                                            f"failed; the engine stopped every rank.\n{payload}")
        return payload

    def _dead_without_word(self, reporter: _Worker) -> Optional[_Worker]:
        """Another worker killed by a signal (it could not say why), if any: a worker that fails
        by itself reports, then exits with code 1."""
        for w in self._workers:
            if w is not reporter and not w.process.is_alive() and (w.process.exitcode or 0) < 0:
                return w
        return None

    def _find_dead(self) -> Optional[WorkerFailed]:
        for w in self._workers:
            w.process.join(0.5)
            if not w.process.is_alive():
                return _died(w)
        return None

    def _fail(self, failure: WorkerFailed) -> None:
        self._failure = failure
        logger.error("%s", failure)
        self._closed = True
        _stop(self._workers)


def _died(worker: _Worker) -> WorkerFailed:
    worker.process.join(_GRACE_S)  # reaped, so that its exit code is known
    code = worker.process.exitcode
    how = f"exit code {code}"
    if code is not None and code < 0:
        how = f"signal {signal.Signals(-code).name}"
    return WorkerFailed(worker.rank, f"worker rank {worker.rank} (pid {worker.process.pid}) died ({how})"
                                     f"{worker.place}; the engine stopped every rank")


def _kind(par: Any) -> str:
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


def _close_at_exit(ref: "weakref.ref[MultiprocExecutor]") -> None:
    executor = ref()
    if executor is not None:
        executor.close()
