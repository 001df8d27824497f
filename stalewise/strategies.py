"""What a worker computes and pushes between two pulls.

A strategy turns the pulled parameters and the worker's data into one update.
The server's optimizer treats whatever arrives as a (pseudo-)gradient, which is
how plain asynchronous SGD and model averaging share one server.

* ``gradients()``: one minibatch gradient per push (the default).

Example:
    >>> import numpy as np
    >>> strat = gradients()
    >>> lg = lambda p, b: (float((p["x"] ** 2).sum()), {"x": 2 * p["x"]})
    >>> update, loss = strat.worker_step({"x": np.ones(2)}, lg, iter([None]))
    >>> update["x"].tolist(), loss
    ([2.0, 2.0], 2.0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

LossAndGrad = Callable[[Any, Any], tuple[float, Any]]


class Strategy(NamedTuple):
    """A worker strategy. Build one with :func:`gradients`."""

    kind: str  # "gradients"

    def worker_step(
        self, params: Any, loss_and_grad: LossAndGrad, batches: Iterator
    ) -> tuple[Any, float]:
        """Computes one update from ``params`` (the pulled tree); returns ``(update, loss)``."""
        loss, grads = loss_and_grad(params, next(batches))
        return grads, float(loss)


def gradients() -> Strategy:
    """Push the gradient of one minibatch per step (asynchronous SGD)."""
    return Strategy("gradients")
