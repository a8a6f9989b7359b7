"""PIECEWISE CUDA graphs: one graph per compiled piece per token bucket, and the capture
primitives every CUDA graph of vgraph is recorded with.

The split graph runs as usual and each ``PieceRunner`` (piece.py) hands its call to the
``PiecewiseGraphs`` carried by the current forward context (``ForwardContext.piecewise``,
set by the worker's graph runner), which captures or replays that piece's graph for the
call's token count. Attention runs eagerly between the pieces, so mixed prefill/decode
batches are served. A piece's inputs are either weights (same tensor every call), the
previous piece's graph outputs (same address on every replay), the attention output (which
the attention op writes into a persistent per-layer buffer it gets from here, so it too has
one address per token count), or fresh tensors (the padded input ids and positions), which
are copied into persistent staging buffers before replay. Outputs are copied, inside the
graph, into persistent output buffers, so nothing a graph allocated stays alive after
capture.

Every graph of an engine shares one memory pool and is captured largest first: scratch of
smaller captures fits in what the larger ones freed, so the pool costs about one forward's
activations at the largest bucket. Buffers of a slot are sized by the largest capture and
smaller buckets use their leading rows. FULL graphs of the whole forward live with the
runner that owns their input buffers (vgraph/worker/cuda_graphs.py).
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from . import capture_safety
from .capture_safety import CaptureRegion


class _Buffers:
    """Persistent tensors by slot, shared across token counts: a slot's tensor is made by its
    first (largest) capture with that capture's strides, and smaller counts use its leading
    rows (same strides: compiled pieces check the strides of their inputs). A tensor that
    does not fit that pattern (strides that depend on the count, a larger count after a
    smaller one) gets a tensor of its own."""

    def __init__(self) -> None:
        self._shared: dict[Any, torch.Tensor] = {}

    def like(self, slot: Any, template: torch.Tensor) -> torch.Tensor:
        buf = self._shared.get(slot)
        if buf is not None and _leading_rows_fit(buf, template):
            return buf[:template.shape[0]]
        new = _empty_like_layout(template)
        if buf is None and template.dim() > 0:
            self._shared[slot] = new
        return new

    def rows(self, slot: Any, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of ``shape``: the slot's leading rows when they fit."""
        buf = self._shared.get(slot)
        if (buf is not None and buf.dtype == dtype and buf.device == device
                and buf.shape[1:] == shape[1:] and buf.shape[0] >= shape[0]):
            return buf[:shape[0]]
        new = torch.empty(shape, dtype=dtype, device=device)
        if buf is None:
            self._shared[slot] = new
        return new


def _leading_rows_fit(buf: torch.Tensor, t: torch.Tensor) -> bool:
    return (t.dim() > 0 and buf.dtype == t.dtype and buf.device == t.device and buf.shape[1:] == t.shape[1:]
            and buf.shape[0] >= t.shape[0] and buf.stride() == t.stride())


def _empty_like_layout(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor with ``t``'s sizes and strides (contiguous if ``t`` overlaps itself, as
    an expanded tensor does: nothing could be copied into that layout)."""
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)


def _flat(out: Any) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def new_graph() -> Any:
    return torch.cuda.CUDAGraph()


def record(graph: Any, pool: Any, body: Callable[[], Any], region: CaptureRegion) -> None:
    """Captures what ``body`` launches into ``graph``. Replaying a graph re-runs the body's
    kernels on the same addresses, i.e. is ``body()`` again with whatever the buffers hold
    then; tests emulate CUDA graphs on CPU by replacing these two functions on that basis.
    ``region`` says what the body may touch: with ``VGRAPH_CHECK_CAPTURE=1`` the body runs
    under the capture-safety check (capture_safety.py), as it always does in CI."""
    run = region.checked(body) if capture_safety.enabled() else body
    with torch.cuda.graph(graph, pool=pool):
        run()


# ---------------------------------------------------------------------------------- PIECEWISE


def _region_of(inputs: Sequence, outs: Sequence) -> CaptureRegion:
    """A piece's graph owns exactly what it reads in place (weights, staged inputs, earlier
    graphs' outputs) and its output buffers: everything else it touches is its own scratch."""
    tensors = [t for t in list(inputs) + list(outs) if isinstance(t, torch.Tensor)]
    return CaptureRegion(tensors[0].device if tensors else "cpu", tensors)


@dataclass
class _PieceGraph:
    graph: torch.cuda.CUDAGraph
    inputs: list  # what the graph reads, per argument (a tensor, or the value it was captured with)
    copied: tuple[int, ...]  # arguments that may arrive at another address and are copied in
    outputs: list  # persistent output views (or non-tensor values)
    # Tensor arguments read in place (weights): a replay needs the very objects captured.
    in_place: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.in_place = tuple(i for i, t in enumerate(self.inputs)
                              if isinstance(t, torch.Tensor) and i not in self.copied)


