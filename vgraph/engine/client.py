"""``EngineClient``: the server's one engine client, over either transport.

The engine runs on a thread of the server (``ThreadTransport``) or in the engine-core process
(``ProcessTransport``, ZMQ + the explicit msgpack codec); either way this class does the
client's half once: lifecycle and readiness, admission and the queue length it counts,
tokenizing and checking prompts, aborts, fatal errors, and the one ``OutputProcessor`` that
turns the engine's per-step token deltas into the cumulative ``RequestOutput``s the routes
read (``OutputCollector``). Data parallelism is N of these behind the router (``dp_engine``).

Everything here runs on the server's event loop. A transport calls back on that loop:
``_on_ready``, ``_on_startup_failed``, ``_on_accepted``, ``_on_step`` and ``_on_fatal``.

What the metrics need (time to first token, inter-token latency, queue time, end-to-end
latency, token counts, the engine's state) comes from the engine itself: each step carries
its ``RequestTiming``s and ``EngineStats``, handed to ``on_step`` with the outputs. Requests
enter the engine with the time they were submitted here, so their latencies include the wait
for the engine.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Protocol, Sequence

from ..sampling_params import SamplingParams
from ..lora.request import LoRARequest
from .core_codec import ABORT, ADD, FINISH, LOAD_LORA, UNLOAD_LORA, EngineFacts
from .inputs import PREFILL_ONLY, InputError, PromptType, check_prompt, prompt_to_ids
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .stats import EngineStats, EngineStep, StepOutput

# A submission the engine has not answered in this long, while it is alive and ready, means the
# admission bookkeeping is stuck: /health reports it (the engine answers adds between steps).
STALLED_ADMISSION_S = 60.0

Items = Sequence[tuple[str, PromptType, Any]]


class EngineDeadError(RuntimeError):
    """The engine failed; no request can be served any more."""


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

    Keeps only the *latest* cumulative output per request: a slow consumer skips intermediate
    snapshots instead of queueing them, and memory per request stays bounded. One collector
    may hold several requests (a batch of prompts), so a handler waits on one event for all.
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


class StreamingFront:
    """``generate`` for every engine front the server uses (``EngineClient`` and the
    data-parallel router): one streaming loop over the front's own ``add_requests`` and
    ``abort``, so the two cannot drift apart."""

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


@dataclass(frozen=True)
class Ready:
    """What a transport hands the client once its engine is built."""

    facts: EngineFacts
    tokenizer: Any  # a private copy for the event loop
    grammar_compiler: Any  # thread-safe: the server validates grammars with it


class Transport(Protocol):
    """How commands reach one engine and its news comes back (see ``transports.py``)."""

    def start(self, client: "EngineClient") -> None: ...
    def send(self, command: tuple) -> bool:
        """Hands a command to the engine; False when there is no engine to take it."""
    def alive(self) -> bool: ...
    async def stop(self, timeout: float) -> None: ...


@dataclass(eq=False)
class _Submission:
    """One submission between its booking and the engine's answer (see ``EngineClient._admit``)."""

    sequences: int
    accepted: asyncio.Future
    booked_at: float


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


