"""vgraph's Dynamo backend: split at the splitting ops, compile each piece with Inductor
(vgraph's passes as the post-grad custom pass), cache the artifacts."""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from tqdm.auto import tqdm

from ..config import CompileConfig
from . import captured_graph as captured
from . import warm_start
from .cache import CompileCache
from .counters import CompileCounters
from .piece import PieceRunner, TokenDim, find_row_args, find_token_dim
from .split import count_collectives, split_graph
from .warm_load import WarmLoadSettings

logger = logging.getLogger("vgraph")


def _arg_signature(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return [[str(s) for s in arg.shape], str(arg.dtype), [str(s) for s in arg.stride()]]
    return ["sym" if isinstance(arg, torch.SymInt) else type(arg).__name__, str(arg)]


def _target_name(target: Any) -> str:
    """A process-independent name for a node target (reprs of builtins carry addresses)."""
    if isinstance(target, str) or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', type(target).__name__))}"


def structural_hash(gm: torch.fx.GraphModule, args: list) -> str:
    """Identifies a piece by its structure and input shapes, not its node names, so the
    identical middle layers of a model compile (and are cached) once."""
    index = {}
    lines = [repr([_arg_signature(a) for a in args])]
    for i, node in enumerate(gm.graph.nodes):
        index[node] = f"%{i}"
        mapped = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        target = _target_name(node.target) if node.op != "placeholder" else ""
        lines.append(f"{node.op}|{target}|{mapped}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:20]


def graph_hash(gm: torch.fx.GraphModule) -> str:
    return hashlib.sha256(gm.code.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PieceCompile:
    """The Inductor compile running now: which piece of the split graph (``submod_3`` is piece
    3), its structural hash, and the size ("dynamic" or a token count from compile_sizes)."""

    piece: int
    piece_hash: str
    size: str


_COMPILING: contextvars.ContextVar[Optional[PieceCompile]] = contextvars.ContextVar("vgraph_compiling",
                                                                                    default=None)


def compiling_now() -> Optional[PieceCompile]:
    """The piece Inductor is compiling for vgraph in this thread, or None: lets an observer of
    Inductor (the pass report's kernel capture) tell which piece and size its output is for."""
    return _COMPILING.get()


def piece_index(target: str) -> int:
    """``submod_3`` -> 3: split_module names pieces by their position in the split."""
    return int(target.rsplit("_", 1)[-1])


class VgraphBackend:
    """Called by Dynamo with the captured graph; returns the split graph whose compiled
    pieces are ``PieceRunner``s."""

    def __init__(self, config: CompileConfig, post_grad_pass: Optional[Any], cache: CompileCache,
                 counters: Optional[CompileCounters] = None) -> None:
        self.config = config
        self.post_grad_pass = post_grad_pass
        self.cache = cache
        self.counters = counters or CompileCounters()
        self._artifacts: dict[tuple[str, str], Callable] = {}
        self._not_on_disk: set[tuple[str, str]] = set()
        self._graph_matches: dict[str, dict[str, int]] = {}  # piece hash -> pass -> matches
        #: Compiled piece -> its structural hash, in the split's order (identical layers share a hash).
        self.piece_hashes: dict[str, str] = {}
        self._inductor_pass = _RunEveryTime(post_grad_pass) if post_grad_pass is not None else None
        self.dynamo_started: Optional[float] = None  # set by the caller before tracing
        # Set by the caller before tracing: the model and the call's tensors, to bind graph inputs.
        self.capture_context: Optional[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = None
        self.pending_capture: Optional[_PendingCapture] = None
        self._fingerprint: Optional[str] = None
        self._read_disk = config.use_cache and not _dumping(config)  # off after a cached entry failed too
        #: The warm load's Inductor shortcuts (warm_load.py); None until a load looked for them.
        self.warm_settings: Optional[WarmLoadSettings] = None

    def forget_misses(self) -> None:
        """Another process filled the cache meanwhile: look on disk again for what was missing."""
        self._not_on_disk.clear()

    def stop_reading_disk(self) -> None:
        """After a cached entry failed to load or run: forget what was loaded and compile every
        piece from here on (saves still overwrite the entry's files, which repairs it)."""
        self._read_disk = False
        self._artifacts.clear()
        self._not_on_disk.clear()

    @property
    def used_disk(self) -> bool:
        """Whether anything this backend runs came from the compile cache's files."""
        return self.counters.cache_loads > 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        if self.dynamo_started is not None:
            self.counters.dynamo_seconds += time.perf_counter() - self.dynamo_started
        self.counters.graphs_seen += 1
        split, pieces = split_graph(gm, self.config.splitting_ops)
        compiled = {p.name for p in pieces if not p.is_splitting_op}
        self.counters.pieces, self.counters.compiled_pieces = len(pieces), len(compiled)
        self.counters.compiled_collectives = sum(count_collectives(p.module) for p in pieces if p.name in compiled)
        self.cache.bind_graph(graph_hash(gm))
        fake_mode = detect_fake_mode(example_inputs)
        real_by_fake: dict[int, torch.Tensor] = {}
        fake_args = [self._fake(a, fake_mode, real_by_fake) for a in example_inputs]
        symbol = _token_symbol(fake_args)
        split_bytes = captured.stubbed_split_bytes(split, compiled) if self.capture_context else None
        bar = tqdm(total=len(compiled), desc="compiling pieces", unit="piece", leave=False)
        runner = _PieceCompiler(split, compiled, self, symbol, real_by_fake, bar, self._row_wise_tail(pieces))
        with fake_mode:
            runner.run(*fake_args)
        bar.close()
        self._record_pass_matches(runner.piece_hashes)
        self._prepare_capture(split, split_bytes, example_inputs, runner.records, symbol)
        return split

    def _row_wise_tail(self, pieces: list) -> Optional[str]:
        """The piece after the model's last attention, when the model declares everything
        there row-wise (``row_wise_tail``), so it may run on only the rows a step uses."""
        model = self.capture_context[0] if self.capture_context is not None else None
        if not getattr(model, "row_wise_tail", False) or not pieces or pieces[-1].is_splitting_op \
                or not any(p.is_splitting_op for p in pieces):
            return None
        return pieces[-1].name

    def _prepare_capture(self, split: torch.fx.GraphModule, split_bytes: Optional[bytes],
                         example_inputs: list, records: dict[str, captured.PieceRecord], symbol: Any) -> None:
        """Keeps what a direct call of this graph needs, for ``adopt_capture`` to check and save."""
        if split_bytes is None or self.capture_context is None:
            return
        model, call_inputs = self.capture_context
        sources = captured.bind_inputs(example_inputs, model, call_inputs, symbol)
        if sources is not None:
            self.pending_capture = _PendingCapture(split, split_bytes, sources, records)

    def adopt_capture(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                      reference: torch.Tensor) -> Optional[captured.DirectForward]:
        """After the first Dynamo call: the direct call if it reproduces Dynamo's output bit for
        bit on the same inputs (saved for warm starts), else None (Dynamo's frame stays)."""
        pending, self.pending_capture = self.pending_capture, None
        if pending is None:
            return None
        direct = captured.DirectForward(pending.split, pending.sources, model)
        if not torch.equal(direct(input_ids, positions), reference):
            logger.warning("the captured graph called directly differs from Dynamo's frame; "
                           "keeping Dynamo (warm starts will trace again)")
            return None
        if self.config.use_cache:
            self._save_capture(pending, model)
        return direct

    def _save_capture(self, pending: "_PendingCapture", model: torch.nn.Module) -> None:
        built_for = {"config_key": self.cache.config_key, "graph_hash": self.cache.graph_hash,
                     "state": captured.state_signature(model, pending.sources)}
        try:
            path = self.cache.captured_path(self._source_fingerprint(model))
            if path is not None:
                captured.save_record(path, pending.split_bytes, pending.sources, pending.records, built_for)
                self.counters.captured_graph = "saved"
        except OSError as exc:
            logger.warning("could not save the captured graph (%s); warm starts will trace again", exc)

    def load_capture(self, model: torch.nn.Module) -> Optional[captured.DirectForward]:
        """A warm start's forward without Dynamo: the captured graph and every piece's artifacts
        from the cache; None when any of it is missing, unreadable or made for another model."""
        if not self._read_disk:
            return None
        start = time.perf_counter()
        path = self.cache.find_captured(self._source_fingerprint(model))
        record = captured.load_record(path) if path is not None else None
        if record is None:
            return None
        problem = captured.record_problem(record, model, path.parent, self.cache.config_key)
        if problem is not None:
            self.counters.cache_errors += 1
            logger.warning("captured graph %s does not fit the model as built now (%s); tracing and "
                           "compiling again", path, problem)
            return None
        split = record["split"]
        self.warm_settings = WarmLoadSettings(self.cache.root)
        with torch._inductor.config.patch(self.warm_settings.patches()):
            installed = captured.install_pieces(split, record["pieces"], self._load_artifact)
        self.warm_settings.check_vec_isa()
        if not installed:
            logger.info("captured graph found but some artifacts are missing; tracing with Dynamo")
            return None
        hashes = [r.piece_hash for r in record["pieces"].values()]
        self.piece_hashes = {target: r.piece_hash for target, r in record["pieces"].items()}
        c = self.counters
        c.pieces = sum(1 for n in split.graph.nodes if n.op == "call_module")
        c.compiled_pieces, c.unique_piece_graphs = len(hashes), len(set(hashes))
        c.captured_graph, c.captured_load_seconds = "loaded", time.perf_counter() - start
        self._record_pass_matches(hashes)
        direct = captured.DirectForward(split, record["sources"], model)
        self.cache.touch()
        return direct

    def remember_warm_load(self) -> None:
        """After the first forward worked (loaded or compiled): what the next warm load may
        skip (warm_load.py). Nothing without a writable cache."""
        if not self.config.use_cache or not self.cache.writable:
            return
        settings = self.warm_settings or WarmLoadSettings(self.cache.root)
        settings.remember()

    def save_runnables(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                       reference: torch.Tensor) -> Optional[captured.DirectForward]:
        """After the first forward through Inductor's artifacts worked: each piece saved as a
        runnable and the warm index written, so the next start takes the fast path
        (warm_start.py), if the forward built from runnables gives ``reference`` bit for bit.
        Returns that forward, for this start to serve with the code later starts will run;
        None (an info line) when there are none: the next start loads through Inductor too."""
        cache = self.cache
        if cache.warm_key is None or not cache.writable or reference.device.type != "cpu":
            return None
        fingerprint = self._source_fingerprint(model)
        path = cache.record_path(fingerprint)
        record = captured.load_record(path) if path is not None else None
        if record is None:
            return None
        matches = {**cache.loaded_matches, **self._graph_matches}
        try:
            direct, saved, why = warm_start.save_runnables(record, self._artifacts, matches, cache.folder, model,
                                                           lambda forward: forward(input_ids, positions), reference)
        except Exception as exc:  # never costs the start: the next one loads through Inductor
            direct, saved, why = None, 0, f"{type(exc).__name__}: {exc}"
        if direct is None:
            logger.info("no runnables for the fast warm start (%s); warm starts load through Inductor", why)
            return None
        self.counters.runnable_saves = saved
        warm_start.write_index(cache.root, cache.warm_key, cache.config_key, fingerprint)
        return direct

    def _source_fingerprint(self, model: torch.nn.Module) -> str:
        """Read once per start: the warm lookup and the cold save both need it."""
        if self._fingerprint is None:
            self._fingerprint = captured.source_fingerprint(model)
        return self._fingerprint

    def _load_artifact(self, piece_hash: str, label: str) -> Optional[Callable]:
        """One (piece, size) artifact from memory or disk; a missing or unreadable entry is
        remembered, so the fallback compiles it instead of reading (and warning) again."""
        key = (piece_hash, label)
        if key in self._artifacts or key in self._not_on_disk or not self._read_disk:
            return self._artifacts.get(key)
        start = time.perf_counter()
        loaded = self.cache.load(piece_hash, label)
        self.counters.cache_errors += self.cache.take_errors()
        if loaded is None:
            self._not_on_disk.add(key)
            return None
        self.counters.cache_loads += 1
        self.counters.cache_load_seconds += time.perf_counter() - start
        self._artifacts[key] = loaded
        return loaded

    def _record_pass_matches(self, piece_hashes: list[str]) -> None:
        """Matches per site in the model: each compiled piece counts the matches of its graph,
        so identical layers compiled once still count once per layer. Counts of graphs
        loaded from the cache come from their artifacts' headers (written by the compile that
        made them, so they are never another version's)."""
        if self.post_grad_pass is None:
            return
        recorded = {**self.cache.loaded_matches, **self._graph_matches}
        totals: dict[str, int] = {}
        for piece_hash in piece_hashes:
            for name, count in recorded.get(piece_hash, {}).items():
                totals[name] = totals.get(name, 0) + count
        self.counters.pass_matches = totals

    @staticmethod
    def _fake(arg: Any, fake_mode: Any, real_by_fake: dict) -> Any:
        if isinstance(arg, torch.Tensor) and not isinstance(arg, FakeTensor):
            fake = fake_mode.from_tensor(arg)
            real_by_fake[id(fake)] = arg
            return fake
        return arg

    def artifact(self, module: torch.fx.GraphModule, args: list, piece_hash: str, size: Optional[int],
                 real_by_fake: dict, symbol: Any, piece: int = 0) -> Optional[Callable]:
        """The compiled callable for one (piece, size): memory, then disk, then Inductor.
        ``piece`` (the index of the first piece with this graph) labels the compile."""
        label = "dynamic" if size is None else str(size)
        key = (piece_hash, label)
        if key in self._artifacts:
            return self._artifacts[key]
        loaded = self._load_artifact(piece_hash, label)
        if loaded is not None:
            return loaded
        start = time.perf_counter()
        example = args if size is None else _concrete_args(args, size, symbol, real_by_fake)
        if example is None:
            return None
        with self._labelled(PieceCompile(piece, piece_hash, label)):
            artifact = self._inductor(module, example, dynamic=size is None)
        if size is None and self.post_grad_pass is not None:
            self._graph_matches[piece_hash] = dict(getattr(self.post_grad_pass, "last_match_counts", {}))
        self.counters.inductor_seconds += time.perf_counter() - start
        matches = self._graph_matches.get(piece_hash) if size is None else None
        if self.config.use_cache and self.cache.save(artifact, piece_hash, label, matches):
            self.counters.cache_saves += 1
        self._artifacts[key] = artifact
        return artifact

    @contextlib.contextmanager
    def _labelled(self, compile_: PieceCompile) -> Iterator[None]:
        """Tells observers what is being compiled: ``compiling_now()``, and the pass manager's
        labels (its graph dumps and history name the piece and size)."""
        token = _COMPILING.set(compile_)
        label = getattr(self.post_grad_pass, "labelled", None)
        try:
            with label(piece=compile_.piece, size=compile_.size) if label else contextlib.nullcontext():
                yield
        finally:
            _COMPILING.reset(token)

    def _inductor(self, module: torch.fx.GraphModule, example: list, dynamic: bool) -> Any:
        self.counters.inductor_compilations += 1
        patches = {}
        if self.post_grad_pass is not None:
            patches["post_grad_custom_post_pass"] = self._inductor_pass
        mode = "from_tracing_context" if dynamic else "from_example_inputs"
        return torch._inductor.standalone_compile(module, example, dynamic_shapes=mode,
                                                  options={"config_patches": patches})


def _dumping(config: CompileConfig) -> bool:
    """Whether graphs are dumped: then nothing is read from the compile cache, because a piece
    loaded from it runs no pass and dumps nothing (the new artifacts are still saved)."""
    if not config.dump_graphs_dir:
        return False
    if config.use_cache:
        logger.info("dump_graphs_dir is set: compiling every piece without reading the compile cache, so "
                    "each graph is dumped to %s (the compiled artifacts are still saved)", config.dump_graphs_dir)
    return True


@dataclass
class _PendingCapture:
    """The cold start's graph, bound and stubbed, waiting for the bit-exactness check."""

    split: torch.fx.GraphModule
    split_bytes: bytes
    sources: list
    records: dict[str, captured.PieceRecord]


class _RunEveryTime(CustomGraphPass):
    """The pass manager as Inductor sees it, with a uuid unique to this backend.

    On a hit in Inductor's own FX-graph cache no post-grad pass runs, so match counts would
    read 0. vgraph's artifact cache (keyed by the manager's real uuid) serves warm starts, so
    Inductor's cache is made to miss here and the passes run whenever Inductor compiles.
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.nonce = uuid.uuid4().hex

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.manager(graph)

    def uuid(self) -> str:
        return f"{self.manager.uuid()}-{self.nonce}"


def _token_symbol(fake_args: list) -> Any:
    """The symbol of the token dimension: dim 0 of the first tensor input with a symbolic dim 0."""
    for arg in fake_args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0 and isinstance(arg.shape[0], torch.SymInt):
            return arg.shape[0].node.expr
    return None


def _concrete(value: Any, symbol: Any, size: int) -> Optional[int]:
    if not isinstance(value, torch.SymInt):
        return int(value)
    expr = value.node.expr.subs(symbol, size)
    return int(expr) if expr.is_number else None


def _has_symbols(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride()))


def _concrete_args(args: list, size: int, symbol: Any, real_by_fake: dict) -> Optional[list]:
    """Real example inputs with the token count fixed to ``size`` (weights reused as they are)."""
    out = []
    with unset_fake_temporarily():
        for arg in args:
            if id(arg) in real_by_fake and not _has_symbols(arg):
                out.append(real_by_fake[id(arg)])  # weights: the real tensor, no copy
            elif isinstance(arg, torch.Tensor):
                shape = [_concrete(s, symbol, size) for s in arg.shape]
                stride = [_concrete(s, symbol, size) for s in arg.stride()]
                if None in shape or None in stride:
                    return None  # depends on another symbol: only the dynamic artifact serves
                out.append(torch.empty_strided(shape, stride, dtype=arg.dtype, device=arg.device).zero_())
            else:
                value = _concrete(arg, symbol, size)
                if value is None:
                    return None
                out.append(value)
    return out


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on fake inputs; at each compiled piece, compiles it with the
    inputs it actually receives and swaps in a ``PieceRunner``."""

    def __init__(self, split: torch.fx.GraphModule, compiled: set[str], backend: VgraphBackend,
                 symbol: Any, real_by_fake: dict, bar: Any, row_wise_tail: Optional[str]) -> None:
        super().__init__(split)
        self.split, self.compiled, self.backend = split, compiled, backend
        self.symbol, self.real_by_fake, self.bar = symbol, real_by_fake, bar
        self.row_wise_tail = row_wise_tail
        self.unique: set[str] = set()
        self.piece_hashes: list[str] = []
        self.records: dict[str, captured.PieceRecord] = {}

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        out = super().call_module(target, args, kwargs)
        if target in self.compiled:
            self._compile(target, list(args), out)
        return out

    def _compile(self, target: str, args: list, out: Any) -> None:
        module = getattr(self.split, target)
        piece_hash = structural_hash(module, args)
        self.unique.add(piece_hash)
        self.piece_hashes.append(piece_hash)
        self.backend.counters.unique_piece_graphs = len(self.unique)
        b = self.backend
        b.piece_hashes[target] = piece_hash
        index = piece_index(target)
        dynamic = b.artifact(module, args, piece_hash, None, self.real_by_fake, self.symbol, index)
        static = {}
        for size in b.config.compile_sizes:
            art = b.artifact(module, args, piece_hash, size, self.real_by_fake, self.symbol, index)
            if art is not None:
                static[size] = art
        token_dim: Optional[TokenDim] = find_token_dim(args, self.symbol)
        single = not isinstance(out, (tuple, list))
        row_args = find_row_args(args, self.symbol) if target == self.row_wise_tail else None
        self.records[target] = captured.PieceRecord(piece_hash, tuple(static), token_dim, single, row_args)
        setattr(self.split, target, PieceRunner(dynamic, static, token_dim, single, row_args))
        self.bar.update(1)
