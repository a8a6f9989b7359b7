"""vgraph's default logging: INFO to stderr for Python API users, without touching the root logger.

Why: the startup timeline (model loaded, KV cache size, compile cache hits, pass matches,
"engine ready") is how a user sees what ``LLM(...)`` is doing for the seconds or minutes it
takes, and Python shows nothing below WARNING unless the application configures logging.
So ``import vgraph`` gives the "vgraph" logger a stderr handler and a level, as vLLM does for
"vllm". Two rules keep it out of the way:

- The handler stays silent while the root logger has handlers of its own: an application
  (or the ``vgraph`` CLI, or pytest) that configured logging gets every record once, through
  its own handlers and format, by ordinary propagation. No record is printed twice.
- ``VGRAPH_LOGGING_LEVEL`` (DEBUG, INFO, WARNING, ERROR; default INFO) sets the level of the
  "vgraph" logger, so ``VGRAPH_LOGGING_LEVEL=WARNING`` silences the timeline;
  ``VGRAPH_CONFIGURE_LOGGING=0`` leaves logging entirely to the application.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

LOGGER_NAME = "vgraph"
LEVEL_ENV = "VGRAPH_LOGGING_LEVEL"
CONFIGURE_ENV = "VGRAPH_CONFIGURE_LOGGING"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (it may be replaced after
    import, e.g. by a notebook), and only while the root logger has no handlers."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.addFilter(lambda record: not logging.getLogger().handlers)

    @property  # type: ignore[override]
    def stream(self):  # noqa: D102  (StreamHandler reads self.stream)
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def env_level() -> Optional[str]:
    """``VGRAPH_LOGGING_LEVEL`` upper-cased, or None when unset or empty; ValueError if unknown."""
    value = os.environ.get(LEVEL_ENV, "").strip().upper()
    if not value:
        return None
    if value not in LEVELS:
        raise ValueError(f"{LEVEL_ENV}={os.environ[LEVEL_ENV]!r} is not a log level; choose one of "
                         f"{', '.join(LEVELS)}")
    return value


def configure_default_logging() -> None:
    """Adds the stderr handler to the "vgraph" logger (once per process) and sets its level."""
    logger = logging.getLogger(LOGGER_NAME)
    if os.environ.get(CONFIGURE_ENV, "1") != "0" and not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
    try:
        logger.setLevel(env_level() or "INFO")
    except ValueError as exc:  # a typo in the variable should not make ``import vgraph`` fail
        logger.setLevel("INFO")
        logger.warning("%s; using INFO", exc)


def set_level(level: str) -> None:
    """The "vgraph" logger's level, for callers that decide it (the CLI's ``--log-level``)."""
    logging.getLogger(LOGGER_NAME).setLevel(level)
