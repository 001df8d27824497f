"""Adaptive local SGD / DiLoCo: a communication period ``H`` that tunes itself.

:func:`adaptive`'s *schedule* picks ``H`` anew at every push, after the round's first local step,
from the smoothed loss and the rounds' lengths: :func:`comm_budget`, :func:`adacomm`, :func:`fixed`.

A custom schedule is picklable, with ``init() -> state``, ``next(state, loss) -> (H, state)``
(``loss`` NaN until a finite one) and optionally ``observe(state, steps, seconds) -> state``
(the last round, by the runtime's clock). Why: docs/design-notes.md, "Model averaging"."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from stalewise import optim
from stalewise.optim._validate import check_integer, check_number
from stalewise.pacing import RoundCost
from stalewise.strategies.averaging import (
    AveragingState,
    LocalSGDStrategy,
    _check_outer,
    _describe_inner,
    _run_local,
    _timed_round,
    diloco,
    local_sgd,
)
from stalewise.strategies.base import LossAndGrad, Step, Strategy

__all__ = ["AdaComm", "AdaCommState", "Adaptive", "AdaptiveState", "CommBudget", "CommBudgetState"]
__all__ += ["Fixed", "adacomm", "adaptive", "comm_budget", "fixed"]


@dataclass(frozen=True)
class AdaCommState:
    """One worker's AdaComm state: ``F_0`` (NaN until a finite loss was seen) and the last ``H``."""

    initial: float
    steps: int


@dataclass(frozen=True)
class AdaComm:
    local_steps: int = 32  # H_0
    min_steps: int = 1

    def __post_init__(self) -> None:
        start = check_integer("adacomm: local_steps", self.local_steps)
        min_steps = check_integer("adacomm: min_steps", self.min_steps)
        if min_steps > start:
            raise ValueError(f"adacomm: min_steps={min_steps} exceeds local_steps={start}")
        object.__setattr__(self, "local_steps", start)
        object.__setattr__(self, "min_steps", min_steps)

    def init(self) -> AdaCommState:
        return AdaCommState(math.nan, self.local_steps)

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
        steps = math.ceil(math.sqrt(max(loss, 0.0) / initial) * self.local_steps)
        steps = min(self.local_steps, max(self.min_steps, steps))
        return steps, AdaCommState(initial, steps)

    def __repr__(self) -> str:
        return f"adacomm(local_steps={self.local_steps}, min_steps={self.min_steps})"


@dataclass(frozen=True)
class CommBudgetState:
    """One worker's :func:`comm_budget` state: the fit of its rounds, the last ``H`` and rounds."""

    cost: RoundCost
    steps: int  # H of the last round (NaN-free: local_steps before the first)
    rounds: int = 0  # rounds asked for so far
    target: int = 0  # the rule's H of the last round, before the alternation of odd rounds


