"""nanopaged's log lines: what the engine is doing while it starts (fetching or
converting the model, building a kernel, loading weights, sizing the KV cache) and
anything that goes wrong while it serves.

Every module logs through `logging.getLogger(__name__)`, under the "nanopaged" logger.
Importing nanopaged gives that logger a handler of its own that writes to stderr at
INFO (vLLM does the same in `vllm/logger.py`), so a user sees progress without setting
up logging; it does not propagate, so an application's own root handler does not print
each line twice. Two environment variables change it, read at import:

    NANOPAGED_LOGGING_LEVEL=WARNING     only warnings and errors (default INFO)
    NANOPAGED_CONFIGURE_LOGGING=0       leave the "nanopaged" logger to the application

Child processes (the EngineCore, tensor-parallel workers) import nanopaged too and write
to the stderr they inherit, so their lines appear beside the parent's.
"""
from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each line (a test's capture, a
    redirect made after import), not to the one there was at import."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging() -> None:
    """Give the "nanopaged" logger its stderr handler and level (see the module doc).
    Idempotent; does nothing when NANOPAGED_CONFIGURE_LOGGING=0.

    Raises:
        ValueError: NANOPAGED_LOGGING_LEVEL is not a level name (DEBUG, INFO, ...).
    """
    if os.environ.get("NANOPAGED_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("nanopaged")
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    level = os.environ.get("NANOPAGED_LOGGING_LEVEL", "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"NANOPAGED_LOGGING_LEVEL must be a logging level name, got {level!r}")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
