"""What a worker computes and pushes between two pulls.

A strategy turns the pulled parameters and the worker's data into one update, which the
server's optimizer treats as a (pseudo-)gradient. :meth:`Strategy.init` makes a worker's
state from its first pull; each :meth:`Strategy.step` may run several local steps and
returns the update, its local steps and the loss. A strategy that paces itself sets
``timed = True`` and gets the runtime's clock at every round (:meth:`Strategy.started`).
``gradients()`` (the default) pushes one minibatch gradient; model averaging
(:mod:`~stalewise.strategies.averaging`): ``local_sgd``, ``diloco``, ``easgd``; streaming
DiLoCo (:mod:`~stalewise.strategies.streaming`): ``streaming_diloco``, ``lazy_leaves``;
adaptive periods (:mod:`~stalewise.strategies.adaptive`): ``adaptive``, ``comm_budget``,
``adacomm``, ``fixed``.

Example:
    >>> import numpy as np
    >>> strat = gradients()
    >>> lg = lambda p, b: (float((p["x"] ** 2).sum()), {"x": 2 * p["x"]})
    >>> params = {"x": np.ones(2)}
    >>> step = strat.step(strat.init(params), params, lg, iter([None]))
    >>> step.update["x"].tolist(), step.local_steps, step.loss
    ([2.0, 2.0], 1, 2.0)
"""

from stalewise.strategies.adaptive import (
    AdaComm,
    AdaCommState,
    Adaptive,
    AdaptiveState,
    CommBudget,
    CommBudgetState,
    Fixed,
    adacomm,
    adaptive,
    comm_budget,
    fixed,
)
from stalewise.strategies.averaging import (
    EASGD,
    AveragingState,
    LocalSGDStrategy,
    diloco,
    easgd,
    local_sgd,
)
from stalewise.strategies.base import (
    Gradients,
    LossAndGrad,
    Step,
    Strategy,
    config_key,
    gradients,
)
from stalewise.strategies.streaming import (
    LazyLeaves,
    StreamingDiLoCo,
    StreamingState,
    lazy_leaves,
    streaming_diloco,
)

__all__ = [
    "EASGD",
    "AdaComm",
    "AdaCommState",
    "Adaptive",
    "AdaptiveState",
    "AveragingState",
    "CommBudget",
    "CommBudgetState",
    "Fixed",
    "Gradients",
    "LazyLeaves",
    "LocalSGDStrategy",
    "LossAndGrad",
    "Step",
    "Strategy",
    "StreamingDiLoCo",
    "StreamingState",
    "adacomm",
    "adaptive",
    "comm_budget",
    "config_key",
    "diloco",
    "easgd",
    "fixed",
    "gradients",
    "lazy_leaves",
    "local_sgd",
    "streaming_diloco",
]
