"""The optimizer interface, composition with :func:`chain`, and gradient clipping.

An :class:`Optimizer` is a NamedTuple of functions (as in optax) on one flat float32 or
float64 parameter vector and its :class:`~stalewise.segments.Segments` table:

- ``init(params, segments) -> state``: a NamedTuple of numpy arrays; the step counter ``count``
  is a 0-d int64 array, so a server can mutate the state in place and checkpoint it as it is.
- ``update(grads, state, params, *, scale=1.0) -> (updates, new_state)``: pure.
- ``apply(...) -> None``: ``params``, ``state`` in place, ``grads`` scratch; no allocation.
- ``update_inplace(...) -> None``: ``grads`` becomes the updates, ``state`` advances.

``scale`` multiplies the step size of this one update (a staleness weight)."""

from __future__ import annotations

import abc
import collections
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from stalewise._lazy import Lazy
from stalewise.optim import _leaves
from stalewise.optim._validate import (
    check_buffers,
    check_count,
    check_number,
    check_params,
    check_scale,
    check_vectors,
)
from stalewise.segments import Segments

_kernels = Lazy("stalewise.optim._kernels")  # numba: imported at the first step

State = Any  # a NamedTuple of numpy arrays, or a tuple of such (for chain)
Schedule = Callable[[int], float]  # count of updates already applied -> learning rate
LearningRate = float | Schedule


class Optimizer(NamedTuple):
    """An update rule on flat vectors, as four functions (see the module docstring)."""

    init: Callable[..., State]  # init(params, segments=None) -> state
    update: Callable[..., tuple[np.ndarray, State]]  # pure: -> (updates, new_state)
    apply: Callable[..., None]  # in place on params and state; grads is scratch
    update_inplace: Callable[..., None]  # in place: grads becomes the updates; params untouched


class EmptyState(NamedTuple):
    """The state of a transform that keeps none."""


