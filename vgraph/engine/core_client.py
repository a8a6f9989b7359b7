"""``EngineCoreClient``: the server's side of the engine-core process, shaped like ``AsyncEngine``.

It has the same public interface the server uses from ``AsyncEngine`` (``start``,
``wait_ready``, ``ready``, ``add_requests``, ``generate``, ``abort``, ``shutdown``,
``queue_length``, ``stats``, ``on_step``, ``on_fatal``, ``error``, ``startup_error`` and the
facts about the model), so the routes, metrics and lifecycle do not care which one they have.
Everything here runs on the server's event loop:

- the core process is spawned in ``start``; when it reports ``ready``, this side loads its own
  tokenizer (two copies, as ``AsyncEngine`` hands out) and grammar compiler from the same files;
- requests go out as token ids with explicit parameters (``core_codec``); text prompts are
  tokenized here. An ``add`` is answered by one ``accepted`` (or the engine's refusal, a
  ``ValueError`` for bad input), so submissions stay atomic;
- outputs come back as token deltas; ``OutputProcessor`` detokenizes them, finds stop strings
  (and tells the core to end those sequences) and builds the cumulative ``RequestOutput``s the
  ``OutputCollector``s hold;
- the process is watched through its sentinel: if it dies without being told to, every waiting
  caller gets ``EngineProcessDiedError`` (503), ``error`` is set and ``on_fatal`` runs.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Optional, Sequence

from ..sampling_params import SamplingParams
from .async_engine import (EngineDeadError, EngineProcessDiedError, EngineShutdownError, OutputCollector,
                           OneEngineFront, _Submission, check_admission)
from .core_codec import (ABORT, ACCEPTED, ADD, FATAL, FINISH, READY, SHUTDOWN, STARTUP_FAILED, STEP, EngineFacts,
                         decode_delta, decode_error, decode_stats, decode_timing, encode_message, encode_params,
                         pack, unpack)
from .core_process import CoreProcessConfig, run_engine_core
from .inputs import InputError, PromptType, check_prompt, prompt_to_ids
from .output_processor import OutputProcessor
from .stats import EngineStats, StepOutput

logger = logging.getLogger("vgraph")

_PREFILL_ONLY = SamplingParams(max_tokens=0)  # what a pooling prompt is checked as (see LLMEngine)


class EngineCoreClient(OneEngineFront):
    """Runs an ``LLMEngine`` in a spawned process; requests in and outputs out via asyncio."""

    def __init__(self, config: CoreProcessConfig, *, max_queue_len: Optional[int] = None,
                 on_step: Optional[Callable[[StepOutput], None]] = None,
                 on_fatal: Optional[Callable[[BaseException], None]] = None) -> None:
        if max_queue_len is not None and max_queue_len < 1:
            raise ValueError(f"max_queue_len must be at least 1, got {max_queue_len}")
        self._config = config
        self.max_queue_len = max_queue_len
        self.on_step = on_step
        self.on_fatal = on_fatal
        self.process: Optional[multiprocessing.process.BaseProcess] = None  # the engine-core process
        self._ipc_dir: Optional[str] = None
        self._zmq: Any = None  # (context, input socket, output socket) once started
        self._reader: Optional[asyncio.Task] = None
        self._early_tokenizer: Optional[tuple[str, asyncio.Future]] = None  # (path, its load) while the core starts
        self._outputs: Optional[OutputProcessor] = None
        self._collectors: dict[str, OutputCollector] = {}
        self._in_flight: set[_Submission] = set()  # submissions the core has not answered (OneEngineFront._admit)
        self._unanswered: dict[int, asyncio.Future] = {}  # batch id -> its acceptance future
        self._batch_ids = itertools.count()
        self._ready = asyncio.Event()
        self._stopping = False
        self.error: Optional[BaseException] = None
        self.startup_error: Optional[BaseException] = None
        self.stats = EngineStats()
        self.tokenizer: Any = None
        self.worker_tokenizer: Any = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.model_path = ""
        self.max_logprobs = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self.grammar_compiler: Any = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Binds the sockets and spawns the engine-core process; ``wait_ready`` tells when it is built."""
        if self.process is not None:
            raise RuntimeError("the engine is already started")
        import zmq
        import zmq.asyncio
        self._ipc_dir = tempfile.mkdtemp(prefix="vgraph-core-")
        input_address, output_address = f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output"
        context = zmq.asyncio.Context()
        # Commands go out on a plain (synchronous) socket: a send never blocks the event loop
        # (no high-water mark, and the core connects before it builds its engine) and fails
        # at once, not in a future nobody awaits, when no core is there.
        commands = zmq.Context.shadow(context.underlying).socket(zmq.PUSH)
        commands.setsockopt(zmq.SNDHWM, 0)
        commands.setsockopt(zmq.LINGER, 0)
        commands.bind(input_address)
        outputs = context.socket(zmq.PULL)
        outputs.setsockopt(zmq.RCVHWM, 0)
        outputs.setsockopt(zmq.LINGER, 0)
        outputs.bind(output_address)
        self._zmq = (context, commands, outputs)
        config = replace(self._config, input_address=input_address, output_address=output_address)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config,), name="vgraph-engine-core", daemon=False)
        self.process.start()
        logger.info("engine-core process started (pid %d)", self.process.pid)
        loop = asyncio.get_running_loop()
        self._load_tokenizer_early()
        loop.add_reader(self.process.sentinel, self._on_process_exit)
        self._reader = loop.create_task(self._read_outputs())

    def _load_tokenizer_early(self) -> None:
        """Starts loading the tokenizer now when it is a local directory, so that it loads
        while the core builds its engine (a hub id waits for the path the core resolves)."""
        from ..models.loader import load_tokenizer
        path = self._config.engine_kwargs.get("tokenizer") or self._config.model
        if os.path.isdir(path):
            future = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, path))
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure is the core's to report
            self._early_tokenizer = (os.path.abspath(path), future)

    async def _tokenizer_for(self, path: str) -> Any:
        from ..models.loader import load_tokenizer
        early, self._early_tokenizer = self._early_tokenizer, None
        if early is not None and os.path.isdir(path) and os.path.abspath(path) == early[0]:
            return await early[1]
        return await asyncio.to_thread(load_tokenizer, path)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts whatever is left, stops the core process (a step in flight finishes first) and
        waits for it; one that does not exit in ``timeout`` seconds is killed."""
        if self.process is None or self._stopping:
            return
        self._stopping = True
        self._stop_watching()
        if self.process.is_alive():
            self._send([SHUTDOWN])
            await asyncio.to_thread(self.process.join, timeout)
            if self.process.is_alive():
                logger.warning("the engine-core process did not stop within %.1f s; killing it", timeout)
                self.process.kill()
                await asyncio.to_thread(self.process.join, 5.0)
            logger.info("engine-core process stopped (%s)", _describe_exit(self.process.exitcode))
        self._fail_all(EngineShutdownError("the server is shutting down"))
        if self._reader is not None:
            self._reader.cancel()
        self._close_sockets()

    def _stop_watching(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError):  # no loop, or the sentinel already closed
            asyncio.get_running_loop().remove_reader(self.process.sentinel)

    def _close_sockets(self) -> None:
        if self._zmq is not None:
            context, commands, outputs = self._zmq
            commands.close()
            outputs.close()
            context.term()
            self._zmq = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def _fail_all(self, error: EngineDeadError) -> None:
        """Wakes every waiting caller with ``error``: the engine will not answer them any more."""
        for collector in set(self._collectors.values()):
            collector._fail(error)
        self._collectors.clear()
        self._fail_submissions(error)
        self._unanswered.clear()

    # ------------------------------------------------------------------ requests

    async def add_requests(self, items: Sequence[tuple[str, PromptType, SamplingParams]]) -> OutputCollector:
        """Submits requests atomically, as ``AsyncEngine.add_requests`` (same errors)."""
        return await self._admit(items, lambda collector, accepted: self._send_add(items, accepted))

    def _send_add(self, items: Sequence[tuple[str, PromptType, SamplingParams]], accepted: asyncio.Future) -> None:
        """Checks and tokenizes the prompts and encodes the submission first, so that one the
        core would refuse or the codec cannot carry fails before anything is registered; then
        registers it with the output processor and sends it."""
        prompts = self._token_ids(items)
        batch_id = next(self._batch_ids)
        message = encode_message([ADD, batch_id, time.monotonic(),
                                  [[rid, ids, encode_params(params)]
                                   for (rid, _, params), (_, ids) in zip(items, prompts)]])
        assert self._outputs is not None
        for (rid, _, params), (text, ids) in zip(items, prompts):
            self._outputs.add(rid, text, ids, params)
        self._unanswered[batch_id] = accepted
        try:
            self._send_bytes(message)
        except BaseException:
            self._unanswered.pop(batch_id, None)
            raise

    def _token_ids(self, items: Sequence[tuple[str, PromptType, SamplingParams]]) -> list[tuple[Optional[str], list[int]]]:
        """Each prompt as (text, token ids), checked as ``LLMEngine.add_request`` checks it (the
        same errors, in the same order; the core checks again), so that nothing unsendable (a
        token id beyond 64 bits) reaches the socket. A text prompt is tokenized here."""
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
        check_prompt(ids, params if generating else _PREFILL_ONLY, self.vocab_size, self.max_model_len)
        return text, ids

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stops requests and frees their KV blocks; unknown or finished ids are ignored."""
        ids = [rid for rid in request_ids if self._collectors.pop(rid, None) is not None]
        if self._outputs is not None:
            self._outputs.remove(ids)
        if ids and self._alive():
            self._send([ABORT, ids])

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._collectors.pop(rid, None)
        if self._outputs is not None:
            self._outputs.remove(request_ids)

    def _alive(self) -> bool:
        return self.process is not None and self.error is None and not self._stopping and self._zmq is not None

    def _send(self, message: list) -> None:
        self._send_bytes(pack(message))

    def _send_bytes(self, data: bytes) -> None:
        import zmq
        try:
            self._zmq[1].send(data, flags=zmq.NOBLOCK)
        except zmq.Again:  # no core connected: it exited (its sentinel tells the rest)
            logger.debug("the engine-core process is not connected; a message was not sent")

    def _check_accepting(self, sequences: int) -> None:
        check_admission(self.error, self._stopping, self._ready.is_set(), self.max_queue_len,
                        self.queue_length, sequences)

    # ------------------------------------------------------------------ messages from the core

    async def _read_outputs(self) -> None:
        outputs = self._zmq[2]
        while True:
            await self._handle(unpack(await outputs.recv()))

    async def _handle(self, message: list) -> None:
        kind = message[0]
        try:
            if kind == STEP:
                self._on_step(message)
            elif kind == ACCEPTED:
                self._on_accepted(message[1], message[2])
            elif kind == READY:
                await self._on_ready(EngineFacts.decode(message[1]))
            elif kind == STARTUP_FAILED:
                self._on_startup_failed(decode_error(message[1]))
            elif kind == FATAL:
                error = decode_error(message[1])
                self._on_fatal(error, EngineDeadError(f"the engine failed: {type(error).__name__}: {error}"))
            else:
                raise ValueError(f"unknown message {kind!r} from the engine-core process")
        except Exception:  # a bug here must not leave every caller waiting
            logger.exception("handling a %r message from the engine-core process failed", kind)

    async def _on_ready(self, facts: EngineFacts) -> None:
        from ..structured.compiler import GrammarCompiler
        try:
            tokenizer = await self._tokenizer_for(facts.tokenizer_path)
            worker_tokenizer = copy.deepcopy(tokenizer)  # Rust tokenizers must not be shared across threads
            self.grammar_compiler = GrammarCompiler(copy.deepcopy(tokenizer), facts.vocab_size, facts.eos_token_ids)
        except Exception as exc:
            self._on_startup_failed(exc)
            return
        self.tokenizer, self.worker_tokenizer = tokenizer, worker_tokenizer
        self.max_model_len, self.vocab_size, self.model_path = facts.max_model_len, facts.vocab_size, facts.model_path
        self.max_logprobs, self.eos_token_ids = facts.max_logprobs, frozenset(facts.eos_token_ids)
        self.stats = facts.stats
        self._outputs = OutputProcessor(copy.deepcopy(tokenizer))
        self._ready.set()

    def _on_startup_failed(self, error: BaseException) -> None:
        if self.error is not None:
            return
        self.error = self.startup_error = error
        self._ready.set()
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _on_accepted(self, batch_id: int, error: Optional[list]) -> None:
        future = self._unanswered.pop(batch_id, None)
        if future is not None and not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(decode_error(error))

    def _on_step(self, message: list) -> None:
        _, deltas, timings, stats = message
        assert self._outputs is not None
        outputs, finishes = self._outputs.process([decode_delta(d) for d in deltas])
        if finishes:
            self._send([FINISH, [list(f) for f in finishes]])
        self._deliver(StepOutput(outputs, [decode_timing(t) for t in timings], decode_stats(stats)))

    def _on_fatal(self, error: BaseException, reported: EngineDeadError) -> None:
        if self.error is not None:
            return
        self.error = error
        self._fail_all(reported)
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _on_process_exit(self) -> None:
        """The process's sentinel fired without a shutdown: it died, or failed and exited."""
        self._stop_watching()
        if not self._stopping:
            asyncio.get_running_loop().create_task(self._after_exit())

    async def _after_exit(self) -> None:
        """Handles what the process sent before it exited (its startup failure or fatal error
        says more than its exit code), then fails everything still waiting."""
        import zmq
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        while self._zmq is not None:
            try:
                data = await self._zmq[2].recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            await self._handle(unpack(data))
        self.process.join(1.0)
        error = EngineProcessDiedError(f"the engine-core process (pid {self.process.pid}) exited unexpectedly "
                                       f"with {_describe_exit(self.process.exitcode)}")
        if not self._ready.is_set():
            self._on_startup_failed(error)
        elif self.error is None:
            logger.error("%s", error)
            self._on_fatal(error, error)


def _describe_exit(code: Optional[int]) -> str:
    if code is not None and code < 0:
        import signal
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
