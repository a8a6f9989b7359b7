"""vgraph's Dynamo backend: split at the splitting ops, compile each piece with Inductor
(vgraph's passes as the post-grad custom pass). It only compiles: a piece the start already
holds comes from the artifact store (artifact_store.py), and what it compiled goes to the
cache writer (cache_writer.py); the ladder (build.py) decides whether the store reads the
compile cache at all."""
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
from .artifact_store import ArtifactStore
from .cache import CompileCache
from .cache_writer import CacheWriter
from .counters import CompileCounters, pass_totals
from .piece import PieceRunner, TokenDim, find_row_args, find_token_dim
from .split import count_collectives, split_graph

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
        self.store = ArtifactStore(cache, self.counters, _not_reading(config))
        self.writer = CacheWriter(cache, self.counters, config.use_cache)
        self._graph_matches: dict[str, dict[str, int]] = {}  # piece hash -> pass -> matches
        #: Compiled piece -> its structural hash, in the split's order (identical layers share a hash).
        self.piece_hashes: dict[str, str] = {}
        self._inductor_pass = _RunEveryTime(post_grad_pass) if post_grad_pass is not None else None
        self.dynamo_started: Optional[float] = None  # set by the caller before tracing
        # Set by the caller before tracing: the model and the call's tensors, to bind graph inputs.
        self.capture_context: Optional[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = None
        self.pending_capture: Optional[_PendingCapture] = None

    @property
    def pass_matches(self) -> dict[str, dict[str, int]]:
        """Piece hash -> pass -> matches, for every graph this start compiled or loaded (the
        counts of loaded ones come from their artifacts' headers)."""
        return {**self.cache.loaded_matches, **self._graph_matches}

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
                           "keeping Dynamo (warm starts will trace again; its trace guards on two rows or "
                           "more, so one-row batches run padded to two and buckets of 1 are not captured)")
            return None
        self.writer.captured(model, pending.split_bytes, pending.sources, pending.records)
        return direct

    def _record_pass_matches(self, piece_hashes: list[str]) -> None:
        if self.post_grad_pass is not None:
            self.counters.pass_matches = pass_totals(piece_hashes, self.pass_matches)

    @staticmethod
    def _fake(arg: Any, fake_mode: Any, real_by_fake: dict) -> Any:
        if isinstance(arg, torch.Tensor) and not isinstance(arg, FakeTensor):
            fake = fake_mode.from_tensor(arg)
            real_by_fake[id(fake)] = arg
            return fake
        return arg

    def artifact(self, module: torch.fx.GraphModule, args: list, piece_hash: str, size: Optional[int],
                 real_by_fake: dict, symbol: Any, piece: int = 0) -> Optional[Callable]:
        """The compiled callable for one (piece, size): the store's, else Inductor's.
        ``piece`` (the index of the first piece with this graph) labels the compile."""
        label = "dynamic" if size is None else str(size)
        loaded = self.store.get(piece_hash, label)
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
        self.writer.artifact(artifact, piece_hash, label, self._graph_matches.get(piece_hash) if size is None else None)
        self.store.keep(piece_hash, label, artifact)
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


def _not_reading(config: CompileConfig) -> str:
    """Why the compile cache's artifacts are not read this start, or ''. With graphs dumped,
    nothing is read, because a piece loaded from the cache runs no pass and dumps nothing (the
    new artifacts are still saved)."""
    if not config.use_cache:
        return "the compile cache is off"
    if not config.dump_graphs_dir:
        return ""
    logger.info("dump_graphs_dir is set: compiling every piece without reading the compile cache, so "
                "each graph is dumped to %s (the compiled artifacts are still saved)", config.dump_graphs_dir)
    return "graphs are dumped (dump_graphs_dir), so every piece is compiled"


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
