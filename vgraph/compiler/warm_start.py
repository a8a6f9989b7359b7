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
sizes, graph dumps or the cache off, and whenever anything is missing or unreadable. The
ladder's runnables rung (loaders.py) loads through here; if its forward fails on its first
call (the warm-up), that is one warning and the next rung loads through Inductor.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..config import EngineConfig
from ..distributed.state import pp_stage
from . import captured_graph as captured
from . import runnable as runnables
from .cache import stable_hash
from .cache_entries import WARM_INDEX_FOLDER, read_json_record, report_damaged, write_json_atomic
from .cache_key import key_fields, model_layout

logger = logging.getLogger("vgraph")


# ---------------------------------------------------------------------------- the warm key and index

def fast_path_problem(config: EngineConfig, device: torch.device) -> Optional[str]:
    """Why a warm start of this configuration cannot take the fast path, or None."""
    c = config.compile
    problems = ((device.type != "cpu", f"runnables are made for the CPU only, not {device.type}"),
                (not c.compiled, "the model is not compiled"), (not c.use_cache, "the compile cache is off"),
                (bool(c.dump_graphs_dir), "graphs are dumped (dump_graphs_dir)"),
                (bool(c.passes), "user passes are set (their identity needs Inductor)"),
                (bool(c.compile_sizes), "static compile sizes are set"))
    return next((why for found, why in problems if found), None)


def warm_key(config: EngineConfig, hf_config: Any, model: torch.nn.Module, device: torch.device) -> Optional[str]:
    """The key the fast path finds its entry by, or None where there is no fast path (then
    ``fast_path_problem`` says why, or vgraph's pass package is not plain files)."""
    c = config.compile
    if fast_path_problem(config, device) is not None:
        return None
    passes = _pass_package_digest() if c.enable_fusion else "off"
    if passes is None:
        return None
    ranks = pp_stage()  # the global rank: its shard and stage
    fields = key_fields(config, hf_config, model.dtype, passes, device, model_layout(model), ranks.rank, ranks.world_size)
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


def read_index(root: Path, key: str) -> Optional[dict]:
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