class EngineClient(StreamingFront):
    """Requests in, outputs out, for one engine behind ``transport``.

    ``max_queue_len`` bounds the sequences waiting to be scheduled (``None``: no bound):
    sequences, not requests, because that is what waits in the scheduler and costs memory, and
    one request of 8 prompts with n=4 is 32 of them. ``on_step`` receives each step's
    ``StepOutput`` (outputs, timings, stats) on the event loop; ``on_fatal`` is called once
    when the engine fails (at startup or later).
    """

    def __init__(self, transport: Transport, *, max_queue_len: Optional[int] = None,
                 on_step: Optional[Callable[[StepOutput], None]] = None,
                 on_fatal: Optional[Callable[[BaseException], None]] = None) -> None:
        if max_queue_len is not None and max_queue_len < 1:
            raise ValueError(f"max_queue_len must be at least 1, got {max_queue_len}")
        self.transport = transport
        self.max_queue_len = max_queue_len
        self.on_step = on_step
        self.on_fatal = on_fatal
        self._collectors: dict[str, OutputCollector] = {}
        self._outputs: Optional[OutputProcessor] = None
        self._in_flight: set[_Submission] = set()  # submissions the engine has not answered
        self._unanswered: dict[int, asyncio.Future] = {}  # batch id -> its acceptance future
        self._batch_ids = itertools.count()
        self._ready = asyncio.Event()
        self._started = False
        self._stopping = False
        self.error: Optional[BaseException] = None  # why the engine died (at startup or later)
        self.startup_error: Optional[BaseException] = None  # set when building the engine failed
        self.stats = EngineStats()  # the newest snapshot, updated after each step
        # Set once ready: read-only facts about the engine, safe to use from the event loop.
        self.tokenizer: Any = None
        self.worker_tokenizer: Any = None  # another copy, for one worker thread of the caller's
        self.grammar_compiler: Any = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.model_path = ""
        self.max_logprobs = 0
        self.eos_token_ids: frozenset[int] = frozenset()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Starts the engine (on its thread or in its process); ``wait_ready`` tells when it is built."""
        if self._started:
            raise RuntimeError("the engine is already started")
        self._started = True
        self.transport.start(self)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    async def wait_ready(self) -> None:
        """Returns once the engine can take requests; raises the startup error if it failed."""
        await self._ready.wait()
        if self.error is not None:
            raise self.error

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts whatever is left and stops the engine (a step in flight finishes first)."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        await self.transport.stop(timeout)
        self._fail_all(EngineShutdownError("the server is shutting down"))

    def _fail_all(self, error: EngineDeadError) -> None:
        """Wakes every waiting caller with ``error``: the engine will not answer them any more."""
        for collector in set(self._collectors.values()):
            collector._fail(error)
        self._collectors.clear()
        waiting = [s.accepted for s in self._in_flight] + list(self._unanswered.values())  # adds, adapter loads
        for future in waiting:
            if not future.done():
                future.set_exception(error)
        self._unanswered.clear()

    # ------------------------------------------------------------------ admission

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
        waited = (time.monotonic() if now is None else now) - min(s.booked_at for s in self._in_flight)
        if waited < STALLED_ADMISSION_S:
            return None
        return f"{len(self._in_flight)} submission(s) have waited {waited:.0f} s for the engine to accept them"

    async def add_requests(self, items: Items, lora_request: Optional[LoRARequest] = None) -> OutputCollector:
        """Submits requests atomically: all are accepted, or none is and the error is raised.
        ``lora_request``: the adapter they all run with (None: the base model).

        Raises ``ValueError`` for bad input (``RequestTooLargeError`` when the items have more
        sequences than ``max_queue_len``), ``QueueFullError``, ``EngineNotReadyError`` or
        ``EngineDeadError``. Cancelling the caller while it waits aborts whatever was accepted.

        The one place where admission is booked: the submission counts in ``queue_length`` from
        here until the engine answers, and the booking is released however this ends (accepted,
        refused, the send failing, the engine dying, the caller cancelled), so no failure can
        leave the server counting sequences that no engine holds.
        """
        sequences = sum(params.n for _, _, params in items)
        check_admission(self.error, self._stopping, self._ready.is_set(),
                        self.max_queue_len, self.queue_length, sequences)
        collector = OutputCollector([rid for rid, _, _ in items])
        for rid in collector.request_ids:
            if rid in self._collectors:
                raise ValueError(f"request id {rid!r} is already in use")
        submission = _Submission(sequences, asyncio.get_running_loop().create_future(), time.monotonic())
        self._in_flight.add(submission)
        try:
            self._send_add(items, collector, submission.accepted, lora_request)
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

    def _send_add(self, items: Items, collector: OutputCollector, accepted: asyncio.Future,
                  lora_request: Optional[LoRARequest]) -> None:
        """Checks and tokenizes the prompts and sends the submission (which may raise: a value
        the transport cannot carry); only then registers it, so a failure leaves nothing."""
        prompts = self._token_ids(items)
        batch_id = next(self._batch_ids)
        self.transport.send((ADD, batch_id, time.monotonic(),
                             [(rid, ids, params) for (rid, _, params), (_, ids) in zip(items, prompts)], lora_request))
        assert self._outputs is not None
        for (rid, _, params), (text, ids) in zip(items, prompts):
            self._collectors[rid] = collector
            self._outputs.add(rid, text, ids, params)
        self._unanswered[batch_id] = accepted

    def _token_ids(self, items: Items) -> list[tuple[Optional[str], list[int]]]:
        """Each prompt as (text, token ids), checked as ``LLMEngine.add_request`` checks it (the
        same errors, in the same order; the engine checks again), so that a bad prompt is
        refused before anything is sent. A text prompt is tokenized here."""
        out = []
        for i, (_, prompt, params) in enumerate(items):
            try:
                out.append(self._checked_ids(prompt, params))
            except InputError as exc:
                raise exc.for_prompt(i) if len(items) > 1 else exc from None
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}" if len(items) > 1 else str(exc)) from None
        return out

    def _checked_ids(self, prompt: PromptType, params: Any) -> tuple[Optional[str], list[int]]:
        generating = isinstance(params, SamplingParams)
        if generating:
            params.validate(self.max_logprobs)
        text, ids = prompt_to_ids(prompt, self.tokenizer)
        check_prompt(ids, params if generating else PREFILL_ONLY, self.vocab_size, self.max_model_len)
        return text, ids

    async def load_lora(self, lora_request: LoRARequest) -> None:
        """Has the engine read and check an adapter (into its host cache); raises its error
        (``ValueError`` for an adapter it cannot serve) or the engine's state, as ``add_requests``."""
        check_admission(self.error, self._stopping, self._ready.is_set(), None, 0, 0)
        batch_id = next(self._batch_ids)
        accepted = asyncio.get_running_loop().create_future()
        self._unanswered[batch_id] = accepted
        try:
            self.transport.send((LOAD_LORA, batch_id, lora_request))
            await asyncio.shield(accepted)
        finally:
            self._unanswered.pop(batch_id, None)

    def unload_lora(self, lora_int_id: int) -> None:
        """Has the engine forget an adapter (requests still running with it finish with it)."""
        if self._alive():
            self.transport.send((UNLOAD_LORA, lora_int_id))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stops requests and frees their KV blocks; unknown or finished ids are ignored."""
        ids = [rid for rid in request_ids if self._collectors.pop(rid, None) is not None]
        if self._outputs is not None:
            self._outputs.remove(ids)
        if ids and self._alive():
            self.transport.send((ABORT, ids))

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._collectors.pop(rid, None)
        if self._outputs is not None:
            self._outputs.remove(request_ids)

    def _alive(self) -> bool:
        return self.error is None and not self._stopping and self.transport.alive()

    # ------------------------------------------------------------------ the transport's callbacks

    def _on_ready(self, ready: Ready) -> None:
        facts = ready.facts
        self.tokenizer, self.worker_tokenizer = ready.tokenizer, copy.deepcopy(ready.tokenizer)
        self.grammar_compiler = ready.grammar_compiler
        self.max_model_len, self.vocab_size, self.model_path = facts.max_model_len, facts.vocab_size, facts.model_path
        self.max_logprobs, self.eos_token_ids = facts.max_logprobs, frozenset(facts.eos_token_ids)
        self.stats = facts.stats
        self._outputs = OutputProcessor(copy.deepcopy(ready.tokenizer))  # Rust tokenizers: one per thread
        self._ready.set()

    def _on_startup_failed(self, error: BaseException) -> None:
        if self.error is not None:
            return
        self.error = self.startup_error = error
        self._ready.set()
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _on_accepted(self, batch_id: int, error: Optional[BaseException]) -> None:
        future = self._unanswered.pop(batch_id, None)
        if future is not None and not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _on_step(self, step: EngineStep) -> None:
        """Outputs to their collectors (stop strings found here end their sequences in the
        engine), then the step to ``on_step`` (the metrics)."""
        assert self._outputs is not None
        outputs, finishes = self._outputs.process(step.deltas)
        if finishes and self._alive():
            self.transport.send((FINISH, finishes))
        for output in outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector._put(output)
                if output.finished:
                    del self._collectors[output.request_id]
        self.stats = step.stats
        if self.on_step is not None:
            self.on_step(StepOutput(outputs, step.timings, step.stats))

    def _on_fatal(self, error: BaseException, reported: EngineDeadError) -> None:
        """The engine died: ``error`` is why, ``reported`` what every waiting caller gets."""
        if self.error is not None:
            return
        self.error = error
        self._fail_all(reported)
        if self.on_fatal is not None:
            self.on_fatal(error)
