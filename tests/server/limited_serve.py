"""``vgraph`` under a lowered descriptor limit: $VGRAPH_TEST_NOFILE, soft and hard.

Run as a script by the fault tests (the shared ``ServerProcess`` takes no ``preexec_fn``).
The limit is set before anything else is imported, so the server process never holds more
descriptors than it allows, exactly as if it had been started under ``ulimit -n``; the hard
limit is lowered too, so the server cannot raise its soft limit past it.
"""
from __future__ import annotations

import os
import resource
import sys

_LIMIT = int(os.environ["VGRAPH_TEST_NOFILE"])
resource.setrlimit(resource.RLIMIT_NOFILE, (_LIMIT, _LIMIT))

if __name__ == "__main__":
    from vgraph.cli import main
    sys.exit(main())
