"""A check, runnable on CPU, that a captured region does nothing CUDA stream capture forbids
or silently gets wrong.

A CUDA graph records kernel launches; anything the host does in between (read a value, size
an output from data, copy to host memory) either fails the capture or is baked into the graph
as a constant, and a tensor the graph reads is read at its captured address forever after.
Nothing of that shows without a GPU, and a GPU capture only fails on the first two, so
``CaptureCheck`` (a ``TorchDispatchMode``) watches every op a region's body dispatches and
raises ``CaptureSafetyError`` naming the op for:

- host syncs: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``) and
  ``aten.equal``;
- ops whose output shape depends on data (``DATA_DEPENDENT_OPS``: ``nonzero``,
  ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``, boolean-mask
  indexing, ...): the host has to read the data to size the output;
- device-to-host copies: a copy whose destination is on the CPU while its source is on the
  region's device (``CaptureRegion.device``; tests name another device, ``meta``, to exercise
  this on a CPU-only machine), and reads of tensors on another device (host memory);
- RNG ops whose generator the region was not declared with (``CaptureRegion.generators``):
  a replay advances only generators registered with its graph (any other one's state is
  frozen at capture: every replay draws the same numbers), and vgraph's forward is a function
  of its buffers that draws none, so a random op in a body, even on torch's default CUDA
  generator (which capture registers), is a mistake to report;
- reads of tensors the graph does not own: every tensor an op touches must be one of the
  region's ``owned`` tensors (persistent input/output buffers, weights, KV caches; views of
  them count) or produced inside the region. Anything else is a per-call tensor whose address
  changes on the next call, but the replay keeps reading the captured one;
- allocations that outlive the region: a tensor produced inside the region that is still
  alive when the body returns. On CUDA it lives in the graph pool, whose memory the next
  graph of the pool reuses; bodies copy their results into preallocated output buffers.

Compiled pieces are opaque: Inductor allocates their buffers without going through the
dispatcher, so their calls go through ``call_opaque``, which checks their arguments as reads
and takes their outputs as produced; the ops they dispatch inside (extern kernels) are held
to every rule but ownership, and what their generated code reads without dispatching (a
constant it closed over, a Triton kernel's pointers) is out of sight. Custom ops are judged
by their arguments: what their implementation does inside is theirs (on CPU, the attention
op reads its metadata on the host; on CUDA it launches Triton kernels). Ops that read the
forward context instead of their arguments (``vgraph::unified_attention``) have the
context's metadata and KV caches checked as reads.

Every FULL and PIECEWISE body of vgraph is recorded through
``vgraph.compiler.piecewise_graphs.record``, which runs the body under this check when
``VGRAPH_CHECK_CAPTURE=1`` is set (on a GPU: capture then takes longer; serving is
unaffected, replays run no Python). CI runs every body under it on CPU, with CUDA graphs
emulated (tests/compiler/test_cudagraph_emulated.py).
"""
from __future__ import annotations

import os
import weakref
from types import MappingProxyType
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from vgraph.ops.forward_context import current_forward_context

ENV_VAR = "VGRAPH_CHECK_CAPTURE"

# Ops that make the host wait for the device to read a value.
HOST_SYNC_OPS = MappingProxyType({
    "aten::_local_scalar_dense": ".item() / bool() / int() of a tensor reads its value on the host",
    "aten::equal": "torch.equal returns a Python bool: the host reads the comparison",
})

# Ops whose output shape depends on the data: the host reads the data to size the output.
# Conditional entries (``repeat_interleave``, boolean-mask indexing) are judged by
# ``_data_dependent_reason``.
DATA_DEPENDENT_OPS = MappingProxyType({
    "aten::nonzero": "nonzero's output size is the number of non-zeros",
    "aten::argwhere": "argwhere is nonzero",
    "aten::masked_select": "masked_select's output size is the number of selected elements",
    "aten::_unique": "unique's output size is the number of distinct values",
    "aten::_unique2": "unique's output size is the number of distinct values",
    "aten::unique_dim": "unique's output size is the number of distinct values",
    "aten::unique_consecutive": "unique's output size is the number of distinct values",
    "aten::unique_dim_consecutive": "unique's output size is the number of distinct values",
    "aten::bincount": "bincount's output size is the largest value",
    "aten::repeat_interleave": "repeat_interleave without output_size sums the repeats on the host",
    "aten::index": "indexing with a boolean mask is nonzero",
    "aten::index_put": "indexing with a boolean mask is nonzero",
    "aten::index_put_": "indexing with a boolean mask is nonzero",
    "aten::_index_put_impl_": "indexing with a boolean mask is nonzero",
})

