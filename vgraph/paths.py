"""Where vgraph keeps files it creates for reuse (see cache_dir.md)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$VGRAPH_CACHE_DIR``, else ``~/.cache/vgraph``."""
    return Path(os.environ.get("VGRAPH_CACHE_DIR") or Path.home() / ".cache" / "vgraph")

