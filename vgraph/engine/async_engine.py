"""``AsyncEngine``: an ``LLMEngine`` driven from asyncio, for the HTTP server.

Why a dedicated thread: ``LLMEngine.step()`` is blocking work (a scheduler pass plus a model
forward). Run on the event loop it would freeze every connection for the length of a step;
run in a thread it overlaps with HTTP handling, because torch releases the GIL inside its
kernels. The engine is built *and* stepped on that one thread, and every other thread talks to
it only through a command queue (add, abort, stop), so the engine itself needs no locks and
thread-local torch state (inference mode, compiled-graph guards) stays on one thread.

Outputs travel back with one ``loop.call_soon_threadsafe`` per step. Each caller holds an
``OutputCollector`` that keeps only the *latest* cumulative ``RequestOutput`` per request:
``RequestOutput`` carries the whole text, token ids and logprobs so far, so a slow consumer
skips intermediate snapshots instead of queueing them, and memory per request stays bounded.

What the metrics need (time to first token, inter-token latency, queue time, end-to-end
latency, token counts, the engine's state) comes from the engine itself: each ``StepOutput``
carries the step's ``RequestTiming``s and ``EngineStats``, and this class hands it to
``on_step`` as it is. Requests enter the engine with the time they were submitted here, so
their latencies include the wait for the engine thread.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Sequence

from ..sampling_params import SamplingParams
from .inputs import InputError, PromptType
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .stats import EngineStats, RequestTiming, StepOutput

logger = logging.getLogger("vgraph")


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can be served any more."""


class EngineShutdownError(EngineDeadError):
    """The server stopped the engine (the shutdown deadline passed) with requests in flight:
    not a failure of theirs, so clients get 503 ``shutting_down``, as ``/health`` says."""


class EngineProcessDiedError(EngineDeadError):
    """The engine-core process exited without being asked to (killed, crashed): the server
    cannot serve any more, so clients get 503 ``engine_dead``, as ``/health`` says."""


class EngineNotReadyError(RuntimeError):
    """The engine is still loading (or compiling) the model."""


class QueueFullError(RuntimeError):
    """More sequences are waiting than ``max_queue_len`` allows; the caller should retry later."""


class RequestTooLargeError(ValueError):
    """A submission has more sequences than ``max_queue_len``: it could never be admitted, so
    retrying is pointless (a ``ValueError``: the caller's input is what must change)."""


class OutputCollector:
    """The latest output of each of a caller's requests, and a way to wait for new ones.

    Lives on the event loop: the engine thread only reaches it through
    ``call_soon_threadsafe``. One collector may hold several requests (a batch of prompts),
    so a handler waits on one event for all of them.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = list(request_ids)
        self._pending: dict[str, RequestOutput] = {}
        self._unfinished = set(self.request_ids)
        self._event = asyncio.Event()
        self._error: Optional[BaseException] = None

    @property
    def finished(self) -> bool:
        return not self._unfinished and not self._pending

    def _put(self, output: RequestOutput) -> None:
        self._pending[output.request_id] = output
        if output.finished:
            self._unfinished.discard(output.request_id)
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def next(self) -> dict[str, RequestOutput]:
        """Waits for news; returns the latest output of each request that advanced since."""
        while not self._pending and self._error is None:
            if not self._unfinished:
                return {}
            await self._event.wait()
            self._event.clear()
        if self._error is not None:
            raise self._error
        batch, self._pending = self._pending, {}
        return batch


@dataclass
class _Add:
    items: list[tuple[str, PromptType, SamplingParams]]
    collector: OutputCollector
    accepted: asyncio.Future
    submitted: float


@dataclass
class _Abort:
    request_ids: list[str]


class _Stop:
    """Tells the engine thread to return: what is still running is aborted in the engine."""


class StreamingFront:
    """``generate`` for every engine front the server uses (this thread's ``AsyncEngine``, the
    engine-core client, the data-parallel router): one streaming loop over the front's own
    ``add_requests`` and ``abort``, so the three cannot drift apart."""

    async def generate(self, request_id: str, prompt: PromptType,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs of one request until it finishes; leaving early aborts it."""
        collector = await self.add_requests([(request_id, prompt, params)])
        try:
            while not collector.finished:
                for output in (await collector.next()).values():
                    yield output
        finally:
            if not collector.finished:
                self.abort([request_id])


