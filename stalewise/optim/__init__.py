"""Optimizers (:mod:`.base`) on flat parameter vectors; learning rates: floats or :mod:`.schedules`.

Example:
    >>> import numpy as np
    >>> from stalewise import optim
    >>> from stalewise.segments import Segments
    >>> opt = optim.chain(
    ...     optim.clip_by_global_norm(1.0),
    ...     optim.lamb(optim.warmup_cosine(1e-3, warmup=100, total=5000), weight_decay=0.01),
    ... )
    >>> params = np.ones(6, np.float32)
    >>> state = opt.init(params, Segments.from_sizes(["w", "b"], [4, 2]))
    >>> for _ in range(3):
    ...     opt.apply(np.full(6, 0.5, np.float32), state, params, scale=0.5)
    >>> bool(params[0] < 1.0)
    True
"""

from stalewise.optim.adam import AdamState, MaskedAdamState, adam, adamw
from stalewise.optim.base import (
    EmptyState,
    LearningRate,
    Optimizer,
    Rule,
    Schedule,
    State,
    chain,
    clip_by_global_norm,
    copy_state,
    learning_rate,
)
from stalewise.optim.delayed import DelayedNesterovState, delayed_nesterov
from stalewise.optim.lamb import LambState, lamb
from stalewise.optim.lars import LarsState, lars
from stalewise.optim.schedules import constant, step_decay, warmup_cosine
from stalewise.optim.sgd import MaskedSgdState, SgdState, sgd

__all__ = ["AdamState", "DelayedNesterovState", "EmptyState", "LambState", "LarsState"]
__all__ += ["LearningRate", "MaskedAdamState", "MaskedSgdState", "Optimizer", "Rule", "Schedule"]
__all__ += ["SgdState", "State", "adam", "adamw", "chain", "clip_by_global_norm", "constant"]
__all__ += ["copy_state", "delayed_nesterov", "lamb", "lars", "learning_rate", "sgd", "step_decay"]
__all__ += ["warmup_cosine"]
