"""Model-averaging strategies: local SGD (FedAvg), DiLoCo, asynchronous DiLoCo and EASGD.

A worker runs ``local_steps`` (``H``) steps of an *inner* optimizer and pushes the pseudo-gradient.
``inner``: a :mod:`stalewise.optim` optimizer, an optax ``GradientTransformation`` (not picklable:
not for the local runtime) or a torch optimizer factory taking one tensor per leaf, e.g.
``functools.partial(torch.optim.AdamW, lr=1e-3)``. Why: docs/design-notes.md, "Model averaging"."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stalewise import optim, tree
from stalewise.optim._validate import check_integer, check_number
from stalewise.pacing import RoundCost
from stalewise.strategies.base import LossAndGrad, Step, Strategy

log = logging.getLogger(__name__)

__all__ = ["EASGD", "AveragingState", "LocalSGDStrategy", "diloco", "easgd", "local_sgd"]


@dataclass(frozen=True)
class _StalewiseInner:
    """A :mod:`stalewise.optim` optimizer, in place on the flat vector with the job's segments."""

    opt: optim.Optimizer

    def init(self, local: np.ndarray, spec: tree.FlatSpec) -> Any:
        return self.opt.init(local, spec.segments)

    def step(self, state: Any, local: np.ndarray, grads: np.ndarray, spec: tree.FlatSpec) -> Any:
        self.opt.apply(grads, state, local)  # grads is scratch from here on
        return state

    def warm(self, local: np.ndarray, spec: tree.FlatSpec) -> None:
        """One step on a one-element-per-leaf model, so compiled kernels load now."""
        tiny, tiny_spec = tree.flatten({x.name: np.zeros(1, local.dtype) for x in spec.leaves})
        self.opt.apply(np.full_like(tiny, 1e-3), self.opt.init(tiny, tiny_spec.segments), tiny)


@dataclass(frozen=True)
class _OptaxInner:
    """An optax transform on a dict of leaf name -> JAX array (any backend of params)."""

    tx: Any

    @staticmethod
    def _leaves(flat: np.ndarray, spec: tree.FlatSpec) -> dict:
        import jax.numpy as jnp

        # jnp.array copies: the flat vector is mutated in place later
        return {leaf.name: jnp.array(tree._segment(flat, leaf)) for leaf in spec.leaves}

    def init(self, local: np.ndarray, spec: tree.FlatSpec) -> Any:
        names = [leaf.name for leaf in spec.leaves]
        if len(set(names)) != len(names):
            raise ValueError(f"optax inner optimizer: leaf names are not distinct: {names}")
        return self.tx.init(self._leaves(local, spec))

    def step(self, state: Any, local: np.ndarray, grads: np.ndarray, spec: tree.FlatSpec) -> Any:
        updates, state = self.tx.update(self._leaves(grads, spec), state, self._leaves(local, spec))
        for leaf in spec.leaves:
            tree._segment(local, leaf)[...] += np.asarray(updates[leaf.name])
        return state


class _TorchState:
    """A torch optimizer and the tensors it owns (views of the flat local vector)."""

    def __init__(self, opt: Any, params: list):
        self.opt, self.params = opt, params

    def __repr__(self) -> str:
        return f"_TorchState({type(self.opt).__name__}, {len(self.params)} tensors)"


@dataclass(frozen=True)
class _TorchInner:
    """A factory ``f(list of torch tensors) -> torch.optim.Optimizer``, on views of the flat vector."""

    factory: Any

    def init(self, local: np.ndarray, spec: tree.FlatSpec) -> _TorchState:
        import torch

        params = [torch.from_numpy(tree._segment(local, leaf)) for leaf in spec.leaves]
        opt = self.factory(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                "a torch inner optimizer is a factory taking a list of tensors and returning "
                f"a torch.optim.Optimizer; {self.factory!r} returned {type(opt).__name__}"
            )
        return _TorchState(opt, params)

    def step(
        self, state: _TorchState, local: np.ndarray, grads: np.ndarray, spec: tree.FlatSpec
    ) -> _TorchState:
        import torch

        for p, leaf in zip(state.params, spec.leaves, strict=True):
            p.grad = torch.from_numpy(tree._segment(grads, leaf))
        state.opt.step()
        return state


def _inner_adapter(inner: Any, where: str) -> Any:
    if isinstance(inner, optim.Optimizer):
        return _StalewiseInner(inner)
    if hasattr(inner, "param_groups"):  # a torch optimizer instance, not a factory
        raise TypeError(
            f"{where}: inner must be a torch optimizer factory, not an optimizer instance "
            "(the worker makes the optimizer on its own parameters), e.g. "
            "functools.partial(torch.optim.AdamW, lr=1e-3)"
        )
    if callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None)):
        return _OptaxInner(inner)
    if callable(inner):
        return _TorchInner(inner)
    raise TypeError(
        f"{where}: inner must be a stalewise optimizer (e.g. sw.optim.adamw(1e-3)), an optax "
        "GradientTransformation or a torch optimizer factory (e.g. "
        f"functools.partial(torch.optim.AdamW, lr=1e-3)), got {type(inner).__name__} {inner!r}"
    )


