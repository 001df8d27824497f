"""Process helpers shared by the local runtime's shard and worker processes."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


@contextlib.contextmanager
def thread_budget(threads: int) -> Iterator[None]:
    """Caps the math-library threads of processes spawned inside the block.

    Several worker processes that each start one thread per core fight over the
    cores (torch on 2 cores with 2 workers ran 10x slower per push). Variables the
    user set are respected; the parent's environment is restored afterwards.
    """
    saved = {k: os.environ.get(k) for k in _THREAD_VARS}
    for k in _THREAD_VARS:
        os.environ.setdefault(k, str(max(1, threads)))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def child_logging(name: str) -> None:
    """Sends a spawned process's stalewise warnings and errors to stderr, named.

    A spawned child starts with no logging set up, and the package's NullHandler
    would swallow what the user must see (a refused push, a worker that never
    started); the parent's stderr is inherited, so that is where they go.
    """
    logger = logging.getLogger("stalewise")
    if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"stalewise {name}: %(levelname)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