# Random ops without a generator argument in any overload (the others are found by schema).
RNG_OPS_WITHOUT_GENERATOR = frozenset({"aten::native_dropout", "prims::inductor_seeds",
                                       "prims::inductor_random", "prims::inductor_randint"})

# Copies, judged device-to-host or not by ``CaptureCheck._is_device_to_host``.
_COPY_OPS = frozenset({"aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy"})

# Ops that read tensors from the forward context rather than from their arguments.
_CONTEXT_READERS = frozenset({"vgraph::unified_attention"})


class CaptureSafetyError(RuntimeError):
    """A captured region did something CUDA stream capture forbids or would get wrong."""


def enabled() -> bool:
    """Whether ``record`` runs bodies under the check (``VGRAPH_CHECK_CAPTURE=1``)."""
    return os.environ.get(ENV_VAR, "") not in ("", "0")


def _storage_key(t: torch.Tensor) -> Optional[int]:
    """Identity of the tensor's storage (shared by all its views); None without one."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
        return None


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is on ``device`` (``cuda`` without an index means any CUDA device)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor {tuple(t.shape)} on {t.device}"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class CaptureRegion:
    """What one captured body may touch: its device, the tensors it owns (persistent buffers,
    weights, KV caches, its output buffers) and the generators registered with its graph.
    Keeps those tensors alive, so their storages keep their identity for the graph's life."""

    def __init__(self, device: torch.device | str, owned: Iterable[torch.Tensor] = (),
                 generators: Sequence[torch.Generator] = ()) -> None:
        self.device = torch.device(device)
        self.owned = tuple(t for t in owned if isinstance(t, torch.Tensor))
        self.owned_keys = frozenset(k for k in map(_storage_key, self.owned) if k is not None)
        self.generators = tuple(generators)
        # The dispatcher hands ops a new Python wrapper of the same generator: compare the C++ one.
        self.generator_keys = frozenset(g._cdata for g in self.generators)

    def checked(self, body: Callable[[], Any]) -> Callable[[], None]:
        """``body`` run under a fresh check each time it is called (capture and each replay)."""
        def run() -> None:
            with CaptureCheck(self):
                body()
        return run


