"""The runner's forward on the dispatcher's path, and the CUDA graphs it replays.

``ForwardRunner`` owns everything about graphs at run time: the dispatcher's decision for a
scheduled step, the persistent decode buffers and the FULL graphs captured over them, the
PIECEWISE graphs of the compiled pieces (kept per piece in vgraph/compiler/piecewise_graphs.py;
this class decides when they run and in which phase, through the forward context), the
capture itself, and the estimate of the memory capture takes (needed before the KV cache is
sized, while graphs can only be captured after it exists).

FULL: for decode bucket B the forward, attention included, is captured over persistent
input buffers (``DecodeBuffers``): the attention op reads its metadata from the forward
context at capture time, so the kernels' pointers are those buffers' and each batch is
copied *into* them before replay. Host-side choices the attention op makes
(``max_query_len`` = 1, the split-KV count) are fixed per graph. The output is copied,
inside the graph, into one persistent hidden-state buffer. A verify bucket (speculative
decoding: S sequences of k + 1 rows each) is captured the same way over the same buffers,
with ``max_query_len`` = k + 1 and its own ``query_start_loc`` (``0, k+1, 2(k+1), ..``).

Without CUDA nothing is captured and the same decisions and padding run the compiled
forward at the padded size (vgraph/worker/dispatch.py).
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence
from unittest import mock

import numpy as np
import torch
from tqdm.auto import tqdm

from vgraph.ops.forward_context import AttentionMetadata, ForwardContext, set_forward_context

from ..compiler import piecewise_graphs
from ..compiler.capture_safety import CaptureRegion
from ..compiler.piecewise_graphs import Phase, PiecewiseGraphs
from ..config import CudaGraphMode
from .runner_requests import RunnerStep
from .batch import BatchBuilder, FlatBatch, StageInput
from .dispatch import BatchShape, Buckets, Decision, Path, choose
from .dummy import DummySource

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Device memory of a captured graph itself (its kernel nodes and their parameters), besides
# the pool and buffers: deliberately generous, since running out of memory mid-capture is
# worse than a few hundred KV blocks fewer.
FULL_GRAPH_BYTES = 4 << 20
PIECE_GRAPH_BYTES = 256 << 10


@dataclass
class DecodeInputs:
    """The model inputs and attention metadata of one FULL bucket: views of ``DecodeBuffers``."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata


