"""Strategies' base: :class:`Strategy`, :class:`Step`, :func:`config_key`, :func:`gradients`."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from stalewise import optim

LossAndGrad = Callable[[Any, Any], tuple[float, Any]]


class Step(NamedTuple):
    """What one strategy step produced."""

    update: Any  # what to push: a tree with the structure of the params
    local_steps: int  # minibatches it consumed (compute time is scaled by it)
    loss: float  # the (mean) training loss of those minibatches
    state: Any  # the worker's strategy state to hand to the next step


class Strategy:
    """Override :meth:`init` and :meth:`step`; picklable config only (mutable data: the state)."""

    name = "strategy"
    #: Paced by the runtime's clock: the worker loop calls :meth:`started` before every step.
    timed = False

    def init(self, params: Any) -> Any:
        """The worker's initial state, from the first parameters it pulled."""
        return None

    def warm_up(self, params: Any = None) -> None:
        """Loads the compiled code its steps run (kernels; an ``init(params)``) before the clock."""
        importlib.import_module("stalewise.optim._kernels")
        if params is not None:
            self.init(params)

    def started(self, state: Any, now: float) -> None:
        """A ``timed`` strategy's round starts: its pull arrived at runtime clock ``now``."""

    def step(self, state: Any, params: Any, loss_and_grad: LossAndGrad, batches: Iterator) -> Step:
        """Computes one update from ``params`` (the tree just pulled, unchanged until it returns)."""
        raise NotImplementedError

    def check_consistency(self, consistency: Any, *, recommended: bool) -> None:
        """Raises ValueError (one line) if this strategy must not run under ``consistency``
        (``recommended``: with its own :meth:`server_optimizer`); the default accepts all."""

    def server_optimizer(self, workers: int | None = None) -> Any:
        """The recommended server optimizer (None: none); TypeError if it needs ``workers``."""
        return None

    def __repr__(self) -> str:
        return f"{self.name}()"

    def _config(self) -> tuple:
        """The configuration strategies compare by: public attributes, by :func:`config_key`."""
        return tuple(sorted((k, config_key(v)) for k, v in vars(self).items() if k[0] != "_"))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._config() == self._config()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        try:
            return hash((type(self), self._config()))
        except TypeError:  # an unhashable piece of configuration
            return hash((type(self), self.name))


def config_key(x: Any) -> Any:
    """A value that compares (and hashes) by configuration, also after pickling."""
    if isinstance(x, optim.Optimizer):
        rule = getattr(x.apply, "__self__", None)
        return ("optimizer", config_key(rule)) if rule is not None else tuple(map(config_key, x))
    if isinstance(x, functools.partial):
        keywords = tuple(sorted((k, config_key(v)) for k, v in x.keywords.items()))
        return ("partial", config_key(x.func), config_key(x.args), keywords)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x), tuple(config_key(getattr(x, f.name)) for f in dataclasses.fields(x)))
    if isinstance(x, tuple):
        return tuple(config_key(v) for v in x)
    return x


class Gradients(Strategy):
    name = "gradients"

    def warm_up(self, params: Any = None) -> None:
        """Nothing: a gradient step runs only the user's code."""

    def step(self, state: Any, params: Any, loss_and_grad: LossAndGrad, batches: Iterator) -> Step:
        loss, grads = loss_and_grad(params, next(batches))
        return Step(grads, 1, float(loss), state)


def gradients() -> Strategy:
    """Push the gradient of one minibatch per step (asynchronous SGD)."""
    return Gradients()
