"""The captured graph on disk, so that a warm start runs no Dynamo at all.

Why: with every piece's code in the compile cache, Dynamo re-tracing the model's Python was
the largest part of a warm start (about 1.2 s for 8 layers, growing with depth), only to
rebuild a graph that cannot have changed: the cache key covers the model config, dtype,
versions and compile config, and ``source_fingerprint`` covers the code Dynamo traces. What a
call needs is the split graph (top-level glue plus the attention submodules; compiled pieces
are stubs filled from the artifact cache) and where each graph input comes from: a model
parameter or buffer by name, ``input_ids``, ``positions``, or the token count.

The cold start builds this record from the graph Dynamo hands the backend, checks that calling
it directly gives bit-identical output to Dynamo's compiled frame, and only then saves it and
switches to it, so cold and warm starts run the same direct call at serving time. Anything it
cannot account for (an input that is neither model state nor an argument) means no record:
warm starts then trace with Dynamo, as before.

A record also says what it was built for: its entry (config key and graph hash) and the name,
shape, dtype and strides of every piece of model state it binds. A warm start checks both
against the folder it read and the model as built now (linears packed or not, say, which
changes the state's names and shapes) and traces again, with one warning, on any difference.

On disk a record is a small JSON header (format, torch version, sha256 and length of the
pickle after it) and the pickle: a truncated or damaged record is caught by its checksum
before anything is unpickled, removed, and the start traces as a cold one would.
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from . import cache_entries
from .piece import PieceRunner, TokenDim

logger = logging.getLogger("vgraph")

RECORD_FORMAT = 5  # 3: a checksummed header before the pickle; 4: PieceRecord.row_args; 5: traced size-oblivious (one row and up)
RECORD_MAGIC = b"vgraph-captured\n"
STATE, INPUT_IDS, POSITIONS, NUM_TOKENS = "state", "input_ids", "positions", "num_tokens"


@dataclass(frozen=True)
class InputSource:
    """Where one graph input comes from at call time."""

    kind: str  # STATE, INPUT_IDS, POSITIONS or NUM_TOKENS
    name: str = ""  # the parameter or buffer name for STATE


@dataclass(frozen=True)
class PieceRecord:
    """What it takes to rebuild one compiled piece's runner from the artifact cache."""

    piece_hash: str
    sizes: tuple[int, ...]  # compile sizes with their own artifact
    token_dim: Optional[TokenDim]
    single_output: bool
    row_args: Optional[RowArgs] = None  # the model's row-wise tail (piece.py)