def check_admission(error: Optional[BaseException], stopped: bool, ready: bool, max_queue_len: Optional[int],
                    queue_length: int, sequences: int) -> None:
    """Why a front refuses a submission of ``sequences`` sequences, as the exception the server
    maps to its status: a dead or stopped engine, one still loading, a request that could never
    fit ``max_queue_len``, or a queue that is full now."""
    if error is not None:
        raise EngineDeadError(f"the engine has failed: {error}")
    if stopped:
        raise EngineDeadError("the engine is stopped")
    if not ready:
        raise EngineNotReadyError("the model is still loading")
    limit = max_queue_len
    if limit is not None and sequences > limit:
        raise RequestTooLargeError(f"this request has {sequences} sequences (prompts x n) but at most {limit} "
                                   f"may wait (--max-queue-len {limit}), so it could never be admitted; "
                                   "send fewer prompts or a smaller n")
    if limit is not None and queue_length + sequences > limit:
        raise QueueFullError(f"{queue_length} sequences are already waiting and this request adds "
                             f"{sequences} (--max-queue-len {limit} counts prompts x n)")


@dataclass(eq=False)
class _Submission:
    """One submission between its booking and the engine's answer (see ``OneEngineFront._admit``)."""

    sequences: int
    accepted: asyncio.Future
    booked_at: float


# A submission the engine has not answered in this long, while it is alive and ready, means the
# admission bookkeeping is stuck: /health reports it (the engine answers adds between steps).
STALLED_ADMISSION_S = 60.0


class OneEngineFront(StreamingFront):
    """What the two fronts of one engine share (the engine on a thread, ``AsyncEngine``; in its
    own process, ``EngineCoreClient``): readiness, admission and the queue length it counts, and
    handing a step's outputs to the callers waiting for them. Subclasses set ``_ready``,
    ``error``, ``stats``, ``_in_flight``, ``_collectors`` and ``on_step`` in ``__init__``, and
    implement ``_check_accepting``, ``abort`` and ``_forget``."""

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    async def wait_ready(self) -> None:
        """Returns once the engine can take requests; raises the startup error if it failed."""
        await self._ready.wait()
        if self.error is not None:
            raise self.error

    @property
    def queue_length(self) -> int:
        """Sequences submitted but not yet running: the last waiting count plus the submissions
        the engine has not answered yet."""
        return self.stats.num_waiting + sum(s.sequences for s in self._in_flight)

    def admission_stall(self, now: Optional[float] = None) -> Optional[str]:
        """Why admission looks stuck (a submission unanswered for ``STALLED_ADMISSION_S`` by a
        live, ready engine), or None; ``/health`` reports it."""
        if self.error is not None or not self._ready.is_set() or not self._in_flight:
            return None
        oldest = min(s.booked_at for s in self._in_flight)
        waited = (time.monotonic() if now is None else now) - oldest
        if waited < STALLED_ADMISSION_S:
            return None
        return f"{len(self._in_flight)} submission(s) have waited {waited:.0f} s for the engine to accept them"

    async def _admit(self, items: Sequence[tuple[str, PromptType, SamplingParams]],
                     send: Callable[[OutputCollector, asyncio.Future], None]) -> OutputCollector:
        """Submits requests atomically: all are accepted, or none is and the error is raised.

        The one place where admission is booked: the submission counts in ``queue_length`` from
        here until the engine answers, and the booking is released however this ends (accepted,
        refused, ``send`` raising, the engine dying, the caller cancelled), so no failure can
        leave the server counting sequences that no engine holds. ``send`` hands the items to
        the engine, which resolves the future when it has added them (or refused them).
        """
        sequences = _num_sequences(items)
        self._check_accepting(sequences)
        collector = OutputCollector([rid for rid, _, _ in items])
        for rid in collector.request_ids:
            if rid in self._collectors:
                raise ValueError(f"request id {rid!r} is already in use")
        submission = _Submission(sequences, asyncio.get_running_loop().create_future(), time.monotonic())
        self._in_flight.add(submission)
        try:
            for rid in collector.request_ids:
                self._collectors[rid] = collector
            send(collector, submission.accepted)
            await asyncio.shield(submission.accepted)
        except asyncio.CancelledError:
            self.abort(collector.request_ids)
            raise
        except BaseException:
            self._forget(collector.request_ids)
            raise
        finally:
            self._in_flight.discard(submission)
        return collector

    def _fail_submissions(self, error: EngineDeadError) -> None:
        """Wakes every caller waiting for the engine to accept its submission with ``error``."""
        for submission in self._in_flight:
            if not submission.accepted.done():
                submission.accepted.set_exception(error)

    def _deliver(self, step: StepOutput) -> None:
        """Called on the event loop with each step: every output to its collector, then the
        stats and ``on_step`` (the metrics)."""
        for output in step.outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector._put(output)
                if output.finished:
                    del self._collectors[output.request_id]
        self.stats = step.stats
        if self.on_step is not None:
            self.on_step(step)


