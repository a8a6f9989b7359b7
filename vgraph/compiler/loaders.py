"""The rungs of the compile ladder, cheapest first (build.py orders them, ladder.py climbs):

- ``runnables``: the captured graph over runnables (warm_start.py); imports neither Dynamo nor
  Inductor. CPU only.
- ``captured graph``: the captured graph over Inductor's artifacts (captured_graph.py); no
  Dynamo trace, no compile.
- ``Inductor artifacts``: a Dynamo trace whose pieces come from the cache's Inductor artifacts;
  any piece the entry lacks is compiled (and saved).
- ``full compile``: a Dynamo trace and an Inductor compile of every piece, nothing read.

``load(input_ids, positions)`` gives a forward or None, with ``reason`` saying why not; the
inputs are the warm-up step's. A tracing rung's forward traces on the ladder's first call of
it. ``settle`` runs once the forward has worked: the cache writer saves what the next start
loads, and a start that just saved runnables serves with them (the code later starts run).
The three rungs below the runnables share one ``CompileSession``, made when the first of them
needs it: making it imports Dynamo and Inductor.
"""
from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..paths import cache_dir
from . import captured_graph as captured
from . import runnable as runnables
from . import warm_start
from .cache import CompileCache
from .cache_entries import DamagedFile, report_damaged
from .counters import CompileCounters
from .torch_range import unsupported_torch
from .warm_load import WarmLoadSettings

if TYPE_CHECKING:
    from .artifact_store import ArtifactStore
    from .backend import VgraphBackend
    from .cache_writer import CacheWriter
    from .compiled_forward import CompiledForward

logger = logging.getLogger("vgraph")

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
THROUGH_INDUCTOR = "loading the compiled model through Inductor instead"
WITHOUT_CACHE = "compiling the model again without the compile cache"


class Declined(Exception):
    """Raised inside a rung's load: its message is the rung's one reason."""


@dataclass(frozen=True)
class CompileSession:
    """What the rungs below the runnables share: the configuration's cache, the backend (its
    artifact store and cache writer) and the Dynamo-traced forward."""

    model: torch.nn.Module
    cache: CompileCache
    backend: "VgraphBackend"
    traced: "CompiledForward"

    @property
    def store(self) -> "ArtifactStore":
        return self.backend.store

    @property
    def writer(self) -> "CacheWriter":
        return self.backend.writer

    @property
    def counters(self) -> CompileCounters:
        return self.backend.counters

    def settle(self, direct: Optional[Forward], settings: Optional[WarmLoadSettings], input_ids: torch.Tensor,
               positions: torch.Tensor, out: torch.Tensor) -> Optional[Forward]:
        """After the first forward worked: the writer records the warm load's shortcuts and
        saves the runnables; the forward built from them, where it did."""
        self.writer.warm_load(settings)
        if direct is None:
            return None
        return self.writer.runnables(self.model, self.store.held, self.backend.pass_matches,
                                     lambda forward: forward(input_ids, positions), out)


class OnFirstUse:
    """The compile session, made when a rung first asks for it (a runnables start never does)."""

    def __init__(self, make: Callable[[], CompileSession]) -> None:
        self._make = make
        self._session: Optional[CompileSession] = None

    def __call__(self) -> CompileSession:
        if self._session is None:
            self._session = self._make()
        return self._session


class _Rung(abc.ABC):
    """What every rung does the same way: a ``Declined`` inside ``_load`` becomes ``reason``."""

    name = ""
    traces = False
    then = ""

    def __init__(self) -> None:
        self.reason = ""

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[Forward]:
        self.reason = ""
        try:
            return self._load(input_ids, positions)
        except Declined as declined:
            self.reason = str(declined)
            return None

    @abc.abstractmethod
    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Forward:
        """The rung's forward; raises ``Declined`` where it has none."""


class RunnablesLoader(_Rung):
    name, then = "runnables", THROUGH_INDUCTOR

    def __init__(self, model: torch.nn.Module, config: Any, hf_config: Any, device: torch.device,
                 counters: CompileCounters) -> None:
        super().__init__()
        self.model, self.config, self.hf_config, self.device = model, config, hf_config, device
        self.counters = counters
        self._cache: Optional[CompileCache] = None

    @property
    def cache(self) -> Optional[CompileCache]:
        return self._cache

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Forward:
        start = time.perf_counter()
        cache, record = self._record(self._warm_key())
        hashes = [r.piece_hash for r in record["pieces"].values()]
        try:
            loaded = {h: runnables.load_runnable(cache.folder, h, "dynamic") for h in set(hashes)}
        except DamagedFile as exc:  # truncated or flipped bytes: a warning; the next rung saves it again
            report_damaged(exc.path, str(exc), "loading the entry through Inductor, which saves it again")
            raise Declined(f"a runnable is damaged ({exc})") from exc
        except Exception as exc:  # missing, or made by another build: the next rung repairs it
            raise Declined(f"the compile cache entry's runnables are not usable ({type(exc).__name__}: "
                           f"{exc})") from exc
        captured.install_pieces(record["split"], record["pieces"], lambda piece_hash, size: loaded[piece_hash][0])
        self.counters.record_load(record["split"], hashes, {h: m for h, (_, m) in loaded.items()},
                                  time.perf_counter() - start)
        self.counters.runnable_loads = len(loaded)
        cache.touch()
        self._cache = cache
        return captured.DirectForward(record["split"], record["sources"], self.model)

    def _warm_key(self) -> str:
        problem = unsupported_torch("runnables") or warm_start.fast_path_problem(self.config, self.device)
        if problem:
            raise Declined(problem)
        key = warm_start.warm_key(self.config, self.hf_config, self.model, self.device)
        if key is None:
            raise Declined("vgraph's pass package is not plain files, so its identity is unknown")
        return key

    def _record(self, key: str) -> tuple[CompileCache, dict]:
        """The entry the warm index names and its captured graph, checked against the model."""
        root = cache_dir()
        index = warm_start.read_index(root, key)
        if index is None:
            raise Declined("no start has saved runnables for this configuration yet")
        fingerprint = captured.source_fingerprint(self.model)
        if index["source_fingerprint"] != fingerprint:
            raise Declined("the model's code changed since its runnables were saved")
        cache = CompileCache(root, index["config_key"], warm_key=key)
        path = cache.find_captured(fingerprint)
        record = captured.load_record(path) if path is not None else None
        if record is None:
            raise Declined("the entry the warm index names has no readable captured graph")
        problem = captured.record_problem(record, self.model, path.parent, cache.config_key)
        if problem is not None:
            raise Declined(f"the captured graph does not fit the model as built now ({problem})")
        return cache, record

    def blames_cache(self, before: CompileCounters) -> bool:
        return True

    def failed(self, before: CompileCounters) -> None:
        self.counters.rewind(before)
        self._cache = None

    def settle(self, forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor,
               out: torch.Tensor) -> Forward:
        return forward