def _describe_inner(inner: Any) -> str:
    if isinstance(inner, optim.Optimizer):
        rule = getattr(inner.apply, "__self__", None)
        return repr(rule) if rule is not None else "Optimizer(...)"
    if callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None)):
        return f"<optax {type(inner).__name__}>"
    return repr(inner)


@dataclass(eq=False)
class AveragingState:
    """One worker's state for :func:`local_sgd`, :func:`diloco` and :func:`easgd`."""

    spec: tree.FlatSpec  # layout of the flat vectors (the job's)
    local: np.ndarray  # the worker's local parameters, flat
    grads: np.ndarray  # gradient buffer (scratch of the inner optimizer)
    inner: Any  # the inner optimizer's state (stalewise state, optax state or torch optimizer)
    pushes: int = 0  # strategy steps done
    step_time: float = math.nan  # mean wall seconds of one local step in the last round
    taken: int = 0  # local steps of the last round
    clock: float = math.nan  # the runtime's clock at the last round's start (NaN: no clock)
    cost: RoundCost = field(default_factory=RoundCost)  # its rounds by the runtime's clock


def _new_state(params: Any, adapter: Any) -> AveragingState:
    local, spec = tree.flatten(params)  # a new vector, not a view of the pull buffer
    if hasattr(adapter, "warm"):
        adapter.warm(local, spec)
    return AveragingState(
        spec=spec,
        local=local,
        grads=np.empty_like(local),
        inner=adapter.init(local, spec),
    )


def _minus_local(state: AveragingState, params: Any) -> np.ndarray:
    """``pulled - local`` (the push's own array), ``params`` read again into the scratch."""
    return tree.flatten(params, spec=state.spec, out=state.grads)[0] - state.local


def _run_local(
    adapter: Any,
    state: AveragingState,
    loss_and_grad: LossAndGrad,
    batches: Iterator,
    steps: int,
    period: float | None,
) -> tuple[int, float]:
    """``steps`` local steps, or as many as fit in ``period`` s (>= 1); ``(taken, mean loss)``."""
    spec, local, grads = state.spec, state.local, state.grads
    total, n = 0.0, 0
    t0 = time.perf_counter()
    while True:
        loss, g = loss_and_grad(tree.unflatten(local, spec), next(batches))
        tree.flatten(g, spec=spec, out=grads)
        del g  # not held while the next step's gradient is made
        reported = tree.take_buffers(grads, spec)  # buffers report values, not gradients
        state.inner = adapter.step(state.inner, local, grads, spec)
        tree.put_buffers(local, reported, spec)
        total += float(loss)
        n += 1
        if n >= steps:
            break
        if period is not None:
            elapsed = time.perf_counter() - t0
            if elapsed + elapsed / n > period:  # the next step, at this round's mean, won't fit
                break
    state.step_time = (time.perf_counter() - t0) / n
    return n, total / n


def _timed_round(state: AveragingState, now: float) -> float | None:
    """Records the runtime's clock at a round's start; the seconds of the last round, if any."""
    last, state.clock = state.clock, now
    if math.isnan(last) or not state.taken:
        return None
    return now - last


def _paced_steps(cost: RoundCost, cap: int, period: float, last: int) -> int:
    """Dynamic local updates by the runtime's clock: ``H`` with ``c + s * H`` about ``period``."""
    fit = cost.fit()
    if fit is None:
        return 1  # the first round: one step, to measure
    c, s = fit
    hi = min(cap, 4 * last)  # a noisy fit moves H by 4x a round at most
    if s <= 0:
        return hi
    return max(1, min(hi, math.floor((period - c) / s)))


def _check_positive(where: str, name: str, value: Any, hi: float = math.inf) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not (0 < x <= hi) or not math.isfinite(x):
        bound = f"in (0, {hi:g}]" if math.isfinite(hi) else "a finite number > 0"
        raise ValueError(f"{where}: {name} must be {bound}, got {value!r}")
    return x


