"""The warm start's fast path: the compiled forward from the compile cache with neither Dynamo
nor Inductor imported (runnable.py says why that matters: about 2.5 s of a 5 s start).

The compile cache's key covers the pass manager's uuid, and computing that means building the
passes, which are Inductor's ``CustomGraphPass``es: importing Inductor. So the fast path finds
its entry by a *warm key*: every field of the full key, with the passes replaced by what
decides their uuids and can be read without importing them (fusion on or off, the all-reduce
fusion switch, the source files of vgraph's pass package). A start that made and checked an
entry's runnables writes ``warm/<warm key>.json`` under the cache root, naming the entry's
config key and the source fingerprint of the model code; the fast path reads it, then the
captured graph and every piece's runnable, and checks the graph against the model as built.

Not taken, so Inductor's path runs as before: off the CPU, with user passes, static compile
sizes, graph dumps or the cache off, and whenever anything is missing or unreadable. If the
forward built here fails on its first call (the warm-up), that is one warning and the engine
builds the compiled forward the usual way.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..config import COMPILED_MIN_ROWS, EngineConfig
from ..distributed.state import tp_group
from ..paths import cache_dir
from . import captured_graph as captured
from . import runnable as runnables
from .cache import CompileCache, stable_hash
from .cache_entries import WARM_INDEX_FOLDER, DamagedFile, read_json_record, report_damaged, write_json_atomic
from .cache_key import key_fields, model_layout
from .counters import CompileCounters

logger = logging.getLogger("vgraph")


def check_rows(input_ids: torch.Tensor) -> None:
    """The compiled forward takes ``COMPILED_MIN_ROWS`` rows or more (config.py says why)."""
    if input_ids.shape[0] < COMPILED_MIN_ROWS:
        raise ValueError(f"the compiled forward takes at least {COMPILED_MIN_ROWS} rows, got "
                         f"{input_ids.shape[0]}: pad the batch (the runner's batch builder does)")


# ---------------------------------------------------------------------------- the warm key and index

def warm_key(config: EngineConfig, hf_config: Any, model: torch.nn.Module, device: torch.device) -> Optional[str]:
    """The key the fast path finds its entry by, or None where there is no fast path."""
    c = config.compile
    if device.type != "cpu" or not c.compiled or not c.use_cache or c.dump_graphs_dir or c.passes or c.compile_sizes:
        return None
    passes = _pass_package_digest() if c.enable_fusion else "off"
    if passes is None:
        return None
    tp = tp_group()
    fields = key_fields(config, hf_config, model.dtype, passes, device, model_layout(model), tp.rank, tp.world_size)
    fields["warm"] = {"runnable_format": runnables.RUNNABLE_FORMAT, "allreduce_fusion": c.enable_allreduce_fusion}
    return stable_hash(fields)


def _pass_package_digest() -> Optional[str]:
    """Hash of every module file of vgraph's pass package (importing them imports Inductor):
    more than the passes' uuids cover, so an edit there can only miss, never mislead. None
    where the package is not plain files."""
    try:
        spec = importlib.util.find_spec("vgraph.passes")
        folder = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(folder.glob("*.py"))
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    except (ImportError, AttributeError, StopIteration, TypeError, OSError):
        return None
    return digest.hexdigest() if files else None


def index_path(root: Path, key: str) -> Path:
    return root / WARM_INDEX_FOLDER / f"{key}.json"


def write_index(root: Path, key: str, config_key: str, fingerprint: str) -> None:
    """Points the warm key at the entry whose runnables were just checked. Best effort: an
    unwritable root only means the next start takes Inductor's path."""
    try:
        index_path(root, key).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(index_path(root, key), {"config_key": config_key, "source_fingerprint": fingerprint})
    except OSError as exc:
        logger.debug("could not write the warm-start index (%s)", exc)


def _read_index(root: Path, key: str) -> Optional[dict]:
    """The index, or None: quietly when it is missing (no start has checked runnables for this
    key), with one warning when it is damaged (Inductor's path writes it again)."""
    repair = "loading through Inductor, which writes it again"
    index = read_json_record(index_path(root, key), repair)
    if index is None:
        return None
    if not all(isinstance(index.get(k), str) for k in ("config_key", "source_fingerprint")):
        report_damaged(index_path(root, key), "no config_key and source_fingerprint", repair)
        return None
    return index


# ---------------------------------------------------------------------------- saving (Inductor's path)

