"""Adaptive local SGD / DiLoCo: a communication period ``H`` that tunes itself.

``adaptive(inner, schedule=...)`` is :func:`~stalewise.averaging.local_sgd`
(or, with ``outer="diloco"``, :func:`~stalewise.averaging.diloco`) whose number
of local steps per push, ``H``, is chosen anew at every push by a *schedule*.
The default schedule is AdaComm (Wang and Joshi 2019, "Adaptive Communication
Strategies to Achieve the Best Error-Runtime Trade-off in Local-Update SGD"):
start with a long period, to save communication while the loss is high, and
shorten it as the training loss falls, to lower the error floor.

Constructors (also under ``sw.strategies``):

* ``adaptive(inner, schedule=adacomm(start=32, min_steps=1), outer="local_sgd")``;
  ``adaptive(inner, start=32, min_steps=1)`` is a shorthand for that default schedule;
* ``adacomm(start, min_steps)``: the AdaComm schedule;
* ``fixed(steps)``: ``H = steps`` at every push, which is ``local_sgd(steps=steps)``.

The recommended server optimizer is the worker side's: ``sgd(1.0)`` for
``outer="local_sgd"``, DiLoCo's Nesterov ``sgd(0.7, 0.9)`` for
``outer="diloco"`` (delayed Nesterov with ``asynchronous=True, every=N``).

One round (one push) of a worker
--------------------------------
Round ``k`` of a worker, with ``F`` its smoothed training loss:

1. pull the global parameters ``x_k``; the local parameters restart from them
   (the inner optimizer's state persists, unless ``reset_inner``), as in
   local SGD;
2. run **one** local step from ``x_k``; its loss, the loss at the pulled
   parameters on one minibatch, enters ``F``;
3. ask the schedule: ``H_k, s = schedule.next(s, F)`` (``H_k`` an integer >= 1,
   the round's local steps *including* the one just taken);
4. run the other ``H_k - 1`` local steps (each loss enters ``F``), push
   ``x_k - local`` and report ``local_steps = H_k``, so the runtimes scale
   emulated and simulated compute time by it.

``F`` is an exponential moving average over the worker's local steps, all
rounds together: the first finite loss sets ``F``, each later one makes ``F =
smoothing * F + (1 - smoothing) * loss`` (``smoothing=0.9`` by default; ``0``
makes ``F`` the loss at the pulled parameters). Non-finite losses are skipped;
``F`` is NaN until a finite loss was seen. ``F`` and the schedule's state live
in the worker's state (:class:`AdaptiveState`); a worker that rejoins (a new
incarnation) starts over with a fresh state.

The AdaComm rule
----------------
``adacomm(start=H_0, min_steps=h_min)`` takes ``F_0`` = the first finite ``F``
it is given, which is the loss of the worker's very first local step, at the
initial parameters, and at every round::

    H_k = min(H_0, max(h_min, ceil(sqrt(max(F_k, 0) / F_0) * H_0)))

so the first round runs ``H_0`` steps, and a loss down by 4x halves ``H``. A
non-finite ``F_k`` keeps the previous ``H``. The rule assumes a loss bounded
below by 0: a first loss ``F_0 <= 0`` raises ``ValueError``.

Differences from the paper: there, all workers average synchronously and the
period is updated every ``T_0`` wall-clock seconds from the loss at the
averaged model; here each worker updates its own ``H`` at each of its pushes
from its own smoothed training loss (which includes the loss at the pulled
global parameters), so under ASP workers may run different ``H``; under BSP
they differ only by the noise of their minibatches.

Custom schedules
----------------
A schedule is any picklable object (it travels with the strategy) with two
methods:

* ``init() -> state``: the state of one worker's schedule (anything);
* ``next(state, loss) -> (H, state)``: called once per round, after the round's
  first local step, with the smoothed loss ``F`` (a float, NaN if no finite
  loss was seen yet); returns the round's number of local steps ``H`` (an
  integer >= 1, the first step included) and the next state.

Frozen dataclasses make good schedules: they pickle and compare by value, so
strategies built with equal schedules are equal.

Example:
    >>> import numpy as np
    >>> import stalewise as sw
    >>> sched = adacomm(start=32, min_steps=2)
    >>> state, periods = sched.init(), []
    >>> for loss in (4.0, 4.0, 1.0, 0.04, 1e-6):
    ...     h, state = sched.next(state, loss)
    ...     periods.append(h)
    >>> periods  # ceil(sqrt(F / 4) * 32), within [2, 32]
    [32, 32, 16, 4, 2]
    >>> strat = adaptive(sw.optim.sgd(0.05), start=8, smoothing=0.0)
    >>> lg = lambda p, b: (float((p["x"] ** 2).sum()), {"x": 2 * p["x"]})
    >>> params = {"x": np.ones(1)}
    >>> state, taken = strat.init(params), []
    >>> for _ in range(7):  # one worker, server sgd(1.0): the pull is its local params
    ...     step = strat.step(state, params, lg, iter(lambda: None, 1))
    ...     params = {"x": params["x"] - step.update["x"]}
    ...     taken.append(step.local_steps)
    >>> taken  # F_k / F_0 = x_k ** 2, so H_k = ceil(8 |x_k|); x shrinks by 0.9 a step
    [8, 4, 3, 2, 2, 2, 1]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stalewise import optim
from stalewise.averaging import (
    AveragingState,
    LocalSGD,
    _check_steps,
    _describe_inner,
    _run_local,
    diloco,
    local_sgd,
)
from stalewise.optim._validate import check_number
from stalewise.strategies import LossAndGrad, Step, Strategy

__all__ = [
    "AdaComm",
    "AdaCommState",
    "Adaptive",
    "AdaptiveState",
    "Fixed",
    "adacomm",
    "adaptive",
    "fixed",
]


# -- schedules -------------------------------------------------------------------------


@dataclass(frozen=True)
class AdaCommState:
    """One worker's AdaComm state: ``F_0`` (NaN until a finite loss was seen) and the last ``H``."""

    initial: float
    steps: int


