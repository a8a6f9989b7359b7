"""``DataParallelEngine``: N independent engine replicas behind one server, as one engine.

Scale-out within a machine: each replica is a whole engine (its own scheduler, model copy and
KV cache; an ``EngineClient`` over its own engine-core process or engine thread), and this
class presents the interface the server uses of one ``EngineClient``
(``start``/``wait_ready``/``shutdown``, ``add_requests``/``generate``/``abort``, the
``on_step``/``on_fatal`` callbacks, the facts about the model), so the routes, the metrics and
the lifecycle do not know how many replicas there are.

- Routing (``dp_router``): each submission goes whole to one replica (a batch of prompts and
  all ``n`` sequences of each: its acceptance stays atomic and its outputs come from one
  collector), chosen by the prefix-affine, load-aware rule on the first prompt's token ids,
  with the load the outstanding sequences this class counts (added on submission, released
  when a request finishes or is aborted), exact at the moment of the choice, where the
  engines' own stats are one step old. A replica whose queue is full (``--max-queue-len``
  bounds each replica's queue) refuses an affine choice; the least loaded other one is tried.
- Aborts go to the replica holding the request (this class remembers which).
- A replica failing, at startup or later, fails the whole engine: ``error`` is set,
  ``on_fatal`` runs once, and the server stops taking requests and exits, as with one
  engine. The failed replica wakes its own callers; the others' requests end when the server
  stops them.
- ``stats`` is the server-level sum (KV usage: the mean, the replicas' pools being equal);
  ``replicas`` gives each replica's own for per-replica metrics.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Optional, Protocol, Sequence

from ..lora.request import LoRARequest
from ..sampling_params import SamplingParams
from .client import EngineDeadError, EngineNotReadyError, OutputCollector, QueueFullError, StreamingFront
from .dp_router import PrefixAffinityRouter, RouterConfig, least_loaded
from .inputs import PromptType
from .stats import EngineStats, StepOutput, aggregate_stats

logger = logging.getLogger("vgraph")

Items = Sequence[tuple[str, PromptType, SamplingParams]]


class Replica(Protocol):
    """What this class needs of each replica: the ``EngineClient`` interface."""

    on_step: Optional[Callable[[StepOutput], None]]
    on_fatal: Optional[Callable[[BaseException], None]]
    error: Optional[BaseException]
    startup_error: Optional[BaseException]
    stats: EngineStats
    ready: bool

    def start(self) -> None: ...
    async def wait_ready(self) -> None: ...
    async def shutdown(self, timeout: float = 30.0) -> None: ...
    async def add_requests(self, items: Items, lora_request: Optional[LoRARequest] = None) -> OutputCollector: ...
    async def load_lora(self, lora_request: LoRARequest) -> None: ...
    def unload_lora(self, lora_int_id: int) -> None: ...
    def abort(self, request_ids: Iterable[str]) -> None: ...
    def admission_stall(self) -> Optional[str]: ...


def _replica_fact(name: str, doc: str) -> property:
    """A fact about the model the server reads once the engine is ready: replica 0's (every
    replica loads the same model with the same settings). Read through, not copied, so it is
    there the moment ``ready`` turns true."""
    return property(lambda self: getattr(self.replicas[0], name), doc=doc)


class DataParallelEngine(StreamingFront):
    """N replicas with the ``EngineClient`` interface, presented as one (see the module docstring)."""

    def __init__(self, replicas: Sequence[Replica], router: PrefixAffinityRouter, *,
                 on_step: Optional[Callable[[StepOutput], None]] = None,
                 on_fatal: Optional[Callable[[BaseException], None]] = None) -> None:
        if len(replicas) < 1:
            raise ValueError("a data-parallel engine needs at least one replica")
        if router.config.num_replicas != len(replicas):
            raise ValueError(f"the router is configured for {router.config.num_replicas} replicas, "
                             f"got {len(replicas)}")
        self.replicas = list(replicas)
        self.router = router
        self.on_step = on_step
        self.on_fatal = on_fatal
        self.error: Optional[BaseException] = None
        self.startup_error: Optional[BaseException] = None
        self.loads = [0] * len(self.replicas)  # outstanding sequences per replica
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (replica, its sequences)
        for index, replica in enumerate(self.replicas):
            replica.on_step = self._step_hook(index)
            replica.on_fatal = self._fatal_hook(index)

    tokenizer = _replica_fact("tokenizer", "replica 0's private copy, for the event loop")
    worker_tokenizer = _replica_fact("worker_tokenizer", "another, for the server's tokenizing thread")
    max_model_len = _replica_fact("max_model_len", "tokens a sequence may hold")
    vocab_size = _replica_fact("vocab_size", "the model's vocabulary size")
    model_path = _replica_fact("model_path", "the model as loaded")
    max_logprobs = _replica_fact("max_logprobs", "top logprobs a request may ask for")
    eos_token_ids = _replica_fact("eos_token_ids", "the tokens that end a sequence")
    grammar_compiler = _replica_fact("grammar_compiler", "validates structured-output grammars")

    # ------------------------------------------------------------------ lifecycle

    @property
    def ready(self) -> bool:
        return self.error is None and all(replica.ready for replica in self.replicas)

    @property
    def stats(self) -> EngineStats:
        """The server-level state: sums over the replicas, KV usage their mean."""
        return aggregate_stats([replica.stats for replica in self.replicas])

    def admission_stall(self) -> Optional[str]:
        """The first replica whose admission looks stuck, and why (see ``EngineClient``)."""
        for index, replica in enumerate(self.replicas):
            stall = replica.admission_stall()
            if stall is not None:
                return f"replica {index}: {stall}"
        return None

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    async def wait_ready(self) -> None:
        """Returns once every replica is ready; raises the first startup error at once."""
        await asyncio.gather(*(replica.wait_ready() for replica in self.replicas))
        if self.error is not None:
            raise self.error

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stops every replica (concurrently: each may finish a step first)."""
        await asyncio.gather(*(replica.shutdown(timeout) for replica in self.replicas))

    # ------------------------------------------------------------------ requests

    async def load_lora(self, lora_request: LoRARequest) -> None:
        """Every replica reads and checks the adapter (any may be routed its requests)."""
        self._check_accepting()
        await asyncio.gather(*(replica.load_lora(lora_request) for replica in self.replicas))

    def unload_lora(self, lora_int_id: int) -> None:
        for replica in self.replicas:
            replica.unload_lora(lora_int_id)

    async def add_requests(self, items: Items, lora_request: Optional[LoRARequest] = None) -> OutputCollector:
        """Submits ``items`` to one replica, atomically (see ``EngineClient.add_requests``)."""
        self._check_accepting()
        if not items:
            raise ValueError("no requests to add")
        for rid, _, _ in items:
            if rid in self._owner:
                raise ValueError(f"request id {rid!r} is already in use")
        sequences = [params.n for _, _, params in items]
        route = self.router.route(self.router.keys(_token_ids(items[0][1])), self.loads)
        try:
            return await self._submit(route.replica, items, sequences, lora_request)
        except QueueFullError:
            if not route.affine:
                raise
            fallback = least_loaded(self.loads, exclude=route.replica)
            if fallback == route.replica:
                raise
            return await self._submit(fallback, items, sequences, lora_request)

    async def _submit(self, index: int, items: Items, sequences: list[int],
                      lora_request: Optional[LoRARequest]) -> OutputCollector:
        """Counts the items against replica ``index`` and hands them to it; takes the count back
        if it refuses them (or the caller is cancelled: the replica aborts what it took)."""
        for (rid, _, _), n in zip(items, sequences):
            self._owner[rid] = (index, n)
        self.loads[index] += sum(sequences)
        try:
            return await self.replicas[index].add_requests(items, lora_request)
        except BaseException:
            self._release(rid for rid, _, _ in items)
            raise

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stops requests on the replicas holding them; unknown or finished ids are ignored."""
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            held = self._owner.get(rid)
            if held is not None:
                by_replica.setdefault(held[0], []).append(rid)
        for index, ids in by_replica.items():
            self._release(ids)
            self.replicas[index].abort(ids)

    def _release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            held = self._owner.pop(rid, None)
            if held is not None:
                self.loads[held[0]] -= held[1]

    def _check_accepting(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine has failed: {self.error}")
        if not self.ready:
            raise EngineNotReadyError("the model is still loading")

    # ------------------------------------------------------------------ replica callbacks

    def _step_hook(self, index: int) -> Callable[[StepOutput], None]:
        def on_step(step: StepOutput) -> None:
            self._release(output.request_id for output in step.outputs if output.finished)
            if self.on_step is not None:
                self.on_step(step)
        return on_step

    def _fatal_hook(self, index: int) -> Callable[[BaseException], None]:
        def on_fatal(error: BaseException) -> None:
            replica = self.replicas[index]
            logger.error("data-parallel replica %d failed (%s: %s); the server cannot serve without it",
                         index, type(error).__name__, error)
            if self.error is not None:
                return
            self.error = error
            if replica.startup_error is not None:
                self.startup_error = replica.startup_error
            if self.on_fatal is not None:
                self.on_fatal(error)
        return on_fatal


def _token_ids(prompt: PromptType) -> Optional[list[int]]:
    """The prompt's token ids when it carries them (the server always sends them); a text-only
    prompt has none here, and is routed by load alone rather than tokenized on the event loop."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return ids if isinstance(ids, list) else None
    if isinstance(prompt, list):
        return prompt
    return None


def data_parallel(replicas: Sequence[Replica], block_size: int) -> DataParallelEngine:
    """A ``DataParallelEngine`` over ``replicas`` with the default routing rule for KV blocks of
    ``block_size`` tokens."""
    return DataParallelEngine(replicas, PrefixAffinityRouter(RouterConfig(len(replicas), block_size=block_size)))