class AsyncEngine(OneEngineFront):
    """Owns an ``LLMEngine`` on a background thread; requests in and outputs out via asyncio.

    ``engine_factory`` builds the engine (loading, and compiling unless eager) on the engine
    thread. ``max_queue_len`` bounds the sequences waiting to be scheduled (``None``: no bound):
    sequences, not requests, because that is what waits in the scheduler and costs memory, and
    one request of 8 prompts with n=4 is 32 of them.
    ``on_step`` receives each engine step's ``StepOutput`` on the event loop, and after a batch
    of commands one with no outputs (the aborted requests' timings, the stats after the adds);
    ``on_fatal`` is called once on the event loop when the engine fails (at startup or later).
    """

    def __init__(self, engine_factory: Callable[[], LLMEngine], *, max_queue_len: Optional[int] = None,
                 on_step: Optional[Callable[[StepOutput], None]] = None,
                 on_fatal: Optional[Callable[[BaseException], None]] = None) -> None:
        if max_queue_len is not None and max_queue_len < 1:
            raise ValueError(f"max_queue_len must be at least 1, got {max_queue_len}")
        self._factory = engine_factory
        self.max_queue_len = max_queue_len
        self.on_step = on_step
        self.on_fatal = on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._collectors: dict[str, OutputCollector] = {}
        self._in_flight: set[_Submission] = set()  # submissions the engine thread has not answered
        self._traced: set[type] = set()  # exception types whose traceback was logged (engine thread)
        self._ready = asyncio.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stopped = threading.Event()
        self.error: Optional[BaseException] = None  # why the engine died (at startup or later)
        self.startup_error: Optional[BaseException] = None  # set when building the engine failed
        self.stats = EngineStats()  # the newest snapshot, updated on the event loop after each step
        # Set once ready: read-only facts about the engine, safe to use from the event loop.
        self.tokenizer: Any = None  # a private copy: Rust tokenizers must not be shared across threads
        self.worker_tokenizer: Any = None  # another, for one worker thread of the caller's (large inputs)
        self.max_model_len = 0
        self.vocab_size = 0
        self.model_path = ""
        self.max_logprobs = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self.grammar_compiler: Any = None  # thread-safe: the server validates grammars with it

    # ------------------------------------------------------------------ lifecycle (event loop)

    def start(self) -> None:
        """Starts the engine thread; ``wait_ready`` tells when the engine is built."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="vgraph-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts whatever is left and stops the thread (a step in flight finishes first)."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.1f s", timeout)
        self._fail_all(EngineShutdownError("the server is shutting down"))

    def _fail_all(self, error: EngineDeadError) -> None:
        """Wakes every waiting caller with ``error``: the engine will not answer them any more."""
        for collector in set(self._collectors.values()):
            collector._fail(error)
        self._collectors.clear()
        self._fail_submissions(error)

    # ------------------------------------------------------------------ requests (event loop)

    async def add_requests(self, items: Sequence[tuple[str, PromptType, SamplingParams]]) -> OutputCollector:
        """Submits requests atomically: all are accepted, or none is and the error is raised.

        Raises ``ValueError`` for bad input (from ``LLMEngine.add_request``; its subclass
        ``RequestTooLargeError`` when the items have more sequences than ``max_queue_len``),
        ``QueueFullError``, ``EngineNotReadyError`` or ``EngineDeadError``. Cancelling the caller
        while it waits aborts whatever was accepted.
        """
        submitted = time.monotonic()
        return await self._admit(items, lambda collector, accepted: self._commands.put(
            _Add(list(items), collector, accepted, submitted)))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stops requests and frees their KV blocks; unknown or finished ids are ignored."""
        ids = [rid for rid in request_ids if self._collectors.pop(rid, None) is not None]
        if ids and self._thread is not None and self._thread.is_alive():
            self._commands.put(_Abort(ids))

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._collectors.pop(rid, None)

    def _check_accepting(self, sequences: int) -> None:
        check_admission(self.error, self._stopped.is_set(), self._ready.is_set(), self.max_queue_len,
                        self.queue_length, sequences)

    # ------------------------------------------------------------------ callbacks (event loop)

    def _on_ready(self, facts: dict[str, Any]) -> None:
        for name, value in facts.items():
            setattr(self, name, value)
        self._ready.set()

    def _on_startup_failed(self, error: BaseException) -> None:
        self.error = self.startup_error = error
        self._ready.set()
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _on_accepted(self, command: _Add, error: Optional[BaseException]) -> None:
        if not command.accepted.done():
            if error is None:
                command.accepted.set_result(None)
            else:
                command.accepted.set_exception(error)

    def _on_step(self, step: StepOutput) -> None:
        self._deliver(step)

    def _on_fatal(self, error: BaseException) -> None:
        self.error = error
        self._fail_all(EngineDeadError(f"the engine failed: {type(error).__name__}: {error}"))
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ------------------------------------------------------------------ the engine thread

    def _thread_main(self) -> None:
        try:
            engine = self._factory()
            facts = {"tokenizer": copy.deepcopy(engine.tokenizer), "worker_tokenizer": copy.deepcopy(engine.tokenizer),
                     "max_model_len": engine.max_model_len,
                     "vocab_size": engine.vocab_size, "model_path": engine.config.model.model,
                     "max_logprobs": engine.config.max_logprobs, "eos_token_ids": engine.eos_token_ids,
                     "grammar_compiler": engine.grammar_compiler, "stats": engine.stats()}
        except BaseException as exc:  # reported to the caller, who decides how to exit
            self._stopped.set()
            self._post(self._on_startup_failed, exc)
            return
        self._post(self._on_ready, facts)
        try:
            self._serve(engine)
        except BaseException as exc:
            logger.exception("engine step failed; the engine is dead")
            engine.close()
            self._stopped.set()
            self._post(self._on_fatal, exc)
            return
        engine.close()  # tensor-parallel workers stop with the engine
        self._stopped.set()

    def _serve(self, engine: LLMEngine) -> None:
        """The step loop: take commands (blocking only when idle), step, report."""
        while True:
            idle = not engine.has_unfinished_requests()
            commands = [self._commands.get()] if idle else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            aborted: list[RequestTiming] = []
            for command in commands:
                if isinstance(command, _Stop):
                    engine.abort_all()
                    return
                if isinstance(command, _Add):
                    self._add(engine, command)
                elif isinstance(command, _Abort):
                    aborted.extend(engine.abort_request(command.request_ids))
            if commands:
                self._post(self._on_step, StepOutput([], aborted, engine.stats()))
            if engine.has_unfinished_requests():
                self._post(self._on_step, engine.step())

    def _add(self, engine: LLMEngine, command: _Add) -> None:
        self._post(self._on_accepted, command, add_atomically(engine, command.items, command.submitted, self._traced))


