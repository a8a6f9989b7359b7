"""The engine-core process: an ``LLMEngine`` (scheduler + runner) stepping in its own process.

``vgraph serve`` starts it with ``multiprocessing``'s *spawn* method (a fresh interpreter:
torch's thread pools, OpenMP and CUDA state must not be forked) and talks to it over two ZMQ
PUSH/PULL sockets on ``ipc://`` paths in a private temporary directory, with the messages of
``core_codec``. The server process keeps HTTP, tokenization and detokenization
(``EngineClient`` over ``ProcessTransport``), so none of that takes CPU time from the step
loop, and this process does nothing but take commands and step (``EngineLoop``).

- Startup: the engine is built here; ``ready`` carries what the server needs, a failure
  ``startup_failed`` with its type and message (the CLI then prints one line for a user error).
- The loop: blocks on the command queue only when idle; adds are accepted or refused
  atomically (one ``accepted`` per batch, before any step that could produce its outputs).
- Outputs: per step, the engine's deltas as they are (each request's *new* tokens), the
  timings and the engine's stats.
- Ending: ``shutdown`` aborts whatever is left and exits 0; a failing step sends ``fatal`` and
  exits 1. SIGINT and SIGTERM are ignored: the server owns the lifecycle (it drains first,
  then sends ``shutdown``), and a signal sent to the whole process group must not cut the
  drain short. If the server process dies, a watcher thread sees its sentinel and exits, so
  the core is never orphaned.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .core_codec import (ACCEPTED, ADD, LOAD_LORA, decode_lora, FATAL, READY, STARTUP_FAILED, STEP, decode_params, encode_delta, encode_error,
                         encode_stats, encode_timing, pack, unpack)
from .gc_tuning import freeze_after_startup
from .stats import EngineStep

logger = logging.getLogger("vgraph")


@dataclass(frozen=True)
class CoreProcessConfig:
    """What the spawned process needs to build its engine: plain values only.

    ``engine_kwargs`` are ``EngineConfig.from_kwargs`` keywords, except ``passes``, which is
    given as ``--pass`` specs in ``pass_specs`` and loaded in the child (a pass object loaded
    from a user's file need not be picklable)."""

    model: str
    engine_kwargs: dict[str, Any]
    pass_specs: list[str] = field(default_factory=list)
    log_level: str = "INFO"
    num_threads: Optional[int] = None  # torch's threads (None: its default); data-parallel replicas split the cores
    input_address: str = ""  # the server binds both; the core connects
    output_address: str = ""


def run_engine_core(config: CoreProcessConfig) -> None:
    """The spawned process's entry point; exits with 0 after ``shutdown``, 1 after a failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _setup_logging(config.log_level)
    _watch_parent()
    if config.num_threads is not None:
        import torch
        torch.set_num_threads(config.num_threads)
    import zmq

    context = zmq.Context()
    output = context.socket(zmq.PUSH)
    output.setsockopt(zmq.LINGER, 5000)  # the last messages (fatal, accepted) must reach the server
    output.connect(config.output_address)
    # Connected now, while the engine builds: the server's first command finds a peer. Used
    # only by the input thread from then on.
    commands = context.socket(zmq.PULL)
    commands.setsockopt(zmq.LINGER, 0)
    commands.connect(config.input_address)
    try:
        code = _run(config, commands, output.send)
    finally:
        output.close()
        context.term()  # delivers what is still queued (LINGER); the input thread closes its socket
    sys.exit(code)


def _run(config: CoreProcessConfig, commands_socket: Any, send: Callable[[bytes], Any]) -> int:
    from .core_loop import EngineLoop, engine_facts
    try:
        engine = build_engine(config)
        facts = engine_facts(engine)
    except Exception as exc:  # reported to the server, which decides how to exit
        logger.debug("building the engine failed", exc_info=exc)
        send(pack([STARTUP_FAILED, encode_error(exc)]))
        commands_socket.close()  # no input thread took it
        return 1
    freeze_after_startup()  # the built engine's objects are never walked by a collection again
    commands: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(commands_socket, commands), name="vgraph-core-input", daemon=True).start()
    send(pack([READY, facts.encode()]))
    loop = EngineLoop(engine, lambda batch_id, error: send(pack([ACCEPTED, batch_id, None if error is None
                                                                  else encode_error(error)])),
                      lambda step: send(pack(encode_step(step))))
    try:
        loop.serve(commands)
    except Exception as exc:
        logger.exception("engine step failed; the engine is dead")
        send(pack([FATAL, encode_error(exc)]))
        return 1
    return 0


def encode_step(step: EngineStep) -> list:
    return [STEP, [encode_delta(d) for d in step.deltas], [encode_timing(t) for t in step.timings],
            encode_stats(step.stats)]


def build_engine(config: CoreProcessConfig) -> Any:
    """The ``LLMEngine`` the config describes."""
    from ..config import EngineConfig
    from ..passes.loading import load_pass
    from .llm_engine import LLMEngine
    if os.getcwd() not in sys.path:  # as the CLI does: a --pass module may be a file in the cwd
        sys.path.append(os.getcwd())
    passes = [load_pass(spec) for spec in config.pass_specs]
    engine_config = EngineConfig.from_kwargs(config.model, **config.engine_kwargs, passes=passes)
    return LLMEngine(engine_config)


def _receive(sock: Any, commands: queue.SimpleQueue) -> None:
    """The input thread: decodes commands off the socket so the step loop never waits on it.
    Owns the socket from its start, and closes it when the process ends the context."""
    import zmq
    try:
        while True:
            commands.put(decode_command(unpack(sock.recv())))
    except zmq.ContextTerminated:
        sock.close()


def decode_command(message: list) -> tuple:
    """A command as ``EngineLoop`` takes it: an ``add``'s parameters decoded."""
    if message[0] == ADD:
        _, batch_id, submitted, items, lora = message
        return ADD, batch_id, submitted, [(rid, ids, decode_params(params)) for rid, ids, params in items], \
            decode_lora(lora)
    if message[0] == LOAD_LORA:
        return LOAD_LORA, message[1], decode_lora(message[2])
    return tuple(message)


def _setup_logging(level: str) -> None:
    """The server's log format and level (a spawned process inherits no logging setup)."""
    from .. import logging_setup
    logging.basicConfig(level=level, format=logging_setup.FORMAT, datefmt=logging_setup.DATE_FORMAT)
    logging_setup.set_level(level)


def _watch_parent() -> None:
    """Exits this process when the server process is gone (killed, crashed): nothing else
    would ever tell it to stop."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait
        wait([parent.sentinel])
        logger.error("the server process is gone; the engine-core process exits")
        os._exit(1)

    threading.Thread(target=watch, name="vgraph-core-parent-watch", daemon=True).start()