class DecodeBuffers:
    """Persistent inputs of FULL buckets, allocated once for the largest one; bucket B uses
    views of the first B rows, so a graph captured over those views reads whatever ``fill``
    copied in before replay. Every sequence of a FULL decode batch owns exactly one row, so
    its ``query_start_loc`` is ``0..B``; a verify batch's sequences own ``verify_query_len``
    rows each. Both are written once, here."""

    @torch.inference_mode()
    def __init__(self, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 stage_input: Optional[StageInput] = None, verify_query_len: int = 0,
                 max_verify_seqs: int = 0) -> None:
        """``stage_input``: on a later pipeline stage the inputs are the previous stage's rows.
        ``verify_query_len`` and ``max_verify_seqs``: the verify buckets' shape (0: none)."""
        # Inference tensors, like every other input the runner makes: the compiled forward
        # guards on that, and on Dynamo's frame an ordinary tensor would be a recompile.
        long, i32 = dict(dtype=torch.long, device=device), dict(dtype=torch.int32, device=device)
        self.max_seqs = max(max_seqs, max_verify_seqs)
        self.max_rows = max(max_seqs, max_verify_seqs * verify_query_len)
        rows, seqs = self.max_rows, self.max_seqs
        if stage_input is None:
            self.input_ids = torch.zeros(rows, **long)
        else:
            self.input_ids = torch.zeros((rows, stage_input.width), dtype=stage_input.dtype, device=device)
        self.positions = torch.zeros(rows, **long)
        self.slot_mapping = torch.full((rows,), -1, **long)
        self.block_table = torch.zeros((seqs, max(1, max_blocks_per_seq)), **i32)
        self.seq_lens = torch.zeros(seqs, **i32)
        # query_start_loc per rows-per-sequence: 1 (decode) and k + 1 (verify)
        self.query_start_locs = {1: torch.arange(max_seqs + 1, **i32)}
        if verify_query_len > 1:
            self.query_start_locs[verify_query_len] = torch.arange(max_verify_seqs + 1, **i32) * verify_query_len
        # The sample rows of a decode whose every row samples (0..B-1): never uploaded per step.
        self.row_indices = torch.arange(rows, **long)
        self._views: dict[tuple[int, int], DecodeInputs] = {}

    @property
    def query_start_loc(self) -> torch.Tensor:
        """The decode buckets' ``0..B``."""
        return self.query_start_locs[1]

    @torch.inference_mode()
    def fill(self, batch: FlatBatch) -> DecodeInputs:
        """Copies a FULL batch (already padded to its bucket by the builder) in place and
        returns the bucket's views (the same objects every time: the metadata a graph was
        captured with is the metadata it replays with). A batch the builder wrote here
        already (``write``) is not copied again."""
        meta, rows = batch.attn_metadata, batch.num_tokens
        seqs, q = meta.num_seqs, meta.max_query_len
        if batch.resident:  # checked, viewed and written by ``write``
            return self._views[(rows, q)]
        self._check(rows, seqs, q, meta.block_table.shape[1])
        view = self._bucket_view(rows, seqs, q, meta.max_seq_len, meta.num_kv_splits)
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.seq_lens[:seqs].copy_(meta.seq_lens)
        # Columns past the batch's width keep stale ids: no sequence reads past its length.
        self.block_table[:seqs, :meta.block_table.shape[1]].copy_(meta.block_table)
        return view

    @torch.inference_mode()
    def write(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
              table: np.ndarray, max_seq_len: int, num_kv_splits: int) -> DecodeInputs:
        """A FULL batch's host arrays (padded to its bucket) copied straight into the buffers;
        returns the bucket's views. Why: each array then crosses once, into the place the graph
        reads, where a batch tensor of its own and a second copy before replay (``fill``) were
        two driver calls per array on a GPU host's clock every step."""
        rows, seqs = ids.shape[0], seq_lens.shape[0]
        q = rows // max(seqs, 1)
        self._check(rows, seqs, q, table.shape[1])
        view = self._bucket_view(rows, seqs, q, max_seq_len, num_kv_splits)
        for buffer, array in ((self.input_ids, ids), (self.positions, positions), (self.slot_mapping, slots),
                              (self.seq_lens, seq_lens)):
            buffer[:array.shape[0]].copy_(torch.from_numpy(array), non_blocking=True)
        # Columns past the batch's width keep stale ids: no sequence reads past its length.
        self.block_table[:seqs, :table.shape[1]].copy_(torch.from_numpy(table), non_blocking=True)
        return view

    def _bucket_view(self, rows: int, seqs: int, q: int, max_seq_len: int, num_kv_splits: int) -> DecodeInputs:
        """The bucket's views, made on first use and the same objects from then on."""
        view = self._views.get((rows, q))
        if view is None:
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:rows], block_table=self.block_table[:seqs],
                query_start_loc=self.query_start_locs[q][:seqs + 1], seq_lens=self.seq_lens[:seqs],
                max_query_len=q, max_seq_len=max_seq_len, num_kv_splits=num_kv_splits)
            view = self._views[(rows, q)] = DecodeInputs(self.input_ids[:rows], self.positions[:rows], meta)
        return view

    def tensors(self) -> list[torch.Tensor]:
        """Every persistent buffer (what FULL graphs read in place, and the sample rows)."""
        return [self.input_ids, self.positions, self.slot_mapping, self.block_table, self.seq_lens,
                *self.query_start_locs.values(), self.row_indices]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def _check(self, n: int, seqs: int, q: int, width: int) -> None:
        """``n`` rows in ``seqs`` sequences of ``q`` rows each, block tables ``width`` wide."""
        if q not in self.query_start_locs or n != seqs * q:
            raise ValueError(f"not a FULL batch: {n} tokens in {seqs} sequences, max_query_len {q}")
        if n > self.max_rows or seqs > self.query_start_locs[q].shape[0] - 1:
            raise ValueError(f"{seqs} sequences of {q} rows exceed the largest FULL bucket")
        if width > self.block_table.shape[1]:
            raise ValueError(f"block table of width {width} exceeds the "
                             f"persistent buffer's {self.block_table.shape[1]} (max_model_len / block_size)")


