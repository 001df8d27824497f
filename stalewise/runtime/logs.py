"""Logging of the processes a runtime starts (local processes, Ray actors).

Every runtime imports this module, and it imports none of them: no runtime
depends on another.
"""

from __future__ import annotations

import logging


def child_logging(name: str) -> None:
    """Sends a spawned process's stalewise warnings and errors to stderr, named.

    A spawned child starts with no logging set up, and the package's NullHandler
    would swallow what the user must see (a refused push, a worker that never
    started); the parent's stderr is inherited, so that is where they go.
    ``name`` says which process wrote a line (``"worker 1"``, ``"shard 0"``).
    Does nothing when the ``stalewise`` logger already has a real handler.

    Example:
        >>> child_logging("worker 0")  # doctest: +SKIP
    """
    logger = logging.getLogger("stalewise")
    if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"stalewise {name}: %(levelname)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
