"""What a worker computes and pushes between two pulls.

A strategy turns the pulled parameters and the worker's data into one update.
The server's optimizer treats whatever arrives as a (pseudo-)gradient, which is
how plain asynchronous SGD and model averaging share one server.

A strategy is stateful per worker: :meth:`Strategy.init` makes a worker's state
from the first parameters it pulls, and each :meth:`Strategy.step` gets the
state back, so a strategy can keep an inner optimizer's moments, local
parameters or an error-feedback residual across pushes. One step may run
several local steps; it returns the update, how many local steps it took (the
runtimes scale emulated and simulated compute time by it) and the loss.

* ``gradients()``: one minibatch gradient per push (the default).

Example:
    >>> import numpy as np
    >>> strat = gradients()
    >>> lg = lambda p, b: (float((p["x"] ** 2).sum()), {"x": 2 * p["x"]})
    >>> params = {"x": np.ones(2)}
    >>> step = strat.step(strat.init(params), params, lg, iter([None]))
    >>> step.update["x"].tolist(), step.local_steps, step.loss
    ([2.0, 2.0], 1, 2.0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

LossAndGrad = Callable[[Any, Any], tuple[float, Any]]


class Step(NamedTuple):
    """What one strategy step produced."""

    update: Any  # what to push: a tree with the structure of the params
    local_steps: int  # minibatches it consumed (compute time is scaled by it)
    loss: float  # the (mean) training loss of those minibatches
    state: Any  # the worker's strategy state to hand to the next step


class Strategy:
    """A worker strategy; subclass it and override :meth:`init` and :meth:`step`.

    Instances must be picklable (they travel to worker processes) and hold only
    configuration; per-worker mutable data belongs in the state.
    """

    name = "strategy"

    def init(self, params: Any) -> Any:
        """The worker's initial state, from the first parameters it pulled."""
        return None

    def step(self, state: Any, params: Any, loss_and_grad: LossAndGrad, batches: Iterator) -> Step:
        """Computes one update from ``params`` (the tree just pulled)."""
        raise NotImplementedError

    def server_optimizer(self, workers: int | None = None) -> Any:
        """The server optimizer this strategy recommends, or None to have the user choose.

        ``sw.Job(params, strategy=s)`` without ``optimizer=`` uses it. ``workers``
        is the number of workers when the caller knows it (a strategy whose
        recommendation depends on it may raise ``TypeError`` without it).
        """
        return None

    def __repr__(self) -> str:
        return f"{self.name}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))


class Gradients(Strategy):
    """Push the gradient of one minibatch per step (asynchronous SGD)."""

    name = "gradients"

    def step(self, state: Any, params: Any, loss_and_grad: LossAndGrad, batches: Iterator) -> Step:
        loss, grads = loss_and_grad(params, next(batches))
        return Step(grads, 1, float(loss), state)


def gradients() -> Strategy:
    """Push the gradient of one minibatch per step (asynchronous SGD)."""
    return Gradients()


from stalewise.adaptive import adacomm, adaptive, fixed  # noqa: E402, F401
from stalewise.averaging import diloco, easgd, local_sgd  # noqa: E402, F401  (re-exported)
