"""stalewise: asynchronous distributed training with parameter servers and model averaging.

Example:
    >>> import numpy as np, stalewise as sw
    >>> job = sw.Job({"w": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1),
    ...              consistency=sw.SSP(2), staleness=sw.staleness.inverse())
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from stalewise import codecs, consistency, optim, staleness, strategies, tree
from stalewise.api import Job
from stalewise.checkpoint import CheckpointError, load_params
from stalewise.consistency import ASP, BSP, SSP, Hybrid
from stalewise.launch import Context, init
from stalewise.loops import LocalSGD, LocalSGDOptax
from stalewise.runtime.attach import AttachError, attach
from stalewise.runtime.base import (
    DivergedError,
    FailureWarning,
    ServerClosed,
    ShardError,
    TrainResult,
    WorkerError,
)
from stalewise.runtime.options import RunOptions

__version__ = "0.1.0"

__all__ = [
    "ASP",
    "BSP",
    "SSP",
    "AttachError",
    "CheckpointError",
    "Context",
    "DivergedError",
    "FailureWarning",
    "Hybrid",
    "Job",
    "LocalSGD",
    "LocalSGDOptax",
    "RunOptions",
    "ServerClosed",
    "ShardError",
    "TrainResult",
    "WorkerError",
    "attach",
    "codecs",
    "consistency",
    "init",
    "load_params",
    "optim",
    "staleness",
    "strategies",
    "tree",
]


def __getattr__(name: str) -> Any:
    """``load``, the old name of :func:`load_params`, with a DeprecationWarning (it read
    like ``stalewise.checkpoint.load``, which reads a whole checkpoint, not params)."""
    if name == "load":
        warnings.warn(
            "sw.load is now sw.load_params (stalewise.checkpoint.load_params); the old name "
            "will be removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return load_params
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


logging.getLogger(__name__).addHandler(logging.NullHandler())