class FullGraphs:
    """One graph of the whole forward per FULL bucket, writing one persistent output. A bucket
    is keyed by its rows and rows per sequence: (B, 1) for decode, (S * (k + 1), k + 1) for
    verify."""

    def __init__(self, pool: Any, max_rows: int) -> None:
        self.pool, self.max_rows = pool, max_rows
        self.graphs: dict[tuple[int, int], Any] = {}
        self.hidden: Optional[torch.Tensor] = None  # [max rows, hidden], written by every graph

    def capture(self, key: tuple[int, int], run: Callable[[], torch.Tensor],
                persistent: Sequence[torch.Tensor]) -> None:
        """``run`` is the forward over the bucket's buffers, in its forward context;
        ``persistent`` what it may read in place (input buffers, weights, KV caches)."""
        warm = run()  # compiles Triton kernels; sizes the output buffer
        if self.hidden is None:
            self.hidden = warm.new_empty((self.max_rows, *warm.shape[1:]))
        del warm
        hidden, rows = self.hidden, key[0]
        graph = piecewise_graphs.new_graph()
        region = CaptureRegion(hidden.device, [*persistent, hidden])
        piecewise_graphs.record(graph, self.pool, lambda: hidden[:rows].copy_(run()), region)
        self.graphs[key] = graph

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        self.graphs[key].replay()
        return self.hidden[:key[0]]


@dataclass
class CaptureReport:
    full_graphs: int = 0  # decode and verify buckets
    verify_graphs: int = 0  # of which verify (speculative decoding)
    piecewise_graphs: int = 0
    piecewise_buckets: int = 0
    seconds: float = 0.0
    memory_bytes: int = 0  # device memory the capture took (pool, buffers, graph objects)
    estimated_bytes: int = 0  # what the KV sizing reserved for it

    def summary(self) -> str:
        verify = f", {self.verify_graphs} of them verify" if self.verify_graphs else ""
        return (f"captured CUDA graphs: {self.full_graphs} FULL (decode buckets{verify}), "
                f"{self.piecewise_graphs} PIECEWISE ({self.piecewise_buckets} token buckets x pieces) "
                f"in {self.seconds:.2f} s; graph memory {self.memory_bytes / 2**30:.3f} GiB "
                f"(reserved {self.estimated_bytes / 2**30:.3f} GiB)")