def copy_state(state: State) -> State:
    """A deep copy of a state: every array copied, the (named) tuple structure kept.

    Example:
        >>> from stalewise.optim import sgd
        >>> state = (EmptyState(), sgd(0.1).init(np.zeros(3, np.float32)))
        >>> copied = copy_state(state)
        >>> copied[1].count[...] = 5
        >>> int(state[1].count), int(copied[1].count)
        (0, 5)
    """
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, tuple):
        items = [copy_state(x) for x in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    return state


def learning_rate(lr: LearningRate, count: np.ndarray | int) -> float:
    """The learning rate after ``count`` applied updates (``lr(0)`` first, :mod:`.schedules`).

    Example:
        >>> learning_rate(0.1, 7), learning_rate(lambda n: 1.0 / (n + 1), 3)
        (0.1, 0.25)
    """
    value = lr(int(count)) if callable(lr) else lr
    return check_number("schedule", f"lr at count {int(count)}", value, 0.0)


def new_count() -> np.ndarray:
    """A fresh step counter: a 0-d int64 array holding 0.

    Example:
        >>> count = new_count()
        >>> count[...] += 1
        >>> count.shape, int(count)
        ((), 1)
    """
    return np.zeros((), dtype=np.int64)


def pure_update(
    update_inplace: Callable[..., None],
    grads: np.ndarray,
    state: State,
    params: np.ndarray,
    *,
    scale: float = 1.0,
) -> tuple[np.ndarray, State]:
    """Derives a pure ``update`` from an in-place one by running it on copies.

    Example:
        >>> clip = clip_by_global_norm(1.0)
        >>> g = np.array([0.0, 2.0], np.float32)
        >>> updates, _ = pure_update(clip.update_inplace, g, EmptyState(), np.zeros(2, np.float32))
        >>> updates.tolist(), g.tolist()
        ([0.0, 1.0], [0.0, 2.0])
    """
    check_vectors(grads, params, write_grads=False, write_params=False)
    updates = grads.copy()
    new_state = copy_state(state)
    update_inplace(updates, new_state, params, scale=scale)
    return updates, new_state


class Rule(abc.ABC):
    """An update rule written once, in place; :meth:`optimizer` derives the four functions.
    Subclasses are frozen dataclasses of hyperparameters implementing :meth:`init`, :meth:`run`.

    Example:
        >>> @dataclass(frozen=True)
        ... class SignDescent(Rule):
        ...     lr: float
        ...     def init(self, params, segments=None):
        ...         return EmptyState()
        ...     def run(self, grads, state, params, scale, into_params):
        ...         np.sign(grads, out=grads)
        ...         grads *= -self.lr * scale
        ...         if into_params:
        ...             params += grads
        >>> opt = SignDescent(0.5).optimizer()
        >>> params = np.zeros(2, np.float32)
        >>> opt.apply(np.array([3.0, -0.1], np.float32), opt.init(params), params)
        >>> params.tolist()
        [-0.5, 0.5]
    """

    @abc.abstractmethod
    def init(self, params: np.ndarray, segments: Segments | None = None) -> State:
        """The state before the first update."""

    @abc.abstractmethod
    def run(
        self, grads: np.ndarray, state: State, params: np.ndarray, scale: float, into_params: bool
    ) -> None:
        """One update in place: into ``params`` if ``into_params``, else into ``grads``."""

    def update_inplace(
        self, grads: np.ndarray, state: State, params: np.ndarray, *, scale: float = 1.0
    ) -> None:
        """``grads`` becomes the updates and ``state`` advances; ``params`` is untouched."""
        if isinstance(params, np.ndarray) and not params.flags.writeable:
            params = params.copy()  # the kernels are compiled for writeable arrays only
        self.run(grads, state, params, scale, False)

    def apply(
        self, grads: np.ndarray, state: State, params: np.ndarray, *, scale: float = 1.0
    ) -> None:
        """``params`` and ``state`` advance in place; ``grads`` may be overwritten."""
        self.run(grads, state, params, scale, True)

    fused_checks = False  # run() takes check=, undo= and done=, the fused work of apply_checked

    def apply_checked(
        self,
        grads: np.ndarray,
        state: State,
        params: np.ndarray,
        *,
        scale: float = 1.0,
        undo: tuple[np.ndarray, ...] | None = None,
        done: np.ndarray | None = None,
    ) -> tuple[float, float]:
        """:meth:`apply` with a server's checks fused into the step (``fused_checks`` rules).

        ``undo``: copies of :meth:`written`'s vectors get their values before the step; ``done``
        (one int64), the end of the params written so far, piece by piece. Returns the sum of
        squares of ``grads`` and a sum finite exactly when params and state stayed so."""
        if undo is not None:
            written = self.written(state, params)
            if len(undo) != len(written) or any(
                not isinstance(c, np.ndarray)
                or (c.shape, c.dtype) != (w.shape, w.dtype)
                or not (c.flags.c_contiguous and c.flags.writeable)
                for c, w in zip(undo, written, strict=False)
            ):
                raise ValueError(
                    f"apply_checked: undo must be {len(written)} writeable contiguous copies "
                    f"shaped like {[f'{w.dtype}{w.shape}' for w in written]}"
                )
        check = np.zeros(2, params.dtype)
        self.run(grads, state, params, scale, True, check=check, undo=undo, done=done)  # type: ignore[call-arg]
        return float(check[0]), float(check[1])

    def written(self, state: State, params: np.ndarray) -> tuple[np.ndarray, ...]:
        """The vectors a checked step writes (``fused_checks`` rules): ``params`` first."""
        raise NotImplementedError(f"{type(self).__name__} has no fused checks")

    def optimizer(self) -> Optimizer:
        update = functools.partial(pure_update, self.update_inplace)
        return Optimizer(self.init, update, self.apply, self.update_inplace)


def state_type(name: str, module: str, moments: tuple[str, ...], table: Any = None) -> type:
    """A state class: ``count`` (0-d int64), the ``moments``, then ``table``'s (``_leaves``)."""
    fields = ("count", *moments, *(table._fields if table else ()))
    cls = collections.namedtuple(name, fields, module=module)
    cls._moments = moments
    return cls


class Moments(Rule):
    """A rule of a :func:`state_type` state; subclasses set ``where``, ``State``, ``Masked``."""

    where: ClassVar[str]
    State: ClassVar[type]
    Masked: ClassVar[type | None] = None
    per_leaf: ClassVar[bool] = False  # LAMB, LARS: the leaf table is always kept

    def moments(self) -> tuple[str, ...]:
        """The state's parameter-sized arrays (the others are kept empty)."""
        return self.State._moments

    def masked(self) -> bool:
        return self.per_leaf or bool(getattr(self, "exclude_from_weight_decay", ()))

    def init(self, params: np.ndarray, segments: Segments | None = None) -> State:
        segments = check_params(params, segments)
        kept = self.moments()
        moments = [
            np.zeros(params.size if m in kept else 0, params.dtype) for m in self.State._moments
        ]
        if not self.masked():
            return self.State(new_count(), *moments)
        no_decay = getattr(self, "exclude_from_weight_decay", ())
        if self.per_leaf:
            table = _leaves.build(segments, no_decay, self.exclude_from_adaptation)  # type: ignore[attr-defined]
        else:
            table = _leaves.decay_table(segments, no_decay)
        return self.Masked(new_count(), *moments, *table)  # type: ignore[misc]

    def maxima(self, state: State, params: np.ndarray) -> tuple[float, ...]:
        """Bounds of the largest magnitudes in ``params`` and each moment: their norms."""
        arrays = (params, *(getattr(state, m) for m in self.State._moments))
        return tuple(math.sqrt(_kernels.sumsq(a)) for a in arrays)

    def adam_bounds(self, state: State, scale: float, g: float, maxima: tuple, l2: float) -> tuple:
        """An Adam direction's bounds after an update of norm ``g`` (see :meth:`maxima`):
        ``(lr * scale, params, mu, nu, direction and m_hat, g + l2 * p)``."""
        count = check_count(self.where, state.count)
        lr = learning_rate(self.lr, count) * float(scale)  # type: ignore[attr-defined]
        b1, b2, eps = self.b1, self.b2, self.eps  # type: ignore[attr-defined]
        p, m, v = maxima[:3]
        d = g + l2 * p
        m, v = b1 * m + (1 - b1) * d, b2 * v + (1 - b2) * d * d
        return lr, p, m, v, m / (1 - b1 ** (count + 1)) / min(eps, 1.0), d

    def begin(
        self, grads: np.ndarray, state: State, params: np.ndarray, scale: float, into_params: bool
    ) -> tuple[int, float, _leaves.DecayTable]:
        """The checks of a step: returns ``(count, lr * scale, leaf table)``."""
        check_vectors(grads, params, write_grads=True, write_params=into_params)
        check_buffers(self.where, params, **{m: getattr(state, m) for m in self.moments()})
        table = _leaves.decay_of(self.where, state, params.size, self.masked())
        count = check_count(self.where, state.count)
        return count, learning_rate(self.lr, count) * check_scale(scale), table  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _Chain(Rule):
    parts: tuple[Optimizer, ...]

    def init(self, params: np.ndarray, segments: Segments | None = None) -> State:
        return tuple(part.init(params, segments) for part in self.parts)

    def run(self, grads, state, params, scale, into_params) -> None:
        if len(state) != len(self.parts):
            raise ValueError(f"chain of {len(self.parts)} got a state of {len(state)} parts")
        *firsts, last = zip(self.parts, state, strict=True)
        for part, part_state in firsts:
            part.update_inplace(grads, part_state, params, scale=scale)
        finish = last[0].apply if into_params else last[0].update_inplace
        finish(grads, last[1], params, scale=scale)


def chain(*optimizers: Optimizer) -> Optimizer:
    """Composes optimizers, each transforming the updates of the one before; the state is the
    tuple of the parts' states, and ``scale`` is passed to every part.

    Example:
        >>> from stalewise.optim import lamb
        >>> opt = chain(clip_by_global_norm(1.0), lamb(1e-3))
        >>> params = np.ones(4, np.float32)
        >>> state = opt.init(params, Segments.single(4))
        >>> opt.apply(np.full(4, 10.0, np.float32), state, params)
        >>> float(params[0]) < 1.0, int(state[1].count)
        (True, 1)
    """
    if not optimizers:
        raise ValueError("chain: needs at least one optimizer")
    return _Chain(tuple(optimizers)).optimizer()


@dataclass(frozen=True)
class _ClipByGlobalNorm(Rule):
    max_norm: float

    def init(self, params: np.ndarray, segments: Segments | None = None) -> State:
        check_params(params, segments)
        return EmptyState()

    def run(self, grads, state, params, scale, into_params) -> None:
        check_vectors(grads, params, write_grads=True, write_params=into_params)
        check_scale(scale)
        norm = math.sqrt(_kernels.sumsq(grads))
        if norm > self.max_norm:
            np.multiply(grads, grads.dtype.type(self.max_norm / norm), out=grads)
        if into_params:
            np.add(params, grads, out=params)


def clip_by_global_norm(max_norm: float) -> Optimizer:
    """Rescales the gradient to norm ``max_norm`` when its L2 norm (over this shard's whole
    vector) exceeds it; put it first in a :func:`chain`.

    Example:
        >>> clip = clip_by_global_norm(1.0)
        >>> g = np.array([3.0, 4.0], np.float32)
        >>> updates, _ = clip.update(g, clip.init(g), np.zeros(2, np.float32))
        >>> updates.tolist()
        [0.6000000238418579, 0.800000011920929]
    """
    max_norm = check_number("clip_by_global_norm", "max_norm", max_norm, 0.0, lo_open=True)
    return _ClipByGlobalNorm(max_norm).optimizer()