@dataclass(frozen=True)
class AdaComm:
    """``H_k = ceil(sqrt(F_k / F_0) * start)`` within ``[min_steps, start]``; see :func:`adacomm`."""

    start: int = 32
    min_steps: int = 1

    def __post_init__(self) -> None:
        start = _check_steps("adacomm", "start", self.start)
        min_steps = _check_steps("adacomm", "min_steps", self.min_steps)
        if min_steps > start:
            raise ValueError(f"adacomm: min_steps={min_steps} exceeds start={start}")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "min_steps", min_steps)

    def init(self) -> AdaCommState:
        return AdaCommState(math.nan, self.start)

    def next(self, state: AdaCommState, loss: float) -> tuple[int, AdaCommState]:
        loss = float(loss)
        if not math.isfinite(loss):
            return state.steps, state  # nothing to go by: keep the period
        initial = state.initial
        if math.isnan(initial):
            if loss <= 0:
                raise ValueError(
                    f"adacomm: the first training loss is {loss!r}; the AdaComm rule scales H "
                    "by sqrt(F_k / F_0) and needs losses bounded below by 0 with F_0 > 0"
                )
            initial = loss
        steps = math.ceil(math.sqrt(max(loss, 0.0) / initial) * self.start)
        steps = min(self.start, max(self.min_steps, steps))
        return steps, AdaCommState(initial, steps)

    def __repr__(self) -> str:
        return f"adacomm(start={self.start}, min_steps={self.min_steps})"


@dataclass(frozen=True)
class Fixed:
    """``H = steps`` at every push; see :func:`fixed`."""

    steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", _check_steps("fixed", "steps", self.steps))

    def init(self) -> None:
        return None

    def next(self, state: None, loss: float) -> tuple[int, None]:
        return self.steps, state

    def __repr__(self) -> str:
        return f"fixed({self.steps})"


