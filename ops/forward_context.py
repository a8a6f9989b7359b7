"""The forward context: how attention metadata and KV caches reach the attention op.

The model's signature stays ``forward(input_ids, positions)`` so that Dynamo captures one
graph for every batch; the per-step attention inputs travel beside it. The runner sets a
context around each forward and ``vgraph::unified_attention`` reads it.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch


@dataclass
class AttentionMetadata:
    """Describes one flat batch of sequences for the paged attention kernels.

    Tokens of sequence ``i`` occupy rows ``query_start_loc[i]:query_start_loc[i+1]`` of the
    flat batch; they are the last tokens of a sequence of ``seq_lens[i]`` tokens in total
    (already-cached prefix plus these new ones). A padding sequence has ``seq_lens == 0``
    and its tokens have ``slot_mapping == -1``: they write nothing and produce zeros.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token, -1 = none
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int  # host-side bounds, so no kernel launch needs a device sync
    max_seq_len: int
    num_kv_splits: int = 1  # > 1: a pure-decode batch uses the split-KV kernel

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class PiecewiseHooks(Protocol):
    """What the attention op asks of the PIECEWISE graphs a forward runs through (the rest of
    ``vgraph.compiler.piecewise_graphs.PiecewiseRun`` is for the compiled pieces)."""

    def attention_output(self, layer_idx: int, shape: torch.Size, dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
        """Where layer ``layer_idx`` writes its attention output this call: the same address
        on every call of a token count, so the next piece's graph reads it in place."""
        ...


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: [blocks, block_size, kv_heads, head_dim]
    softmax_scale: float
    # How this forward's compiled pieces run: None plainly, else the PIECEWISE CUDA graphs and
    # the phase they are in (``vgraph.compiler.piecewise_graphs.PiecewiseRun``), chosen by the
    # runner's dispatcher for this batch. Typed by what ops use of it: ops do not import the
    # runtime.
    piecewise: Optional[PiecewiseHooks] = None
    # The only rows whose final hidden states this step uses (int64, ascending, on the
    # device), when fewer than all: the sampled rows of a batch with prefills. A model whose
    # tail is row-wise may then run its last layer after attention on these rows alone
    # (vgraph.compiler.piece.RowArgs) and return them, in this order. None: every row.
    output_rows: Optional[torch.Tensor] = None
    # Host-side work a kernel derives from the metadata, kept for the other layers of this
    # forward (the metadata cannot change within one); emptied on every entry and exit of
    # ``set_forward_context``. See ``metadata_memo``.
    memo: dict[Any, Any] = field(default_factory=dict)
    # Per layer (k_scale, v_scale) of an fp8 KV cache: one-element float32 tensors on the
    # device, allocated once, so a captured graph reads their values at replay. None: the
    # caches are not quantized (or every scale is 1.0).
    kv_scales: Optional[Sequence[tuple[torch.Tensor, torch.Tensor]]] = None


class _Current(threading.local):
    """The forward running on this thread. Per thread, because data-parallel replicas in one
    process (``vgraph serve --data-parallel-size``) run their forwards on their own threads
    at the same time, each with its own metadata and KV caches."""

    context: Optional[ForwardContext] = None


_current = _Current()


def get_forward_context() -> ForwardContext:
    ctx = _current.context
    if ctx is None:
        raise RuntimeError(
            "vgraph::unified_attention ran outside a forward context; wrap the forward in "
            "vgraph.ops.forward_context.set_forward_context(...)")
    return ctx


def current_forward_context() -> Optional[ForwardContext]:
    """The context of the forward running now on this thread, or None outside one."""
    return _current.context


def metadata_memo(block_table: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor) -> Optional[dict[Any, Any]]:
    """The current forward's memo when these are its own metadata tensors, else None.

    Why: on CPU, turning the metadata into a kernel's work list (reading it on the host,
    checking it, packing it for C++) costs as much as a decode step's attention for a short
    context, and every layer of the forward would repeat it. Identity, not equality, is
    checked, so any other caller gets None and computes its own.
    """
    ctx = _current.context
    if ctx is None:
        return None
    meta = ctx.attn_metadata
    if (meta.block_table is block_table and meta.query_start_loc is query_start_loc
            and meta.seq_lens is seq_lens):
        return ctx.memo
    return None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    previous, _current.context = _current.context, ctx
    ctx.memo.clear()  # one entry is one forward: a context re-entered (a graph body run
    try:              # again over buffers refilled in place) must not see the last plans
        yield ctx
    finally:
        ctx.memo.clear()
        _current.context = previous