class LocalSGDStrategy(Strategy):
    """Local SGD / DiLoCo; build it with :func:`local_sgd` or :func:`diloco`."""

    settles = True  #: every round starts from the pull, which must include this worker's last push

    def __init__(
        self,
        local_steps: int,
        inner: Any,
        *,
        reset_inner: bool = False,
        dynamic: bool = False,
        period: float | None = None,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        asynchronous: bool = False,
        every: int | None = None,
        name: str = "local_sgd",
    ):
        where = self.name = name
        self.local_steps = check_integer(f"{where}: local_steps", local_steps)
        self.inner = inner
        self._inner = _inner_adapter(inner, where)
        self.reset_inner = bool(reset_inner)
        if dynamic and period is None:
            raise ValueError(
                f"{where}: dynamic=True needs period=seconds, the time budget of a round "
                "(e.g. local_steps times the fastest worker's step time, plus its communication)"
            )
        if period is not None and not dynamic:
            raise ValueError(f"{where}: period= is the budget of dynamic=True; pass dynamic=True")
        self.dynamic = bool(dynamic)
        self.period = None if period is None else _check_positive(where, "period", period)
        self.outer_lr = _check_positive(where, "outer_lr", outer_lr)
        self.outer_momentum = check_number(where, "outer_momentum", outer_momentum, 0.0, 1.0)
        if every is not None and not asynchronous:
            raise ValueError(f"{where}: every= is delayed Nesterov's N; it needs asynchronous=True")
        self.asynchronous = bool(asynchronous)
        self.every = None if every is None else check_integer(f"{where}: every", every)

    @property
    def timed(self) -> bool:  # type: ignore[override]
        """Dynamic local updates pace themselves by the runtime's clock."""
        return self.dynamic

    def init(self, params: Any) -> AveragingState:
        return _new_state(params, self._inner)

    def started(self, state: AveragingState, now: float) -> None:
        """The runtime's clock at a round's start: times the last round (dynamic only)."""
        seconds = _timed_round(state, now)
        if seconds is not None:
            state.cost = state.cost.add(state.taken, seconds)

    def step(
        self, state: AveragingState, params: Any, loss_and_grad: LossAndGrad, batches: Iterator
    ) -> Step:
        steps, period = self.local_steps, self.period
        if period is not None and not math.isnan(state.clock):  # in a runtime: its clock
            steps, period = _paced_steps(state.cost, steps, period, state.taken), None

        def run() -> tuple[int, float]:
            return _run_local(self._inner, state, loss_and_grad, batches, steps, period)

        return self._round(state, params, run)

    def _round(
        self, state: AveragingState, params: Any, run: Callable[[], tuple[int, float]]
    ) -> Step:
        """One round from the pulled ``params``; ``run()`` steps, giving ``(taken, mean loss)``."""
        tree.flatten(params, spec=state.spec, out=state.local)  # the round starts from the pull
        if self.reset_inner and state.pushes:
            state.inner = self._inner.init(state.local, state.spec)
        n, loss = run()
        state.taken = n
        delta = _minus_local(state, params)
        tree.copy_buffers(delta, state.local, state.spec)  # a buffer's slot: its value
        state.pushes += 1
        return Step(tree.unflatten(delta, state.spec), n, loss, state)

    def check_consistency(self, consistency: Any, *, recommended: bool) -> None:
        """Refuses DiLoCo under a consistency model its outer optimizer is not made for."""
        _check_outer(self, consistency, recommended, self.name)

    def server_optimizer(self, workers: int | None = None) -> optim.Optimizer:
        """``sgd(outer_lr, outer_momentum, nesterov)``, or delayed Nesterov when asynchronous."""
        if self.asynchronous:
            every = self.every or workers
            if every is None:
                raise TypeError(
                    f"{self!r} recommends delayed_nesterov(every=number of workers) as the "
                    "server optimizer, but the number of workers is not known here: pass "
                    "every=<workers> to diloco(), or an optimizer= to the Job"
                )
            return optim.delayed_nesterov(self.outer_lr, self.outer_momentum, every=every)
        if self.outer_momentum:
            return optim.sgd(self.outer_lr, momentum=self.outer_momentum, nesterov=True)
        return optim.sgd(self.outer_lr)

    def __repr__(self) -> str:
        parts = [f"local_steps={self.local_steps}", f"inner={_describe_inner(self.inner)}"]
        if self.reset_inner:
            parts.append("reset_inner=True")
        if self.dynamic:
            parts.append(f"dynamic=True, period={self.period:g}")
        if self.asynchronous:
            parts.append(f"asynchronous=True, every={self.every}")
        return f"{self.name}({', '.join(parts)})"


def _check_outer(local: LocalSGDStrategy, consistency: Any, recommended: bool, what: str) -> None:
    kind = getattr(consistency, "kind", None)
    if local.asynchronous and kind == "bsp":
        raise ValueError(
            f"{what} with asynchronous=True is for ASP or SSP: its delayed Nesterov counts the "
            "pushes as they arrive, and BSP applies one mean per round; under BSP leave "
            "asynchronous off (synchronous DiLoCo)"
        )
    if recommended and not local.asynchronous and local.outer_momentum and kind in ("asp", "ssp"):
        raise ValueError(
            f"{what} recommends Nesterov SGD on each round's mean, for BSP; under "
            f"{consistency} every push would take a momentum step of its own: pass "
            "consistency=sw.BSP(), or asynchronous=True with every=<workers> (delayed "
            "Nesterov, for ASP/SSP), or choose the server optimizer (optimizer=)"
        )