def adacomm(start: int = 32, min_steps: int = 1) -> AdaComm:
    """The AdaComm schedule (Wang and Joshi 2019): ``H`` shrinks as ``sqrt`` of the loss.

    ``H_k = min(start, max(min_steps, ceil(sqrt(max(F_k, 0) / F_0) * start)))``
    with ``F_0`` the first finite loss the schedule is given and ``F_k`` the
    worker's smoothed loss at round ``k``; see the module docstring.

    Args:
        start: ``H_0``, the first period and the largest.
        min_steps: the smallest period.

    Example:
        >>> s = adacomm(start=10)
        >>> h, state = s.next(s.init(), 2.0)
        >>> h, s.next(state, 0.5)[0]  # a quarter of the loss: half the period
        (10, 5)
    """
    return AdaComm(start, min_steps)


def fixed(steps: int) -> Fixed:
    """The trivial schedule: ``H = steps`` at every push (``local_sgd(steps=steps)``).

    Example:
        >>> fixed(4).next(fixed(4).init(), 1.0)
        (4, None)
    """
    return Fixed(steps)


# -- the strategy ------------------------------------------------------------------------


@dataclass(eq=False)
class AdaptiveState(AveragingState):
    """One worker's state for :func:`adaptive`: local SGD's, plus the schedule's.

    Made by the strategy's ``init`` from the first pull; it lives in the worker.
    """

    schedule: Any = None  # the schedule's state (from schedule.init(), then schedule.next)
    loss: float = math.nan  # F: the smoothed training loss of the local steps (NaN: none yet)
    local_steps: int = 0  # H of the last round


class Adaptive(Strategy):
    """Local SGD / DiLoCo with ``H`` picked at every push by a schedule; see :func:`adaptive`."""

    name = "adaptive"

    def __init__(self, schedule: Any, local: LocalSGD, *, smoothing: float = 0.9):
        if not (
            callable(getattr(schedule, "init", None)) and callable(getattr(schedule, "next", None))
        ):
            raise TypeError(
                "adaptive: schedule must have init() -> state and next(state, loss) -> "
                f"(H, state), e.g. sw.strategies.adacomm(start=32); got {schedule!r}"
            )
        self.schedule = schedule
        self.local = local  # the worker side and the server recommendation; its steps is unused
        self.smoothing = check_number("adaptive", "smoothing", smoothing, 0.0, 1.0)

    def init(self, params: Any) -> AdaptiveState:
        base = self.local.init(params)
        return AdaptiveState(**vars(base), schedule=self.schedule.init())

    def _observe(self, state: AdaptiveState, loss: Any) -> None:
        x = float(loss)
        if not math.isfinite(x):
            return
        if math.isnan(state.loss):
            state.loss = x
        else:
            state.loss = self.smoothing * state.loss + (1.0 - self.smoothing) * x

    def step(
        self, state: AdaptiveState, params: Any, loss_and_grad: LossAndGrad, batches: Iterator
    ) -> Step:
        inner = self.local._inner

        def observed(p: Any, batch: Any) -> tuple[Any, Any]:
            loss, grads = loss_and_grad(p, batch)
            self._observe(state, loss)
            return loss, grads

        def run() -> tuple[int, float]:
            _, first = _run_local(inner, state, observed, batches, 1, None)
            first_time = state.step_time
            h, state.schedule = self.schedule.next(state.schedule, state.loss)
            h = _check_steps(f"adaptive: schedule {self.schedule!r}", "H", h)
            state.local_steps = h
            if h == 1:
                return 1, first
            m, rest = _run_local(inner, state, observed, batches, h - 1, None)
            state.step_time = (first_time + m * state.step_time) / h
            return h, (first + m * rest) / h

        return self.local._round(state, params, run)

    def server_optimizer(self, workers: int | None = None) -> optim.Optimizer:
        """The worker side's: ``sgd(1.0)``, DiLoCo's Nesterov SGD or delayed Nesterov."""
        if self.local.asynchronous and self.local.every is None and workers is None:
            raise TypeError(
                f"{self!r} recommends delayed_nesterov(every=number of workers) as the server "
                "optimizer, but the number of workers is not known here: pass every=<workers> "
                "to adaptive(), or an optimizer= to the Job"
            )
        return self.local.server_optimizer(workers)

    def __repr__(self) -> str:
        parts = [f"schedule={self.schedule!r}", f"inner={_describe_inner(self.local.inner)}"]
        parts.append(f"outer={self.local.name!r}")
        if self.local.asynchronous:
            parts.append(f"asynchronous=True, every={self.local.every}")
        if self.local.reset_inner:
            parts.append("reset_inner=True")
        parts.append(f"smoothing={self.smoothing:g}")
        return f"adaptive({', '.join(parts)})"


