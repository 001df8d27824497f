"""What a user sees of a failure in plain Python: :class:`FailureWarning`, warned at the
first caller outside stalewise. Below the runtimes, so checkpoints warn through it too."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["FailureWarning", "warn_user"]


class FailureWarning(UserWarning):
    """Something failed during a run and changed its result (a worker or shard restarted,
    updates lost, a checkpoint not written); the event is also in ``TrainResult.failures``."""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_user(message: str) -> None:
    """Warns ``message`` as a :class:`FailureWarning` at the first caller outside stalewise."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, FailureWarning, stacklevel=level)
