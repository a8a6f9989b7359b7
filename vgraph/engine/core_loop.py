"""The engine's side of a client: the loop that takes commands and steps, on whichever side
of the transport the engine runs (a thread of the server, or the engine-core process).

Commands are tuples whose first item names the kind (``core_codec``'s names): ``add``
(batch id, submission time, ``[(request id, token ids, params)]``), ``abort`` (request ids),
``finish`` (sequences the client ended: a stop string found while detokenizing),
``load_lora`` (batch id, adapter: read and checked, answered like an add), ``unload_lora``
(adapter id) and ``shutdown``. The loop blocks on its command queue only when idle; adds are accepted or
refused atomically, one answer per batch, before any step that could produce its outputs;
after a batch of commands it reports a step with no deltas (the aborted requests' timings,
the stats after the adds), then steps while anything is unfinished.
"""
from __future__ import annotations

import logging
import queue
import time
from typing import Any, Callable, Optional, Sequence

from .core_codec import ABORT, ADD, FINISH, LOAD_LORA, SHUTDOWN, UNLOAD_LORA, EngineFacts
from .inputs import InputError, PromptType
from .stats import EngineStep, RequestTiming
from .step_trace import StepTrace

logger = logging.getLogger("vgraph")

Accepted = Callable[[int, Optional[BaseException]], None]
Stepped = Callable[[EngineStep], None]


def engine_facts(engine: Any) -> EngineFacts:
    """What a client needs to know about a built engine."""
    model = engine.config.model
    return EngineFacts(model_path=model.model, tokenizer_path=model.tokenizer or model.model,
                       max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                       max_logprobs=engine.config.max_logprobs, eos_token_ids=sorted(engine.eos_token_ids),
                       stats=engine.stats())


class EngineLoop:
    """Serves one engine: ``accepted`` answers each ``add``, ``stepped`` gets each step."""

    def __init__(self, engine: Any, accepted: Accepted, stepped: Stepped) -> None:
        self.engine = engine
        self.accepted = accepted
        self.stepped = stepped
        self._traced: set[type] = set()  # exception types whose traceback was logged
        self.trace = StepTrace.from_env()  # VGRAPH_STEP_TRACE: one line per step, for stall hunting

    def serve(self, commands: queue.SimpleQueue) -> None:
        """Returns after ``shutdown`` (aborting what is left); a failing step raises."""
        try:
            self._serve(commands)
        finally:
            self.trace.flush()

    def _serve(self, commands: queue.SimpleQueue) -> None:
        engine, trace = self.engine, self.trace
        while True:
            batch = [commands.get()] if not engine.has_unfinished_requests() else []
            while True:
                try:
                    batch.append(commands.get_nowait())
                except queue.Empty:
                    break
            timings: list[RequestTiming] = []
            for command in batch:
                if command[0] == SHUTDOWN:
                    engine.abort_all()
                    return
                timings.extend(self._apply(command))
            if batch:
                self.stepped(EngineStep([], timings, engine.stats()))
            if engine.has_unfinished_requests():
                start = time.time()
                step = engine.step()
                trace.record(start, time.time(), step, len(batch))
                self.stepped(step)

    def _apply(self, command: tuple) -> list[RequestTiming]:
        kind = command[0]
        if kind == ADD:
            _, batch_id, submitted, items, lora = command
            self.accepted(batch_id, add_atomically(self.engine, items, submitted, self._traced, lora))
            return []
        if kind == LOAD_LORA:
            self.accepted(command[1], self._load_lora(command[2]))
            return []
        if kind == UNLOAD_LORA:
            self.engine.remove_lora(command[1])
            return []
        if kind == ABORT:
            return self.engine.abort_request(command[1])
        if kind == FINISH:
            return self.engine.finish_sequences([tuple(item) for item in command[1]])
        raise ValueError(f"unknown command {kind!r}")

    def _load_lora(self, lora: Any) -> Optional[BaseException]:
        """None once the adapter is read and checked, else why not (a bad adapter is the
        caller's error; anything else is logged and refused, never a dead engine)."""
        try:
            self.engine.add_lora(lora)
        except ValueError as exc:
            return exc
        except Exception as exc:
            logger.error("loading LoRA adapter %r failed: %s: %s", lora.lora_name, type(exc).__name__, exc)
            return exc
        return None


def add_atomically(engine: Any, items: Sequence[tuple[str, PromptType, Any]], submitted: float,
                   traced: set[type], lora: Any = None) -> Optional[BaseException]:
    """Adds a batch of requests atomically and returns None, or the error that refused them:
    on any failure the ones added are taken back (not counted as aborts: they were never
    accepted). ``traced``: exception types whose traceback was logged already (once per type)."""
    added: list[str] = []
    try:
        for rid, prompt, params in items:
            engine.add_request(rid, prompt, params, arrival_time=submitted, lora_request=lora)
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