class PieceGraphs:
    """One compiled piece's graphs, one per token count."""

    def __init__(self) -> None:
        self.graphs: dict[int, _PieceGraph] = {}
        self._staging, self._outs = _Buffers(), _Buffers()
        self._out_views: dict[int, list] = {}
        self._warm_args: dict[int, tuple] = {}
        self.staged_copies = 0  # per-call inputs copied into staging buffers by replays

    def warm_up(self, num_tokens: int, fn: Callable, args: Sequence) -> list:
        """Runs the piece plainly and prepares the output buffers of ``num_tokens`` (they must
        exist before capture: anything allocated during capture belongs to the graph pool).
        Keeps the arguments, so the capture can tell weights (the same tensor objects again)
        from per-call tensors."""
        out = _flat(fn(*args))
        self._warm_args[num_tokens] = tuple(args)
        if num_tokens not in self._out_views:
            self._out_views[num_tokens] = [self._outs.like(j, o) if isinstance(o, torch.Tensor) else o
                                           for j, o in enumerate(out)]
        return out

    def capture(self, num_tokens: int, fn: Callable, args: Sequence, pool: Any,
                produced: set[int]) -> list:
        """Captures the piece for ``num_tokens``; ``produced`` holds the addresses of outputs
        of graphs captured earlier in this forward, which this graph may read in place."""
        inputs, copied = self._static_inputs(args, self._warm_args.pop(num_tokens, ()), produced)
        outs = self._out_views[num_tokens]

        def body() -> None:
            for dst, value in zip(outs, _flat(capture_safety.call_opaque(fn, inputs))):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(value)

        graph = new_graph()
        record(graph, pool, body, _region_of(inputs, outs))
        graph.replay()  # capture records without running: make this call's outputs real
        self.graphs[num_tokens] = _PieceGraph(graph, inputs, copied, outs)
        return outs

    def forget_warm_up(self) -> None:
        self._warm_args.clear()

    def _static_inputs(self, args: Sequence, warm_args: Sequence,
                       produced: set[int]) -> tuple[list, tuple[int, ...]]:
        inputs, copied = [], []
        for i, arg in enumerate(args):
            same_object = i < len(warm_args) and warm_args[i] is arg
            if not isinstance(arg, torch.Tensor) or same_object or isinstance(arg, torch.nn.Parameter):
                inputs.append(arg)  # weights and constants: read in place
                continue
            copied.append(i)
            if arg.data_ptr() in produced:
                inputs.append(arg)  # a graph output: replays write it at this very address
            else:
                staged = self._staging.like(i, arg)
                staged.copy_(arg)
                inputs.append(staged)
        return inputs, tuple(copied)

    def replay(self, num_tokens: int, args: Sequence) -> Optional[list]:
        """The outputs for this call, or None when no graph exists for ``num_tokens``."""
        entry = self.graphs.get(num_tokens)
        if entry is None or any(args[i] is not entry.inputs[i] for i in entry.in_place):
            return None  # a weight was replaced since capture: the graph would read the old one
        for i in entry.copied:
            static, arg = entry.inputs[i], args[i]
            if arg.data_ptr() != static.data_ptr():
                static.copy_(arg)
                self.staged_copies += 1
        entry.graph.replay()
        return entry.outputs


class Phase(enum.Enum):
    WARMUP = "warmup"  # run plainly, prepare buffers
    CAPTURE = "capture"
    REPLAY = "replay"


class PiecewiseGraphs:
    """Every piece's graphs for one compiled model, keyed by the ``PieceRunner``."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._pieces: dict[int, tuple[Any, PieceGraphs]] = {}  # id(runner) -> (runner, graphs)
        self._attention_outputs = _Buffers()  # by layer index
        self._produced: set[int] = set()
        self.misses = 0  # replays that found no graph for their token count (ran plainly)

    @contextlib.contextmanager
    def forward(self, phase: Phase) -> Iterator["PiecewiseRun"]:
        """One forward's worth of piece calls in ``phase``: put the yielded handle on the
        forward context (``ForwardContext.piecewise``) and every piece goes through here."""
        self._produced = set()
        try:
            yield PiecewiseRun(self, phase)
        finally:
            if phase is Phase.CAPTURE:
                for _, graphs in self._pieces.values():
                    graphs.forget_warm_up()

    def run(self, phase: Phase, runner: Any, fn: Callable, args: Sequence, num_tokens: int) -> list:
        graphs = self._graphs_of(runner)
        if phase is Phase.WARMUP:
            return graphs.warm_up(num_tokens, fn, args)
        out = graphs.replay(num_tokens, args) if num_tokens in graphs.graphs else None
        if out is None and phase is Phase.CAPTURE:
            out = graphs.capture(num_tokens, fn, args, self.pool, self._produced)
        if out is None:
            self.misses += 1
            return _flat(fn(*args))
        if phase is Phase.CAPTURE:
            self._produced.update(o.data_ptr() for o in out if isinstance(o, torch.Tensor))
        return out

    def attention_output(self, phase: Phase, layer_idx: int, shape: torch.Size, dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
        """Layer ``layer_idx``'s attention output buffer: one per layer (a piece may still be
        reading one layer's output when the next layer's attention runs), sized by the first
        and largest call, smaller token counts using its leading rows. A capture marks it as
        produced, so the next piece's graph reads it in place and replays copy nothing."""
        out = self._attention_outputs.rows(layer_idx, shape, dtype, device)
        if phase is Phase.CAPTURE:
            self._produced.add(out.data_ptr())
        return out

    def _graphs_of(self, runner: Any) -> PieceGraphs:
        entry = self._pieces.get(id(runner))
        if entry is None:
            entry = self._pieces[id(runner)] = (runner, PieceGraphs())
        return entry[1]

    @property
    def num_graphs(self) -> int:
        return sum(len(g.graphs) for _, g in self._pieces.values())

    @property
    def staged_copies(self) -> int:
        """Inputs copied into staging buffers before replays, over every piece so far."""
        return sum(g.staged_copies for _, g in self._pieces.values())


@dataclass(frozen=True)
class PiecewiseRun:
    """What a forward context carries for PIECEWISE graphs: whose graphs, and in which phase."""

    graphs: PiecewiseGraphs
    phase: Phase

    def run(self, runner: Any, fn: Callable, args: Sequence, num_tokens: int) -> list:
        return self.graphs.run(self.phase, runner, fn, args, num_tokens)

    def attention_output(self, layer_idx: int, shape: torch.Size, dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
        return self.graphs.attention_output(self.phase, layer_idx, shape, dtype, device)