class ForwardRunner:
    """Runs every built batch on the path the dispatcher chose (a FULL graph, PIECEWISE graphs or
    the plain compiled or eager forward), and captures the graphs it replays."""

    def __init__(self, forward: Forward, kv_caches: Sequence, softmax_scale: float, builder: BatchBuilder,
                 mode: CudaGraphMode, buckets: Buckets,
                 weights: Sequence[torch.Tensor] = (), kv_scales: Optional[Sequence] = None) -> None:
        self.forward_fn = forward
        self.weights = list(weights)  # the model's parameters and buffers: FULL graphs read them in place
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales  # an fp8 cache's per-layer (k_scale, v_scale), else None
        self.softmax_scale = softmax_scale
        self.builder = builder
        self.mode = mode
        self.buckets = buckets if mode is not CudaGraphMode.NONE else Buckets((), ())
        self.decode_buffers: Optional[DecodeBuffers] = None
        b = self.buckets
        if mode.has_full and (b.full or b.verify):
            max_blocks = -(-builder.max_model_len // builder.block_size)
            self.decode_buffers = DecodeBuffers(max(b.full, default=0), max_blocks, builder.device,
                                                builder.stage_input, b.verify_query_len, max(b.verify, default=0))
        self.full_graphs: Optional[FullGraphs] = None
        self.piecewise_graphs: Optional[PiecewiseGraphs] = None
        self.dispatch_counts: Counter[tuple[Path, int]] = Counter()  # (path, padded size) -> batches

    # ------------------------------------------------------------------ one batch

    @property
    def min_rows(self) -> int:
        """The fewest rows the forward serves (``LadderForward.min_rows``; one for any other)."""
        return getattr(self.forward_fn, "min_rows", 1)

    def decide(self, step: RunnerStep) -> Decision:
        return choose(BatchShape.of_step(step), self.buckets, self.mode, self.min_rows)

    def build(self, step: RunnerStep) -> tuple[FlatBatch, Decision]:
        """The step's batch; a FULL one written straight into the decode buffers."""
        decision = self.decide(step)
        return self.builder.build(step, decision, self.decode_buffers), decision

    def run(self, batch: FlatBatch, decision: Decision) -> torch.Tensor:
        """Hidden states of the batch's real rows (padding dropped), or of its
        ``output_rows`` alone when the model's tail ran on those. The result may be a view of a
        persistent buffer: consume it before the next forward."""
        self.dispatch_counts[(decision.path, decision.bucket)] += 1
        if decision.path is Path.FULL:
            hidden = self._run_full(batch, decision)
        else:
            replay = decision.path is Path.PIECEWISE and self.piecewise_graphs is not None
            hidden = self._forward(batch, Phase.REPLAY if replay else None)
        return hidden[:batch.num_scheduled]

    def _run_full(self, batch: FlatBatch, decision: Decision) -> torch.Tensor:
        inputs = self.decode_buffers.fill(batch)
        key = (decision.bucket, decision.query_len)
        if self.full_graphs is not None and key in self.full_graphs.graphs:
            return self.full_graphs.replay(key)
        return self._forward_inputs(inputs.input_ids, inputs.positions, inputs.attn_metadata, None)

    def _forward(self, batch: FlatBatch, phase: Optional[Phase]) -> torch.Tensor:
        return self._forward_inputs(batch.input_ids, batch.positions, batch.attn_metadata, phase,
                                    batch.output_rows)

    def _forward_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        phase: Optional[Phase], output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The one place a forward context is made: metadata, caches, how pieces run, and the
        rows the step uses (the forward may return only those: ``FlatBatch.used_hidden``)."""
        pieces = self.piecewise_graphs.forward(phase) if phase is not None else contextlib.nullcontext()
        with pieces as run:
            context = ForwardContext(meta, self.kv_caches, self.softmax_scale, piecewise=run,
                                     output_rows=output_rows, kv_scales=self.kv_scales)
            with set_forward_context(context):
                return self.forward_fn(input_ids, positions)

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture(self, pool: Any, dummies: DummySource) -> CaptureReport:
        """Captures a FULL graph per decode and verify bucket, then every piece's graph per
        token bucket, largest first, with a progress bar; measures the device memory it took."""
        device = self.builder.device
        full_jobs = self._full_jobs() if self.decode_buffers is not None else []
        piece_jobs = sorted(self.buckets.piecewise, reverse=True) if self.mode.has_piecewise else []
        # Buckets below the forward's fewest rows are never chosen (``choose``): none captured.
        full_jobs = [job for job in full_jobs if job[0] >= self.min_rows]
        piece_jobs = [n for n in piece_jobs if n >= self.min_rows]
        self.full_graphs = FullGraphs(pool, self.decode_buffers.max_rows) if full_jobs else None
        self.piecewise_graphs = PiecewiseGraphs(pool) if piece_jobs else None
        start = time.perf_counter()
        with _quick_captures(device):
            free_before = _free_bytes(device)
            with tqdm(total=len(full_jobs) + len(piece_jobs), desc="capturing CUDA graphs",
                      unit="bucket", leave=False) as bar:
                for key in full_jobs:
                    self._capture_full(*key)
                    bar.update(1)
                for num_tokens in piece_jobs:
                    self._capture_pieces(num_tokens, dummies)
                    bar.update(1)
            used = max(0, free_before - _free_bytes(device))
        if self.decode_buffers is not None and device.type == "cuda":
            used += self.decode_buffers.nbytes  # allocated before the baseline; estimated with the rest
        return CaptureReport(full_graphs=len(full_jobs), verify_graphs=sum(q > 1 for _, q in full_jobs),
                             piecewise_buckets=len(piece_jobs),
                             piecewise_graphs=self.piecewise_graphs.num_graphs if self.piecewise_graphs else 0,
                             seconds=time.perf_counter() - start, memory_bytes=used)

    def _full_jobs(self) -> list[tuple[int, int]]:
        """(rows, rows per sequence) of every FULL graph, largest first."""
        q = self.buckets.verify_query_len
        jobs = [(b, 1) for b in self.buckets.full] + [(s * q, q) for s in self.buckets.verify]
        return sorted(jobs, reverse=True)

    def _capture_full(self, rows: int, query_len: int) -> None:
        """Over an all-padding batch of the bucket: the warm-up and capture write no KV."""
        batch = self.builder.build(RunnerStep(), Decision(Path.FULL, rows, 0, query_len))
        inputs = self.decode_buffers.fill(batch)
        self.full_graphs.capture((rows, query_len), lambda: self._forward_inputs(
            inputs.input_ids, inputs.positions, inputs.attn_metadata, None), self._persistent())

    def _persistent(self) -> list[torch.Tensor]:
        """What a FULL graph reads in place: the decode buffers, the KV caches, the weights."""
        caches = [t for layer in self.kv_caches for t in layer]
        return self.decode_buffers.tensors() + caches + self.weights

    def _capture_pieces(self, num_tokens: int, dummies: DummySource) -> None:
        """Warm-up then capture, each over a fresh dummy batch: a piece tells weights from
        per-call inputs by whether the same tensor object comes back."""
        for phase in (Phase.WARMUP, Phase.CAPTURE):
            sched = dummies.prefill(num_tokens)
            decision = Decision(Path.PIECEWISE, num_tokens, sched.num_batched_tokens)
            self._forward(self.builder.build(sched, decision), phase)


@contextlib.contextmanager
def _quick_captures(device: torch.device) -> Iterator[None]:
    """``torch.cuda.graph`` empties the allocator cache before every capture; over hundreds
    of captures that dominates startup and frees nothing the pool could use, so it runs once
    here instead (before the memory baseline is taken, so the baseline is not inflated by
    whatever the allocator had cached)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    with mock.patch("torch.cuda.empty_cache", lambda: None):
        yield


def _free_bytes(device: torch.device) -> int:
    """Free device memory after pending work (0 where it cannot be measured)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def estimate_capture_bytes(activation_bytes_per_token: float, model: torch.nn.Module, buckets: Buckets,
                           mode: CudaGraphMode, max_model_len: int, block_size: int) -> int:
    """Device memory CUDA graph capture will take: the shared pool, one forward's activations
    at the largest captured size (``activation_bytes_per_token`` is the profiling run's), the
    persistent buffers (``capture_buffer_bytes``) and the graphs themselves, at a generous
    fixed size each. Only the buffers are checked without a GPU (against the emulated
    capture, tests/compiler/test_cudagraph_emulated.py); the pool and the per-graph sizes
    are what a GPU run calibrates."""
    full = _full_rows(buckets) if mode.has_full else []
    pieces_sizes = list(buckets.piecewise) if mode.has_piecewise else []
    if not full and not pieces_sizes:
        return 0
    pool = activation_bytes_per_token * max(full + pieces_sizes)
    graphs = len(full) * FULL_GRAPH_BYTES + len(pieces_sizes) * (model.num_layers + 1) * PIECE_GRAPH_BYTES
    return int(pool + capture_buffer_bytes(model, buckets, mode, max_model_len, block_size) + graphs)


def capture_buffer_bytes(model: torch.nn.Module, buckets: Buckets, mode: CudaGraphMode, max_model_len: int,
                         block_size: int) -> int:
    """The persistent buffers capture allocates, each sized by the largest bucket:

    - PIECEWISE: per layer, the outputs of the piece before its attention and the attention
      output buffer: the fused qkv (q + 2kv, kept whole because v leaves the piece as a
      strided view of it), q and k after rotary (q + kv), the attention output (q, written
      in place by the attention op) and the residual (hidden), so 3q + 3kv + hidden per
      token; the last piece's output (hidden); the rotary cos and sin the first piece hands
      on (head_dim); the staged input ids and positions (two int64; a later pipeline stage's
      input is 2 x hidden activations instead of an id);
    - FULL: the persistent decode inputs and the hidden-state output, per row of the largest
      decode or verify bucket.
    """
    full = _full_rows(buckets) if mode.has_full else []
    pieces_sizes = list(buckets.piecewise) if mode.has_piecewise else []
    elt = torch.empty((), dtype=model.dtype).element_size()
    q_width, kv_width = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    layer_io = 3 * q_width + 3 * kv_width + model.hidden_size
    # A later pipeline stage's input is the previous stage's [tokens, 2 x hidden], not an int64 id.
    later_stage = getattr(model, "pp", None) is not None and not model.pp.is_first
    inputs = 2 * model.hidden_size * elt if later_stage else 8
    per_token = elt * (model.num_layers * layer_io + model.hidden_size + model.head_dim) + inputs + 8
    piece_buffers = per_token * max(pieces_sizes, default=0)
    per_seq = model.hidden_size * elt + inputs + 2 * 8 + 2 * 4 + 4 * -(-max_model_len // block_size)
    full_buffers = per_seq * max(full, default=0)
    return int(piece_buffers + full_buffers)


def _full_rows(buckets: Buckets) -> list[int]:
    """Rows of every FULL graph: decode buckets, then verify buckets (k + 1 rows a sequence)."""
    return list(buckets.full) + [s * buckets.verify_query_len for s in buckets.verify]
