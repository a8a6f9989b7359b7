"""Where vgraph keeps files it creates for reuse (see cache_dir.md)."""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("vgraph")


def cache_dir() -> Path:
    """``$VGRAPH_CACHE_DIR``, else ``~/.cache/vgraph``."""
    return Path(os.environ.get("VGRAPH_CACHE_DIR") or Path.home() / ".cache" / "vgraph")


def private_dir(what: str, unusable: Path, exc: OSError) -> Path:
    """A fresh temporary directory for this process only (removed at exit), for ``what`` when
    ``unusable`` under the cache root cannot be written (read-only, full, a file in the way):
    the cache must never stop a start, so the work is redone per process, with one warning."""
    path = Path(tempfile.mkdtemp(prefix="vgraph-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    logger.warning("cannot write %s under %s (%s); using %s for this process", what, unusable, exc, path)
    return path