def source_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the code Dynamo traces: the source files of the model's module classes and of
    vgraph's ops. An edit to any of them means a new trace, not a stale graph. Files are named
    by module, not path, so the same code installed elsewhere (another checkout, another home
    directory, a copied cache) finds the same record."""
    import vgraph.ops
    files = {_module_name(type(m)): inspect.getsourcefile(type(m)) for m in model.modules()}
    ops_folder = Path(vgraph.ops.__file__).parent
    files.update({f"vgraph.ops.{p.stem}": str(p) for p in ops_folder.glob("*.py")})
    digest = hashlib.sha256()
    for name, path in sorted((n, f) for n, f in files.items() if f):
        digest.update(name.encode())
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def _module_name(cls: type) -> str:
    """The importable name of a class's module (``__main__`` by its file's name)."""
    module = cls.__module__
    if module == "__main__":
        return Path(getattr(sys.modules.get(module), "__file__", None) or module).stem
    return module


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (shared ones under each of their names)."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    return state


def _tensor_signature(t: torch.Tensor) -> list:
    return [list(t.shape), str(t.dtype), list(t.stride()), t.device.type]


def state_signature(model: torch.nn.Module, sources: list[InputSource]) -> dict[str, list]:
    """Name -> [shape, dtype, strides, device] of the model state a graph binds."""
    state = model_state(model)
    return {s.name: _tensor_signature(state[s.name]) for s in sources if s.kind == STATE}


def record_problem(record: dict, model: torch.nn.Module, folder: Path, config_key: str) -> Optional[str]:
    """Why the record does not fit this entry and this model, or None when it does. The
    graph was traced over that exact state, so any difference means another graph."""
    entry = f"{record.get('config_key')}-{record.get('graph_hash')}"
    if record.get("config_key") != config_key or folder.name != entry:
        return f"it was recorded for entry {entry}, not {folder.name}"
    state, expected = model_state(model), record.get("state") or {}
    for source in record["sources"]:
        if source.kind != STATE:
            continue
        tensor = state.get(source.name)
        if tensor is None:
            return (f"the model has no {source.name!r} (it was built differently, e.g. with "
                    "packed or plain linears)")
        if _tensor_signature(tensor) != expected.get(source.name):
            return f"{source.name!r} is {_tensor_signature(tensor)}, the record has {expected.get(source.name)}"
    return None


def bind_inputs(example_inputs: list, model: torch.nn.Module, call_inputs: dict[str, torch.Tensor],
                token_symbol: Any) -> Optional[list[InputSource]]:
    """Each graph input's source, found by identity (a SymInt by its symbol: converting it to
    an int would specialize the graph); None if any input is unaccounted for."""
    state = {id(t): name for name, t in model.named_parameters(remove_duplicate=False)}
    state.update({id(t): name for name, t in model.named_buffers(remove_duplicate=False)})
    calls = {id(t): name for name, t in call_inputs.items()}
    num_tokens = call_inputs[INPUT_IDS].shape[0]
    sources = []
    for arg in example_inputs:
        if isinstance(arg, torch.Tensor) and id(arg) in calls:
            sources.append(InputSource(calls[id(arg)]))
        elif isinstance(arg, torch.Tensor) and id(arg) in state:
            sources.append(InputSource(STATE, state[id(arg)]))
        elif isinstance(arg, torch.SymInt) and token_symbol is not None and arg.node.expr == token_symbol:
            sources.append(InputSource(NUM_TOKENS))
        elif type(arg) is int and arg == num_tokens and token_symbol is None:
            sources.append(InputSource(NUM_TOKENS))
        else:
            logger.info("captured graph not recorded: graph input %s is neither model state nor an "
                        "argument; warm starts will trace with Dynamo", type(arg).__name__)
            return None
    return sources


class DirectForward:
    """Calls the split graph directly: the inputs gathered from the model and the arguments,
    the single output returned. What Dynamo's compiled frame does, minus the frame.

    Model state never changes between calls, so the argument list is built once; a call only
    fills in the slots of ``input_ids``, ``positions`` and the token count (the decode hot path).
    """

    def __init__(self, split: torch.nn.Module, sources: list[InputSource], model: torch.nn.Module) -> None:
        self.split = split
        state = model_state(model)
        self._args: list[Any] = [state[s.name] if s.kind == STATE else None for s in sources]
        self._slots = {kind: [i for i, s in enumerate(sources) if s.kind == kind]
                       for kind in (INPUT_IDS, POSITIONS, NUM_TOKENS)}
        unknown = {s.kind for s in sources} - {STATE, *self._slots}
        if unknown:
            raise ValueError(f"unknown captured-graph input kinds {sorted(unknown)}")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = list(self._args)
        for kind, value in ((INPUT_IDS, input_ids), (POSITIONS, positions), (NUM_TOKENS, input_ids.shape[0])):
            for i in self._slots[kind]:
                args[i] = value
        return self.split(*args)[0]


def stubbed_split_bytes(split: torch.fx.GraphModule, compiled: set[str]) -> bytes:
    """The split graph pickled with its compiled pieces replaced by empty modules (their code
    lives in the artifact cache): only the glue and the attention submodules are rebuilt on load."""
    originals = {name: getattr(split, name) for name in compiled}
    try:
        for name in compiled:
            setattr(split, name, torch.nn.Module())
        return pickle.dumps(split)
    finally:
        for name, module in originals.items():
            setattr(split, name, module)


def save_record(path: Path, split_bytes: bytes, sources: list[InputSource], pieces: dict[str, PieceRecord],
                built_for: dict[str, Any]) -> None:
    """Writes the record atomically (cache_entries.write_atomic: two cold starts saving at
    once each rename a whole file). ``built_for``: ``config_key``, ``graph_hash`` and
    ``state`` (``state_signature``), checked by ``record_problem``."""
    body = pickle.dumps({"split": split_bytes, "sources": sources, "pieces": pieces, **built_for})
    header = {"format": RECORD_FORMAT, "torch": torch.__version__}
    cache_entries.write_atomic(path, cache_entries.pack_framed(RECORD_MAGIC, header, body))


def load_record(path: Path) -> Optional[dict]:
    """The record, or None: from another format or torch version (an info line), or truncated,
    damaged or foreign (a warning, and the file is removed so no start reads it again)."""
    try:
        header, body = cache_entries.unpack_framed(path.read_bytes(), RECORD_MAGIC, "captured-graph record")
        if header.get("format") != RECORD_FORMAT or header.get("torch") != torch.__version__:
            logger.info("captured graph %s is from another vgraph or torch version; tracing with Dynamo", path)
            return None
        payload = pickle.loads(body)
        payload["split"] = pickle.loads(payload["split"])
        return payload
    except Exception as exc:  # truncated, damaged or foreign: trace again, never crash
        logger.warning("captured graph %s is unreadable (%s: %s); removed, tracing with Dynamo", path,
                       type(exc).__name__, exc)
        cache_entries.remove_quietly(str(path))
        return None


def install_pieces(split: torch.nn.Module, pieces: dict[str, PieceRecord],
                   load: Callable[[str, str], Optional[Callable]]) -> bool:
    """Puts a runner in place of each stubbed piece; False if an artifact is missing."""
    runners = {}
    for name, rec in pieces.items():
        dynamic = load(rec.piece_hash, "dynamic")
        static = {size: load(rec.piece_hash, str(size)) for size in rec.sizes}
        if dynamic is None or any(v is None for v in static.values()):
            return False
        runners[name] = PieceRunner(dynamic, static, rec.token_dim, rec.single_output, rec.row_args)
    for name, runner in runners.items():
        setattr(split, name, runner)
    return True
