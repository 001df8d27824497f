"""stalewise: asynchronous distributed training with parameter servers and model averaging.

Example:
    >>> import numpy as np, stalewise as sw
    >>> job = sw.Job({"w": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1),
    ...              consistency=sw.SSP(2), staleness=sw.staleness.inverse())
"""

from __future__ import annotations

import logging

from stalewise import codecs, consistency, optim, staleness, strategies, tree
from stalewise.api import Job
from stalewise.checkpoint import CheckpointError
from stalewise.checkpoint import load_params as load
from stalewise.consistency import ASP, BSP, SSP, Hybrid
from stalewise.launch import Context, init
from stalewise.loops import LocalSGD, LocalSGDOptax
from stalewise.runtime.base import (
    DivergedError,
    FailureWarning,
    ShardError,
    TrainResult,
    WorkerError,
)
from stalewise.runtime.local.attach import AttachError, attach

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
    "ShardError",
    "TrainResult",
    "WorkerError",
    "attach",
    "codecs",
    "consistency",
    "init",
    "load",
    "optim",
    "staleness",
    "strategies",
    "tree",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