def adaptive(
    inner: Any = None,
    *,
    schedule: Any = None,
    start: int | None = None,
    min_steps: int | None = None,
    outer: str = "local_sgd",
    smoothing: float = 0.9,
    reset_inner: bool = False,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    asynchronous: bool = False,
    every: int | None = None,
) -> Adaptive:
    """Local SGD (or DiLoCo) whose local steps per push, ``H``, follow a schedule.

    Each round takes one local step from the pulled parameters, asks the
    schedule for ``H`` with the worker's smoothed training loss, then takes the
    other ``H - 1`` steps and pushes ``pulled - local``; the step reports
    ``local_steps = H``. See the module docstring for the exact rule.

    Args:
        inner: the worker's optimizer, as for :func:`~stalewise.averaging.local_sgd`
            (required with ``outer="local_sgd"``; DiLoCo's default
            ``sw.optim.adamw(1e-3)`` with ``outer="diloco"``).
        schedule: picks ``H``: :func:`adacomm` (the default), :func:`fixed` or any
            object with ``init()`` and ``next(state, loss) -> (H, state)``.
        start: shorthand for ``schedule=adacomm(start=start, ...)`` (default 32).
        min_steps: shorthand for ``schedule=adacomm(min_steps=min_steps, ...)`` (default 1).
        outer: ``"local_sgd"`` (recommended server optimizer ``sgd(1.0)``) or
            ``"diloco"`` (DiLoCo's Nesterov SGD; delayed Nesterov if ``asynchronous``).
        smoothing: the per-local-step decay of the loss's moving average, in ``[0, 1)``.
        reset_inner: make a fresh inner optimizer state at every pull.
        outer_lr: DiLoCo's outer learning rate (``outer="diloco"`` only; default 0.7).
        outer_momentum: DiLoCo's outer Nesterov momentum (``outer="diloco"`` only; default 0.9).
        asynchronous: recommend delayed Nesterov, for ASP (``outer="diloco"`` only).
        every: delayed Nesterov's ``N``, the number of workers.

    Example:
        >>> import stalewise as sw
        >>> s = adaptive(outer="diloco", start=64, min_steps=4)
        >>> s.schedule, s.local.name
        (adacomm(start=64, min_steps=4), 'diloco')
        >>> s.server_optimizer().apply.__self__
        _Sgd(lr=0.7, momentum=0.9, nesterov=True, weight_decay=0.0)
    """
    if schedule is None:
        schedule = adacomm(32 if start is None else start, 1 if min_steps is None else min_steps)
    elif start is not None or min_steps is not None:
        raise ValueError(
            "adaptive: start= and min_steps= configure the default adacomm schedule; with "
            "schedule= pass them to the schedule instead, e.g. adacomm(start=64, min_steps=2)"
        )
    diloco_only = {
        "outer_lr": outer_lr,
        "outer_momentum": outer_momentum,
        "asynchronous": asynchronous or None,
        "every": every,
    }
    given = {k: v for k, v in diloco_only.items() if v is not None}
    if outer == "local_sgd":
        if given:
            raise ValueError(
                f"adaptive: {', '.join(given)} configure DiLoCo's outer optimizer; pass "
                "outer='diloco'"
            )
        if inner is None:
            raise TypeError(
                "adaptive: inner= is required with outer='local_sgd', e.g. sw.optim.sgd(0.05)"
            )
        local = local_sgd(1, inner, reset_inner=reset_inner)
    elif outer == "diloco":
        local = diloco(1, inner, reset_inner=reset_inner, **given)
    else:
        raise ValueError(f"adaptive: outer must be 'local_sgd' or 'diloco', got {outer!r}")
    return Adaptive(schedule, local, smoothing=smoothing)
