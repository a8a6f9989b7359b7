"""What transformers resolves for a checkpoint, recorded so that the next start skips it.

Why: a start takes the model config and the tokenizer from transformers. Importing its
model-config modules costs about 1 s (transformers 5 imports torch.distributed.tensor and
Dynamo with them), and ``AutoTokenizer`` loads the model config too, only to pick the
tokenizer class. Both answers depend on nothing but the checkpoint's small JSON files and the
transformers version, so the first start records them under
``<VGRAPH_CACHE_DIR>/checkpoints/<key>.json`` and a later start reads the record:

- the config as its ``to_dict()``, served by ``ModelConfigView``. That view is the only config
  object the engine gets, on the first start as on later ones, so a recorded start cannot
  behave differently from the one that wrote the record;
- the tokenizer class transformers picked, loaded directly with its ``from_pretrained``.

The key hashes the files' bytes, the transformers and vgraph versions: an edited config.json,
a re-downloaded tokenizer or an upgrade gets a new record. A record that cannot be read or
written only costs the transformers path; it never fails a start.
"""
from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.metadata
import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional

from ..paths import cache_dir

logger = logging.getLogger("vgraph")

RECORD_FORMAT = 1
RECORD_FOLDER = "checkpoints"
# What AutoConfig / AutoTokenizer read to decide (the tokenizer's vocabulary files are read
# by the tokenizer class itself, on every start).
CONFIG_FILES = ("config.json",)
TOKENIZER_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json")


class ModelConfigView:
    """A checkpoint's resolved transformers config, read-only: its ``to_dict()`` fields as
    attributes (what the models, the loader and the compile key read). A missing field is an
    AttributeError, so ``getattr(config, name, default)`` works as on a transformers config."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        object.__setattr__(self, "_fields", copy.deepcopy(fields))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_fields":
            raise AttributeError(name)
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(f"the model config has no field {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the model config is read-only (setting {name!r})")

    def __reduce__(self) -> tuple[Callable, tuple]:
        return ModelConfigView, (self._fields,)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelConfigView) and self._fields == other._fields

    def __hash__(self) -> int:
        return hash(json.dumps(self._fields, sort_keys=True))

    def __repr__(self) -> str:
        return f"ModelConfigView({self._fields.get('model_type', '?')}, {len(self._fields)} fields)"

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._fields)


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path
        import transformers
        return transformers.__version__


def record_key(kind: str, folder: Path, names: tuple[str, ...]) -> Optional[str]:
    """The hash of what the answer depends on, or None when a file cannot be read."""
    from vgraph import __version__

    files = {}
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        try:
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return None
    payload = {"format": RECORD_FORMAT, "kind": kind, "transformers": _transformers_version(),
               "vgraph": __version__, "files": files}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


class CheckpointRecords:
    """Reads and writes the records of one cache root (``None``: no records, every start
    asks transformers)."""

    def __init__(self, root: Optional[Path]) -> None:
        self.folder = None if root is None else root / RECORD_FOLDER

    @classmethod
    def default(cls) -> "CheckpointRecords":
        return cls(cache_dir())

    def read(self, key: Optional[str]) -> Optional[dict[str, Any]]:
        if self.folder is None or key is None:
            return None
        try:
            data = json.loads((self.folder / f"{key}.json").read_text(encoding="utf-8"))
        except OSError as exc:  # none yet, or an unusable cache root (the compile cache warns of that)
            logger.debug("no checkpoint record %s: %s", key, exc)
            return None
        except ValueError as exc:  # damaged (not UTF-8, not JSON)
            logger.warning("ignoring the checkpoint record %s (%s); asking transformers", key, exc)
            return None
        return data if isinstance(data, dict) else None

    def write(self, key: Optional[str], payload: dict[str, Any]) -> None:
        if self.folder is None or key is None:
            return
        from ..compiler.cache_entries import write_atomic
        try:
            data = json.dumps(payload, sort_keys=True).encode()
        except (TypeError, ValueError) as exc:  # a field JSON cannot hold: stay on transformers
            logger.debug("not recording %s: %s", key, exc)
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.folder / f"{key}.json", data)
        except OSError as exc:
            logger.debug("cannot write the checkpoint record %s: %s", key, exc)


def config_view(folder: Path, resolve: Callable[[], Any], records: CheckpointRecords) -> ModelConfigView:
    """The recorded config of ``folder``, else ``resolve()`` (transformers' AutoConfig) as a
    view, recorded for the next start."""
    key = record_key("config", folder, CONFIG_FILES)
    record = records.read(key)
    if record is not None and isinstance(record.get("fields"), dict):
        return ModelConfigView(record["fields"])
    fields = json.loads(json.dumps(resolve().to_dict(), default=str))
    records.write(key, {"fields": fields})
    return ModelConfigView(fields)


def recorded_tokenizer(folder: Path, records: CheckpointRecords) -> Optional[Any]:
    """The tokenizer, loaded with the class AutoTokenizer picked for these files before, or
    None when there is no record (or its class is gone)."""
    record = records.read(record_key("tokenizer", folder, TOKENIZER_FILES))
    if record is None:
        return None
    try:
        cls = getattr(importlib.import_module(record["module"]), record["name"])
    except (KeyError, ImportError, AttributeError, TypeError):
        return None
    return cls.from_pretrained(str(folder))


def record_tokenizer(folder: Path, tokenizer: Any, records: CheckpointRecords) -> None:
    """Remembers which class AutoTokenizer picked for ``folder``."""
    cls = type(tokenizer)
    records.write(record_key("tokenizer", folder, TOKENIZER_FILES),
                  {"module": cls.__module__, "name": cls.__qualname__})