class _SessionRung(_Rung):
    """A rung that loads or compiles through the compile session."""

    def __init__(self, session: Callable[[], CompileSession]) -> None:
        super().__init__()
        self.session = session

    @property
    def cache(self) -> CompileCache:
        return self.session().cache

    @property
    def backend(self) -> "VgraphBackend":
        return self.session().backend

    def _reading(self) -> CompileSession:
        """The session, if it still reads the cache's artifacts."""
        s = self.session()
        if not s.store.reading:
            raise Declined(s.store.not_reading)
        return s

    def blames_cache(self, before: CompileCounters) -> bool:
        return True

    def failed(self, before: CompileCounters) -> None:
        s = self.session()
        s.store.stop_reading("an entry read from the compile cache failed this start")
        s.counters.captured_graph = ""


class CapturedGraphLoader(_SessionRung):
    name, then = "captured graph", WITHOUT_CACHE

    def __init__(self, model: torch.nn.Module, session: Callable[[], CompileSession]) -> None:
        super().__init__(session)
        self.model = model
        self._settings: Optional[WarmLoadSettings] = None

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Forward:
        s = self._reading()
        s.store.forget_misses()  # a retry after waiting for the compile lock looks again
        start = time.perf_counter()
        record = self._record(s)
        from torch._inductor import config as inductor_config  # imported with the session already
        self._settings = WarmLoadSettings(s.cache.root)
        with inductor_config.patch(self._settings.patches()):
            installed = captured.install_pieces(record["split"], record["pieces"], s.store.get)
        self._settings.check_vec_isa()
        if not installed:
            raise Declined("the entry lacks some of the captured graph's Inductor artifacts")
        s.backend.piece_hashes.update({target: r.piece_hash for target, r in record["pieces"].items()})
        hashes = [r.piece_hash for r in record["pieces"].values()]
        matches = s.backend.pass_matches if s.backend.post_grad_pass is not None else {}
        s.counters.record_load(record["split"], hashes, matches, time.perf_counter() - start)
        s.cache.touch()
        return captured.DirectForward(record["split"], record["sources"], self.model)

    def _record(self, s: CompileSession) -> dict:
        """This configuration's captured graph for the model's code, checked against the model."""
        path = s.cache.find_captured(s.writer.source_fingerprint(self.model))
        record = captured.load_record(path) if path is not None else None
        if record is None:
            raise Declined("no captured graph for this configuration and model code")
        problem = captured.record_problem(record, self.model, path.parent, s.cache.config_key)
        if problem is not None:
            s.counters.cache_errors += 1
            logger.warning("captured graph %s does not fit the model as built now (%s); tracing and "
                           "compiling again", path, problem)
            raise Declined("the captured graph does not fit the model as built now")
        return record

    def settle(self, forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor,
               out: torch.Tensor) -> Forward:
        return self.session().settle(forward, self._settings, input_ids, positions, out) or forward


class _TracingRung(_SessionRung):
    """A rung whose forward traces with Dynamo on its first call."""

    traces = True

    def settle(self, forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor,
               out: torch.Tensor) -> Forward:
        traced = self.session().traced
        return self.session().settle(traced.direct, None, input_ids, positions, out) or traced.direct or traced


class ArtifactsLoader(_TracingRung):
    name, then = "Inductor artifacts", WITHOUT_CACHE

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Forward:
        s = self._reading()
        cache = s.cache
        try:
            found = cache.root is not None and any((cache.root / "compile").glob(f"{cache.config_key}-*/*.bin"))
        except OSError:
            found = False
        if not found:
            raise Declined("the compile cache has no artifacts for this configuration")
        s.traced.restart()
        return s.traced

    def blames_cache(self, before: CompileCounters) -> bool:
        """Only if a piece came from the cache: a trace that loaded nothing failed on its own."""
        return self.session().counters.cache_loads > 0


class FullCompileLoader(_TracingRung):
    name = "full compile"

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Forward:
        s = self.session()
        if s.store.reading:
            s.store.stop_reading("the rung above found nothing to read")
        s.traced.restart()
        return s.traced

    def blames_cache(self, before: CompileCounters) -> bool:
        return False  # nothing read: a failure here is the compile's own, and fails the start
