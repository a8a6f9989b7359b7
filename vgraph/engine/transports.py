"""The two ways an ``EngineClient`` reaches its engine.

``ThreadTransport``: the engine on a thread of the server. ``LLMEngine.step()`` is blocking work
(a scheduler pass plus a model forward); run on the event loop it would freeze every
connection for a step, while on a thread it overlaps with HTTP handling, because torch
releases the GIL inside its kernels. The engine is built *and* stepped on that one thread, and
the client talks to it only through a command queue, so the engine needs no locks and
thread-local torch state (inference mode, compiled-graph guards) stays on one thread. News
comes back with one ``call_soon_threadsafe`` per step.

``ProcessTransport``: the engine in the engine-core process (``core_process``), spawned here,
over two ZMQ PUSH/PULL sockets on ``ipc://`` paths in a private temporary directory, with
``core_codec``'s explicit msgpack encodings. The process is watched through its sentinel: if
it dies without being told to, the client's callers get ``EngineProcessDiedError`` (503).

Both run the same ``EngineLoop`` on the engine's side and call the client back on its loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
from dataclasses import replace
from typing import Any, Callable, Optional

from .client import EngineClient, EngineDeadError, EngineProcessDiedError, Ready
from .core_codec import (ACCEPTED, ADD, LOAD_LORA, encode_lora, FATAL, READY, SHUTDOWN, STARTUP_FAILED, STEP, EngineFacts, decode_delta,
                         decode_error, decode_stats, decode_timing, encode_message, encode_params, unpack)
from .core_loop import EngineLoop, engine_facts
from .core_process import CoreProcessConfig, run_engine_core
from .stats import EngineStep

logger = logging.getLogger("vgraph")


class ThreadTransport:
    """Builds the engine with ``engine_factory`` and serves it on a thread of this process."""

    def __init__(self, engine_factory: Callable[[], Any]) -> None:
        self._factory = engine_factory
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._client: Optional[EngineClient] = None

    def start(self, client: EngineClient) -> None:
        self._client, self._loop = client, asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._main, name="vgraph-engine", daemon=True)
        self._thread.start()

    def send(self, command: tuple) -> bool:
        self._commands.put(command)
        return True

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def stop(self, timeout: float) -> None:
        if self._thread is None:
            return
        self._commands.put((SHUTDOWN,))
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.1f s", timeout)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(fn, *args)

    def _main(self) -> None:
        client = self._client
        try:
            engine = self._factory()
            ready = Ready(engine_facts(engine), copy.deepcopy(engine.tokenizer), engine.grammar_compiler)
        except BaseException as exc:  # reported to the caller, who decides how to exit
            self._post(client._on_startup_failed, exc)
            return
        self._post(client._on_ready, ready)
        loop = EngineLoop(engine, lambda batch, error: self._post(client._on_accepted, batch, error),
                          lambda step: self._post(client._on_step, step))
        try:
            loop.serve(self._commands)
        except BaseException as exc:
            logger.exception("engine step failed; the engine is dead")
            self._post(client._on_fatal, exc, EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))
        finally:
            engine.close()  # tensor-parallel workers stop with the engine


class ProcessTransport:
    """Spawns the engine-core process for ``config`` and speaks ``core_codec`` with it."""

    def __init__(self, config: CoreProcessConfig) -> None:
        self._config = config
        self.process: Optional[multiprocessing.process.BaseProcess] = None
        self._client: Optional[EngineClient] = None
        self._ipc_dir: Optional[str] = None
        self._zmq: Any = None  # (context, command socket, output socket) once started
        self._reader: Optional[asyncio.Task] = None
        self._early_tokenizer: Optional[tuple[str, asyncio.Future]] = None  # (path, its load) while the core starts
        self._stopping = False
        self._core_started = False  # the core said READY or STARTUP_FAILED: it ends by itself

    def start(self, client: EngineClient) -> None:
        """Binds the sockets and spawns the engine-core process."""
        import zmq
        import zmq.asyncio
        self._client = client
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

    def send(self, command: tuple) -> bool:
        """Encodes and sends a command; False when no core is connected to take it. What the
        codec cannot carry (an int beyond 64 bits) is the caller's ``ValueError``, raised
        before anything is sent."""
        import zmq
        if command[0] == ADD:
            kind, batch_id, submitted, items, lora = command
            command = (kind, batch_id, submitted, [[rid, ids, encode_params(params)] for rid, ids, params in items],
                       encode_lora(lora))
        elif command[0] == LOAD_LORA:
            command = (LOAD_LORA, command[1], encode_lora(command[2]))
        data = encode_message(list(command))
        try:
            self._zmq[1].send(data, flags=zmq.NOBLOCK)
        except zmq.Again:  # no core connected: it exited (its sentinel tells the rest), or is starting
            logger.debug("the engine-core process is not connected; %r not sent", command[0])
            return False
        return True

    def alive(self) -> bool:
        return self.process is not None and not self._stopping and self._zmq is not None

    async def stop(self, timeout: float) -> None:
        """Stops the core process (a step in flight finishes first) and waits for it; one that
        does not exit in ``timeout`` seconds is killed."""
        if self.process is None or self._stopping:
            return
        self._stopping = True
        self._stop_watching()
        if self.process.is_alive():
            if not self.send((SHUTDOWN,)) and not self._core_started:
                # Not connected yet: a core still importing, with nothing to drain. Without
                # this it would build its engine and then wait for a command that never comes.
                # (One whose startup failed has closed its socket and exits by itself.)
                logger.info("the engine-core process is still starting; stopping it")
                self.process.kill()
            await asyncio.to_thread(self.process.join, timeout)
            if self.process.is_alive():
                logger.warning("the engine-core process did not stop within %.1f s; killing it", timeout)
                self.process.kill()
                await asyncio.to_thread(self.process.join, 5.0)
            logger.info("engine-core process stopped (%s)", describe_exit(self.process.exitcode))
        if self._reader is not None:
            self._reader.cancel()
        self._close_sockets()

    # ------------------------------------------------------------------ startup

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

    async def _ready(self, facts: EngineFacts) -> None:
        from ..structured.compiler import GrammarCompiler
        try:
            tokenizer = await self._tokenizer_for(facts.tokenizer_path)
            grammar_compiler = GrammarCompiler(copy.deepcopy(tokenizer), facts.vocab_size, facts.eos_token_ids)
        except Exception as exc:
            self._client._on_startup_failed(exc)
            return
        self._client._on_ready(Ready(facts, tokenizer, grammar_compiler))

    # ------------------------------------------------------------------ messages from the core

    async def _read_outputs(self) -> None:
        outputs = self._zmq[2]
        while True:
            await self._handle(unpack(await outputs.recv()))

    async def _handle(self, message: list) -> None:
        client, kind = self._client, message[0]
        try:
            if kind == STEP:
                _, deltas, timings, stats = message
                client._on_step(EngineStep([decode_delta(d) for d in deltas], [decode_timing(t) for t in timings],
                                           decode_stats(stats)))
            elif kind == ACCEPTED:
                client._on_accepted(message[1], None if message[2] is None else decode_error(message[2]))
            elif kind == READY:
                self._core_started = True
                await self._ready(EngineFacts.decode(message[1]))
            elif kind == STARTUP_FAILED:
                self._core_started = True
                client._on_startup_failed(decode_error(message[1]))
            elif kind == FATAL:
                error = decode_error(message[1])
                client._on_fatal(error, EngineDeadError(f"the engine failed: {type(error).__name__}: {error}"))
            else:
                raise ValueError(f"unknown message {kind!r} from the engine-core process")
        except Exception:  # a bug here must not leave every caller waiting
            logger.exception("handling a %r message from the engine-core process failed", kind)

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
                                       f"with {describe_exit(self.process.exitcode)}")
        client = self._client
        if not client._ready.is_set():
            client._on_startup_failed(error)
        elif client.error is None:
            logger.error("%s", error)
            client._on_fatal(error, error)

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


def describe_exit(code: Optional[int]) -> str:
    if code is not None and code < 0:
        import signal
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
