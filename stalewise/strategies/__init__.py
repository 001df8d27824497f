"""What a worker computes and pushes between two pulls.

A strategy turns the pulled parameters and the worker's data into one update.
The server's optimizer treats whatever arrives as a (pseudo-)gradient, which is
how plain asynchronous SGD and model averaging share one server.

A strategy is stateful per worker: :meth:`Strategy.init` makes a worker's state
from the first parameters it pulls, and each :meth:`Strategy.step` gets the
state back, so a strategy can keep an inner optimizer's moments, local
parameters or an error-feedback residual across pushes. One step may run
several local steps; it returns the update, how many local steps it took (the
runtimes scale emulated and simulated compute time by it) and the loss. A
strategy that paces itself by time sets ``timed = True`` and gets the runtime's
clock at the start of every round (:meth:`Strategy.started`).

* ``gradients()``: one minibatch gradient per push (the default);
* model averaging (:mod:`stalewise.strategies.averaging`): ``local_sgd``,
  ``diloco`` (synchronous and asynchronous) and ``easgd``;
* streaming DiLoCo (:mod:`stalewise.strategies.streaming`): ``streaming_diloco``,
  fragments synced on staggered schedules, and its server optimizer ``lazy_leaves``;
* adaptive periods (:mod:`stalewise.strategies.adaptive`): ``adaptive`` with the
  schedules ``comm_budget``, ``adacomm`` and ``fixed``.

The package: :mod:`~stalewise.strategies.base` holds :class:`Strategy`,
:class:`Step` and :func:`gradients`; the methods import it, never the other way
round. Everything public is re-exported here (``sw.strategies.diloco``...).

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