def local_sgd(
    local_steps: int,
    inner: Any,
    *,
    reset_inner: bool = False,
    dynamic: bool = False,
    period: float | None = None,
) -> LocalSGDStrategy:
    """Local SGD: ``local_steps`` local steps with ``inner``, then push ``pulled - local``.

    Recommended server optimizer ``sgd(1.0)`` (under BSP: FedAvg). ``local_steps`` is ``H``
    (the cap when ``dynamic``), not the job's push budget; ``reset_inner``: a fresh inner state
    at every pull; ``dynamic=True, period=seconds`` picks ``H`` for rounds of about ``period``."""
    return LocalSGDStrategy(
        local_steps, inner, reset_inner=reset_inner, dynamic=dynamic, period=period
    )


def diloco(
    local_steps: int = 500,
    inner: Any = None,
    *,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    asynchronous: bool = False,
    every: int | None = None,
    reset_inner: bool = False,
    dynamic: bool = False,
    period: float | None = None,
) -> LocalSGDStrategy:
    """DiLoCo (Douillard et al. 2023) and asynchronous DiLoCo (Liu et al. 2024).

    :func:`local_sgd` with an inner ``adamw(1e-3)`` by default; the recommended server optimizer is
    Nesterov ``sgd(outer_lr, outer_momentum)`` for BSP, or with ``asynchronous=True``
    ``delayed_nesterov(every=N workers)`` for ASP/SSP (``sw.Job`` refuses the other pairings)."""
    return LocalSGDStrategy(
        local_steps,
        optim.adamw(1e-3) if inner is None else inner,
        reset_inner=reset_inner,
        dynamic=dynamic,
        period=period,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        asynchronous=asynchronous,
        every=every,
        name="diloco",
    )


class EASGD(Strategy):
    """Asynchronous elastic averaging SGD; build it with :func:`easgd`."""

    name = "easgd"
    settles = True  # the next centre must include this worker's elastic push

    def __init__(self, alpha: float, local_steps: int, inner: Any, *, reset_inner: bool = False):
        self.alpha = _check_positive("easgd", "alpha", alpha, hi=1.0)
        self.local_steps = check_integer("easgd: local_steps", local_steps)
        self.inner = inner
        self._inner = _inner_adapter(inner, "easgd")
        self.reset_inner = bool(reset_inner)

    def init(self, params: Any) -> AveragingState:
        return _new_state(params, self._inner)  # local parameters start at the first centre

    def step(
        self, state: AveragingState, params: Any, loss_and_grad: LossAndGrad, batches: Iterator
    ) -> Step:
        if self.reset_inner and state.pushes:
            state.inner = self._inner.init(state.local, state.spec)
        n, loss = _run_local(self._inner, state, loss_and_grad, batches, self.local_steps, None)
        delta = _minus_local(state, params)  # c - x, c the pulled centre
        delta *= self.alpha  # push alpha * (c - x): server sgd(1.0) makes c += alpha * (x - c)
        if np.isfinite(state.local).all():
            state.local += delta  # x -= alpha * (x - c)
        else:
            log.warning("easgd: local parameters are not finite; restarting from the centre")
            tree.flatten(params, spec=state.spec, out=state.local)
        tree.copy_buffers(delta, state.local, state.spec)  # a buffer's slot: its value
        state.pushes += 1
        return Step(tree.unflatten(delta, state.spec), n, loss, state)

    def server_optimizer(self, workers: int | None = None) -> optim.Optimizer:
        """``sgd(1.0)``: the centre moves by each elastic difference in full."""
        return optim.sgd(1.0)

    def __repr__(self) -> str:
        extra = ", reset_inner=True" if self.reset_inner else ""
        inner = _describe_inner(self.inner)
        return f"easgd(alpha={self.alpha:g}, local_steps={self.local_steps}, inner={inner}{extra})"


def easgd(alpha: float, *, local_steps: int, inner: Any, reset_inner: bool = False) -> EASGD:
    """Asynchronous EASGD (Zhang, Choromanska and LeCun 2015).

    Each round: ``local_steps`` (``tau``) steps on the worker's own ``x``, then push
    ``alpha * (c - x)`` and move ``x -= alpha * (x - c)``, ``c`` the pulled centre; ``alpha``
    in ``(0, 1]`` is the paper's ``beta / p`` for ``p`` workers."""
    return EASGD(alpha, local_steps, inner, reset_inner=reset_inner)
