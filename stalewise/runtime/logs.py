"""Logging of the processes a runtime starts (local processes, Ray actors)."""

from __future__ import annotations

import logging


def child_logging(name: str) -> None:
    """Sends a spawned process's stalewise warnings and errors to stderr, named by ``name``
    (``"worker 1"``, ``"shard 0"``), unless the ``stalewise`` logger already has a real handler."""
    logger = logging.getLogger("stalewise")
    if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"stalewise {name}: %(levelname)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