@dataclass(frozen=True)
class CommBudget:
    fraction: float = 0.1
    local_steps: int = 4  # the first rounds' H
    min_steps: int = 1
    max_steps: int = 64
    memory: float = 0.9

    def __post_init__(self) -> None:
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ValueError(f"comm_budget: fraction must be a number in (0, 1), got {fraction!r}")
        if not 0 < fraction < 1:
            raise ValueError(f"comm_budget: fraction must be in (0, 1), got {fraction!r}")
        for name in ("local_steps", "min_steps", "max_steps"):
            object.__setattr__(
                self, name, check_integer(f"comm_budget: {name}", getattr(self, name))
            )
        lo, start, hi = self.min_steps, self.local_steps, self.max_steps
        if not lo <= start <= hi:
            raise ValueError(
                f"comm_budget: need min_steps <= local_steps <= max_steps, got min_steps={lo}, "
                f"local_steps={start}, max_steps={hi}"
            )
        memory = check_number("comm_budget", "memory", self.memory, 0.0, 1.0)
        object.__setattr__(self, "fraction", float(fraction))
        object.__setattr__(self, "memory", memory)

    def init(self) -> CommBudgetState:
        return CommBudgetState(RoundCost(self.memory), self.local_steps)

    def observe(self, state: CommBudgetState, steps: int, seconds: float) -> CommBudgetState:
        """The last round ran ``steps`` local steps and lasted ``seconds`` (pull to pull)."""
        if state.rounds <= 1:  # the first round: it includes the job's start-up
            return state
        return replace(state, cost=state.cost.add(steps, seconds))

    def target(self, cost: RoundCost, last: int) -> int:
        """The rule's ``H`` from the fit of the rounds: see :func:`comm_budget`."""
        fit = cost.fit()
        if fit is None:
            return self.local_steps
        c, s = fit
        hi = min(self.max_steps, 4 * last)
        if s <= 0:
            return max(self.min_steps, hi)
        f = self.fraction
        h = math.ceil(c * (1.0 - f) / (f * s) - 1e-9)
        return max(self.min_steps, min(hi, h))

    def next(self, state: CommBudgetState, loss: float) -> tuple[int, CommBudgetState]:
        k, seen = state.rounds, state.cost.rounds
        if seen == 0:  # nothing measured yet
            target = h = self.local_steps
        elif seen == 1:  # one round: measure a second, of H 4x, or a quarter if above max_steps
            h = 4 * self.local_steps
            target = h = h if h <= self.max_steps else max(self.min_steps, self.local_steps // 4)
        else:
            target = h = self.target(state.cost, state.steps)
            if k % 4 == 2:  # one round in 4 runs half the period, so that c and s stay apart
                half = target // 2
                h = half if half >= self.min_steps else min(2 * target, self.max_steps)
        return h, CommBudgetState(state.cost, h, k + 1, target)

    def __repr__(self) -> str:
        return (
            f"comm_budget(fraction={self.fraction:g}, local_steps={self.local_steps}, "
            f"min_steps={self.min_steps}, max_steps={self.max_steps}, memory={self.memory:g})"
        )


@dataclass(frozen=True)
class Fixed:
    local_steps: int

    def __post_init__(self) -> None:
        value = check_integer("fixed: local_steps", self.local_steps)
        object.__setattr__(self, "local_steps", value)

    def init(self) -> None:
        return None

    def next(self, state: None, loss: float) -> tuple[int, None]:
        return self.local_steps, state

    def __repr__(self) -> str:
        return f"fixed({self.local_steps})"


def adacomm(local_steps: int = 32, min_steps: int = 1) -> AdaComm:
    """The AdaComm schedule (Wang and Joshi 2019): ``H`` shrinks as ``sqrt`` of the loss.

    ``H_k = min(H_0, max(min_steps, ceil(sqrt(max(F_k, 0) / F_0) * H_0)))``, with
    ``H_0 = local_steps`` and ``F_0`` the first finite loss; ``F_0 <= 0`` raises ValueError."""
    return AdaComm(local_steps, min_steps)


def comm_budget(
    fraction: float = 0.1,
    local_steps: int = 4,
    min_steps: int = 1,
    max_steps: int = 64,
    memory: float = 0.9,
) -> CommBudget:
    """The smallest ``H`` with communication at most ``fraction`` of a round: ``H = ceil(c * (1 -
    fraction) / (fraction * s))`` in ``[min_steps, max_steps]``, rounds fitted to ``T = c + s * H``
    (older rounds weigh ``memory`` times less); ``local_steps``: the first two rounds' ``H``."""
    return CommBudget(fraction, local_steps, min_steps, max_steps, memory)


def fixed(local_steps: int) -> Fixed:
    """The trivial schedule: ``H = local_steps`` at every push (``local_sgd(local_steps=H)``)."""
    return Fixed(local_steps)


@dataclass(eq=False)
class AdaptiveState(AveragingState):
    """One worker's state for :func:`adaptive`: local SGD's, plus the schedule's."""

    schedule: Any = None  # the schedule's state (from schedule.init(), then schedule.next)
    loss: float = math.nan  # F: the smoothed training loss of the local steps (NaN: none yet)
    local_steps: int = 0  # H of the last round


class Adaptive(Strategy):
    """Local SGD / DiLoCo with ``H`` picked at every push by a schedule; see :func:`adaptive`."""

    name = "adaptive"

    def __init__(self, schedule: Any, local: LocalSGDStrategy, *, smoothing: float = 0.9):
        if not (
            callable(getattr(schedule, "init", None)) and callable(getattr(schedule, "next", None))
        ):
            raise TypeError(
                "adaptive: schedule must have init() -> state and next(state, loss) -> "
                f"(H, state), e.g. sw.strategies.comm_budget(); got {schedule!r}"
            )
        self.schedule = schedule
        self.local = local  # the worker side and the server recommendation; its steps is unused
        self.smoothing = check_number("adaptive", "smoothing", smoothing, 0.0, 1.0)

    settles = True  # as local SGD: every round starts from a pull holding its last push

    @property
    def timed(self) -> bool:  # type: ignore[override]
        """True if the schedule observes the rounds' lengths (it has ``observe``)."""
        return callable(getattr(self.schedule, "observe", None))

    def init(self, params: Any) -> AdaptiveState:
        base = self.local.init(params)
        return AdaptiveState(**vars(base), schedule=self.schedule.init())

    def started(self, state: AdaptiveState, now: float) -> None:
        """The runtime's clock at a round's start: the schedule observes the last round."""
        seconds = _timed_round(state, now)
        if seconds is not None:
            state.schedule = self.schedule.observe(state.schedule, state.taken, seconds)

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
            h = check_integer(f"adaptive: schedule {self.schedule!r}: H", h)
            state.local_steps = h
            if h == 1:
                return 1, first
            m, rest = _run_local(inner, state, observed, batches, h - 1, None)
            state.step_time = (first_time + m * state.step_time) / h
            return h, (first + m * rest) / h

        return self.local._round(state, params, run)

    def check_consistency(self, consistency: Any, *, recommended: bool) -> None:
        _check_outer(self.local, consistency, recommended, "adaptive(outer='diloco')")

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
    local_steps: int | None = None,
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

    ``schedule`` defaults to :func:`comm_budget` (``local_steps``, ``min_steps`` are its
    shorthands); ``outer`` is ``"local_sgd"`` or ``"diloco"`` (whose options the others are);
    ``smoothing`` is the per-step decay of the loss's moving average."""
    if schedule is None:
        first = 4 if local_steps is None else local_steps
        most = max(64, first) if isinstance(first, int) else 64  # a bad start: comm_budget says so
        schedule = comm_budget(
            local_steps=first, min_steps=1 if min_steps is None else min_steps, max_steps=most
        )
    elif local_steps is not None or min_steps is not None:
        raise ValueError(
            "adaptive: local_steps= and min_steps= configure the default comm_budget schedule; with "
            "schedule= pass them to the schedule instead, e.g. adacomm(local_steps=64, min_steps=2)"
        )
    diloco_only = {"outer_lr": outer_lr, "outer_momentum": outer_momentum}
    diloco_only |= {"asynchronous": asynchronous or None, "every": every}
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
