"""stalewise: asynchronous distributed training with parameter servers and model averaging.

Example:
    >>> import numpy as np, stalewise as sw
    >>> job = sw.Job({"w": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1),
    ...              consistency=sw.SSP(2), staleness=sw.staleness.inverse())
"""

import logging as _logging

from stalewise import codecs, consistency, optim, staleness, strategies, tree
from stalewise.api import Job
from stalewise.checkpoint import CheckpointError, load_params
from stalewise.consistency import ASP, BSP, SSP, Hybrid
from stalewise.launch import BudgetSpent, Context, init
from stalewise.loops import LocalSGD, LocalSGDOptax
from stalewise.options import Checkpoints, Emulation, Failures, Metrics, Simulation, Timeouts
from stalewise.protocol.notices import FailureWarning
from stalewise.runtime.attach import AttachError, attach
from stalewise.runtime.errors import DivergedError, ServerClosed, ShardError, WorkerError
from stalewise.runtime.options import RunOptions
from stalewise.runtime.result import TrainResult

__version__ = "0.1.0"

__all__ = ["ASP", "BSP", "SSP", "AttachError", "BudgetSpent", "CheckpointError", "Checkpoints"]
__all__ += ["Context", "DivergedError", "Emulation", "FailureWarning", "Failures", "Hybrid", "Job"]
__all__ += ["LocalSGD", "LocalSGDOptax", "Metrics", "RunOptions", "ServerClosed", "ShardError"]
__all__ += ["Simulation", "Timeouts", "TrainResult", "WorkerError", "attach", "codecs"]
__all__ += ["consistency", "init", "load_params", "optim", "staleness", "strategies", "tree"]


def __getattr__(name: str) -> object:
    """An old name says its new one (for one release): ``sw.load`` is ``sw.load_params``."""
    new = {"load": "load_params"}.get(name)
    hint = f": it is now sw.{new}" if new else ""
    raise AttributeError(f"module 'stalewise' has no attribute {name!r}{hint}")


def __dir__() -> list[str]:
    """The public names only (``__all__``), not the submodules and helpers imported here."""
    return sorted([*__all__, "__version__"])


_logging.getLogger(__name__).addHandler(_logging.NullHandler())