class CaptureCheck(TorchDispatchMode):
    """Raises ``CaptureSafetyError`` on the first unsafe op of the region (see module doc);
    on exit, on any tensor produced inside that is still alive."""

    def __init__(self, region: CaptureRegion) -> None:
        super().__init__()
        self.region = region
        self.produced: set[int] = set()
        self.allocations: list[tuple[weakref.ref, str, str]] = []  # (tensor, op, description)
        self.opaque_depth = 0

    # ------------------------------------------------------------------ the mode

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        self._refuse_host_work(func, name, args, kwargs)
        inputs = _tensors((args, kwargs))
        self._check_devices(name, inputs)
        if self.opaque_depth == 0:
            self._check_owned(name, inputs)
            if name in _CONTEXT_READERS:
                self._check_owned(f"{name} (forward context)", _context_tensors(args, kwargs))
        out = func(*args, **kwargs)
        self._note_produced(name, _tensors(out))
        return out

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            self._refuse_escapes()

    def opaque(self, fn: Callable, args: Sequence) -> Any:
        """Calls a compiled piece: its arguments are reads, its outputs are the region's."""
        self._check_devices("a compiled piece", _tensors(args))
        self._check_owned("a compiled piece", _tensors(args))
        self.opaque_depth += 1
        try:
            out = fn(*args)
        finally:
            self.opaque_depth -= 1
        self._note_produced("a compiled piece", _tensors(out))
        return out

    # ------------------------------------------------------------------ the rules

    def _refuse_host_work(self, func: Any, name: str, args: tuple, kwargs: dict) -> None:
        if name in HOST_SYNC_OPS:
            self._fail(name, HOST_SYNC_OPS[name])
        reason = _data_dependent_reason(name, args, kwargs)
        if reason is not None:
            self._fail(name, reason)
        if name in _COPY_OPS and self._is_device_to_host(name, args, kwargs):
            self._fail(name, f"copies from {self.region.device} to host memory")
        if _is_random(func):
            gen = _generator_of(func, args, kwargs)
            if gen is None or gen._cdata not in self.region.generator_keys:
                self._fail(name, "draws random numbers from a generator the graph was not declared "
                                 "with (CaptureRegion.generators)")

    def _is_device_to_host(self, name: str, args: tuple, kwargs: dict) -> bool:
        device = self.region.device
        if device.type == "cpu" or not args or not isinstance(args[0], torch.Tensor):
            return False
        if name == "aten::_to_copy":
            dst = kwargs.get("device")
            return _on(args[0], device) and dst is not None and torch.device(dst).type == "cpu"
        src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        return src is not None and _on(src, device) and args[0].device.type == "cpu"

    def _check_devices(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Tensors on another device: host memory the graph would read at capture time (a
        0-dim CPU tensor is passed to kernels by value, like a Python scalar)."""
        for t in tensors:
            if not _on(t, self.region.device) and not (t.device.type == "cpu" and t.dim() == 0):
                self._fail(name, f"reads a {_describe(t)}, not on the region's device")

    def _check_owned(self, name: str, tensors: Iterable[torch.Tensor]) -> None:
        owned = self.region.owned_keys
        for t in tensors:
            key = _storage_key(t)
            if key is not None and key not in owned and key not in self.produced:
                self._fail(name, f"reads a {_describe(t)} the graph does not own (neither a persistent "
                                 f"buffer, weight or KV cache of the region nor produced inside it): its "
                                 f"address may change on the next call, the replay reads the captured one")

    def _note_produced(self, name: str, outs: list[torch.Tensor]) -> None:
        for t in outs:
            key = _storage_key(t)
            if key is None or key in self.region.owned_keys:
                continue
            if key not in self.produced:
                self.produced.add(key)
                self.allocations.append((weakref.ref(t), name, _describe(t)))

    def _refuse_escapes(self) -> None:
        for ref, name, what in self.allocations:
            if ref() is not None:
                self._fail(name, f"allocated a {what} that is still referenced after the region: on "
                                 f"CUDA it lives in the graph pool, which later graphs reuse; copy it "
                                 f"into a persistent output buffer inside the body instead")

    def _fail(self, name: str, why: str) -> None:
        raise CaptureSafetyError(f"unsafe during CUDA graph capture: {name} {why} "
                                 f"(region on {self.region.device})")


def _data_dependent_reason(name: str, args: tuple, kwargs: dict) -> Optional[str]:
    reason = DATA_DEPENDENT_OPS.get(name)
    if reason is None:
        return None
    if name == "aten::repeat_interleave":
        given = kwargs.get("output_size", args[2] if len(args) > 2 else None)
        return reason if given is None else None
    if name.startswith("aten::index") or name == "aten::_index_put_impl_":
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
        return reason if masks else None
    return reason


def _is_random(func: Any) -> bool:
    """Random ops: those with a generator argument in any overload (``aten.rand.default``
    has none, ``aten.rand.generator`` does), plus the few that never take one."""
    if func._schema.name in RNG_OPS_WITHOUT_GENERATOR:
        return True
    packet = func.overloadpacket
    return any(any(_is_generator(a) for a in getattr(packet, o)._schema.arguments) for o in packet.overloads())


def _is_generator(arg: Any) -> bool:
    return "Generator" in str(arg.type)  # "Generator" or "Optional[Generator]"


def _generator_of(func: Any, args: tuple, kwargs: dict) -> Optional[torch.Generator]:
    """The generator an RNG op was given, by keyword or by position (None: the default one)."""
    for i, arg in enumerate(func._schema.arguments):
        if _is_generator(arg):
            return kwargs.get(arg.name, args[i] if i < len(args) else None)
    return None


def _context_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """What ``vgraph::unified_attention`` reads from the forward context: the metadata and
    its layer's KV cache."""
    ctx = current_forward_context()
    if ctx is None:
        return []
    meta = ctx.attn_metadata
    tensors = [meta.slot_mapping, meta.block_table, meta.query_start_loc, meta.seq_lens]
    layer = args[3] if len(args) > 3 else kwargs.get("layer_idx")
    if isinstance(layer, int) and 0 <= layer < len(ctx.kv_caches):
        tensors += list(ctx.kv_caches[layer])
    return tensors


def active_check() -> Optional[CaptureCheck]:
    """The innermost ``CaptureCheck`` running now, if any."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, CaptureCheck):
            return mode
    return None


def call_opaque(fn: Callable, args: Sequence) -> Any:
    """``fn(*args)`` for a compiled piece; inside a checked region, through ``CaptureCheck.opaque``.
    Costs one C call outside a check (this is on the CPU decode path)."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return fn(*args)
    check = active_check()
    return fn(*args) if check is None else check.opaque(fn, args)