def save_runnables(record: dict, artifacts: dict[tuple[str, str], Any], matches: dict[str, dict[str, int]],
                   folder: Path, model: torch.nn.Module, run: Callable[[Callable], torch.Tensor],
                   reference: torch.Tensor) -> tuple[Optional[captured.DirectForward], int, str]:
    """Makes each piece of ``record`` (a captured-graph record, freshly read) a runnable from
    its artifact in ``artifacts``, runs the forward built from them through ``run`` and saves
    them only if it gives ``reference`` bit for bit. Returns that forward (None if not saved),
    how many pieces were saved, and why none were."""
    if any(r.sizes for r in record["pieces"].values()):
        return None, 0, "the graph has static compile sizes"
    made = {}
    for piece_hash in sorted({r.piece_hash for r in record["pieces"].values()}):
        artifact = artifacts.get((piece_hash, "dynamic"))
        parts, why = runnables.make_runnable(artifact) if artifact is not None else (None, "not in memory")
        if parts is None:
            return None, 0, f"piece {piece_hash}: {why}"
        staged = runnables.stage_libraries(folder, parts)
        made[piece_hash] = (parts, staged, runnables.build_runnable(parts.source, staged, parts.extern,
                                                                     f"{piece_hash}-dynamic"))
    split = record["split"]
    captured.install_pieces(split, record["pieces"], lambda piece_hash, size: made[piece_hash][2])
    direct = captured.DirectForward(split, record["sources"], model)
    if not torch.equal(run(direct), reference):
        return None, 0, "the forward built from them differs from Inductor's"
    for piece_hash, (parts, staged, _) in made.items():
        runnables.save_runnable(folder, piece_hash, "dynamic", parts, staged, matches.get(piece_hash, {}))
    return direct, len(made), ""


# ---------------------------------------------------------------------------- loading (the fast path)

def load_warm_forward(model: torch.nn.Module, config: EngineConfig, hf_config: Any,
                      device: torch.device) -> Optional["WarmForward"]:
    """The compiled forward from runnables, or None where the fast path does not apply or its
    files are not all there (then the caller builds the compiled forward as usual)."""
    key = warm_key(config, hf_config, model, device)
    root = cache_dir() if key is not None else None
    index = _read_index(root, key) if root is not None else None
    if index is None:
        return None
    start = time.perf_counter()
    fingerprint = captured.source_fingerprint(model)
    if index["source_fingerprint"] != fingerprint:
        return None
    cache = CompileCache(root, index["config_key"], warm_key=key)
    path = cache.find_captured(fingerprint)
    record = captured.load_record(path) if path is not None else None
    if record is None or captured.record_problem(record, model, path.parent, cache.config_key) is not None:
        return None
    try:
        loaded = {h: runnables.load_runnable(cache.folder, h, "dynamic") for h in _hashes(record)}
    except DamagedFile as exc:  # truncated or flipped bytes: a warning, Inductor's path rewrites it
        report_damaged(exc.path, str(exc), "loading the entry through Inductor, which saves it again")
        return None
    except Exception as exc:  # missing, or made by another build: Inductor's path repairs it
        logger.info("the compile cache entry's runnables are not usable (%s: %s); loading it through Inductor",
                    type(exc).__name__, exc)
        return None
    captured.install_pieces(record["split"], record["pieces"], lambda piece_hash, size: loaded[piece_hash][0])
    counters = _loaded_counters(record, {h: m for h, (_, m) in loaded.items()}, time.perf_counter() - start)
    cache.touch()
    direct = captured.DirectForward(record["split"], record["sources"], model)
    return WarmForward(direct, counters, cache, lambda: _compiled_forward(model, config, hf_config, device))


def _hashes(record: dict) -> set[str]:
    return {r.piece_hash for r in record["pieces"].values()}


def _loaded_counters(record: dict, matches: dict[str, dict[str, int]], seconds: float) -> CompileCounters:
    """What a warm load reports, as Inductor's path reports it; matches count once per piece."""
    split, hashes = record["split"], [r.piece_hash for r in record["pieces"].values()]
    totals: dict[str, int] = {}
    for piece_hash in hashes:
        for name, count in matches.get(piece_hash, {}).items():
            totals[name] = totals.get(name, 0) + count
    return CompileCounters(pieces=sum(1 for n in split.graph.nodes if n.op == "call_module"),
                           compiled_pieces=len(hashes), unique_piece_graphs=len(set(hashes)),
                           captured_graph="loaded", captured_load_seconds=seconds,
                           runnable_loads=len(set(hashes)), pass_matches=totals)


def _compiled_forward(model: torch.nn.Module, config: EngineConfig, hf_config: Any, device: torch.device) -> Any:
    from .build import build_compiled_forward
    return build_compiled_forward(model, config, hf_config, device)[0]


class WarmForward:
    """Callable like ``CompiledForward``: the captured graph over runnables. If its first call
    fails, one warning, and from then on the compiled forward built the usual way (whose
    ``counters`` and ``cache`` then replace these)."""

    def __init__(self, direct: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], counters: CompileCounters,
                 cache: CompileCache, rebuild: Callable[[], Any]) -> None:
        self.counters = counters
        self.cache = cache
        self._direct = direct
        self._rebuild = rebuild
        self._fallback: Optional[Callable] = None
        self._proven = False  # a call succeeded: no more checks on the hot path

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        check_rows(input_ids)
        if self._proven:
            return self._direct(input_ids, positions)
        if self._fallback is not None:
            return self._fallback(input_ids, positions)
        try:
            out = self._direct(input_ids, positions)
        except Exception as exc:
            logger.warning("the compile cache's runnables failed (%s: %s); loading the compiled model through "
                           "Inductor instead", type(exc).__name__, exc)
            self._fallback = self._rebuild()
            self.counters, self.cache = self._fallback.counters, self._fallback.cache
            return self._fallback(input_ids, positions)
        self._proven = True
        return out