def add_atomically(engine: LLMEngine, items: Sequence[tuple[str, PromptType, SamplingParams]], submitted: float,
                   traced: set[type]) -> Optional[BaseException]:
    """Adds a batch of requests atomically and returns None, or the error that refused them:
    on any failure the ones added are taken back (not counted as aborts: they were never
    accepted). ``traced``: exception types whose traceback was logged already (once per type).
    Shared by the engine thread and the engine-core process."""
    added: list[str] = []
    try:
        for rid, prompt, params in items:
            engine.add_request(rid, prompt, params, arrival_time=submitted)
            added.append(rid)
    except BaseException as exc:  # bad input (ValueError) or an unexpected failure: undo all
        engine.abort_request(added)
        if len(items) > 1 and isinstance(exc, ValueError):
            index = next(i for i, item in enumerate(items) if item[0] not in added)
            exc = exc.for_prompt(index) if isinstance(exc, InputError) else ValueError(f"prompt {index}: {exc}")
        elif not isinstance(exc, ValueError):  # one line per request; the traceback only when debugging
            logger.error("adding request %s failed: %s: %s", items[0][0], type(exc).__name__, exc)
            if type(exc) not in traced:
                traced.add(type(exc))
                logger.debug("adding a request failed (traceback logged once per exception type)", exc_info=exc)
        return exc
    return None


def _num_sequences(items: Sequence[tuple[str, PromptType, SamplingParams]]) -> int:
    """What a submission adds to the scheduler's queue: n sequences per request."""
    return sum(params.n for _, _, params in items)
