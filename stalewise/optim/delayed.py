"""Delayed Nesterov: the server optimizer of asynchronous DiLoCo (Liu et al. 2024).

In asynchronous local SGD every push is a pseudo-gradient (``pulled - local``)
and the server applies it on arrival. Plain Nesterov momentum on the server
then folds each stale pseudo-gradient into many later steps, which the paper
("Asynchronous Local-SGD Training for Language Modeling", Liu et al. 2024)
identifies as what makes naive asynchronous DiLoCo slower than synchronous
DiLoCo. Delayed Nesterov updates the momentum only once every ``N`` arrivals
(``N`` = the number of workers in the paper), with the mean of the
pseudo-gradients that arrived since its last update, and moves the parameters
by plain gradient steps in between.

The rule, for the ``t``-th pseudo-gradient ``g_t`` (``t = 1, 2, ...``), with
momentum ``m`` and buffer ``b`` starting at zero and ``s`` the step's ``scale``
(the staleness weight a shard passes)::

    b = b + g_t
    p = p - lr * s * g_t / N                # every arrival: a plain gradient step
    if t % N == 0:                          # every N-th arrival:
        m = momentum * m + b / N            #   the momentum takes the mean of the
        b = 0                               #   N buffered pseudo-gradients
        p = p - lr * s * momentum * m       #   and makes its Nesterov look-ahead step

So without staleness weights, ``N`` arrivals move the parameters by
``-lr * (mean(g) + momentum * m)``: exactly one step of synchronous DiLoCo's
outer Nesterov SGD on the mean of the ``N`` pseudo-gradients, but each
pseudo-gradient is applied (divided by ``N``) as soon as it arrives. With
``N = 1`` it is Nesterov SGD as ``torch.optim.SGD(nesterov=True)``
(``m = momentum * m + g; p -= lr * (g + momentum * m)``). This is the paper's
rule with its optional in-between momentum fraction ``c`` set to 0 (the
default there). ``scale`` scales both parts of the step of that arrival and
never what enters the buffer or the momentum (as everywhere in
:mod:`stalewise.optim`). A learning-rate schedule is evaluated at the number
of arrivals already applied.

The state is a :class:`DelayedNesterovState` of numpy arrays (a 0-d int64
``count`` of arrivals, the momentum and the buffer), so a shard can checkpoint
it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stalewise.optim._validate import (
    check_buffers,
    check_count,
    check_int,
    check_learning_rate,
    check_number,
    check_params,
    check_scale,
    check_vectors,
)
from stalewise.optim.base import LearningRate, Optimizer, Rule, learning_rate, new_count
from stalewise.segments import Segments

__all__ = ["DelayedNesterovState", "delayed_nesterov"]


class DelayedNesterovState(NamedTuple):
    count: np.ndarray  # 0-d int64: pseudo-gradients applied so far
    momentum: np.ndarray  # m, like params
    buffer: np.ndarray  # sum of the pseudo-gradients since the last momentum update, like params


@dataclass(frozen=True)
class _DelayedNesterov(Rule):
    lr: LearningRate
    momentum: float
    every: int

    def init(self, params: np.ndarray, segments: Segments | None = None) -> DelayedNesterovState:
        check_params(params, segments)
        return DelayedNesterovState(new_count(), np.zeros_like(params), np.zeros_like(params))

    def run(
        self,
        grads: np.ndarray,
        state: DelayedNesterovState,
        params: np.ndarray,
        scale: float,
        into_params: bool,
    ) -> None:
        check_vectors(grads, params, write_grads=True, write_params=into_params)
        check_buffers("delayed_nesterov", params, momentum=state.momentum, buffer=state.buffer)
        count = check_count("delayed_nesterov", state.count)
        step = -learning_rate(self.lr, count) * check_scale(scale)
        t = count + 1
        buf, mom = state.buffer, state.momentum
        buf += grads
        grads *= step / self.every  # grads is now the plain step -lr * s * g / N
        if into_params:
            params += grads
        if t % self.every == 0:
            buf *= 1.0 / self.every
            mom *= self.momentum
            mom += buf
            np.multiply(mom, step * self.momentum, out=buf)  # buf as scratch: the look-ahead
            if into_params:
                params += buf
            else:
                grads += buf
            buf.fill(0)
        state.count[...] = t


def delayed_nesterov(lr: LearningRate = 0.7, momentum: float = 0.9, every: int = 1) -> Optimizer:
    """Delayed Nesterov momentum (Liu et al. 2024), a server optimizer for asynchronous DiLoCo.

    Every pseudo-gradient is applied at once as a plain step ``lr * g / N``;
    once every ``N`` arrivals the momentum absorbs the mean of the buffered
    pseudo-gradients and takes its Nesterov step ``lr * momentum * m`` (see the
    module docstring for the exact rule). ``N`` arrivals make one synchronous
    Nesterov step on their mean; ``every=1`` is Nesterov SGD.

    Args:
        lr: outer learning rate, a float >= 0 or a schedule (default 0.7, DiLoCo's).
        momentum: momentum decay in ``[0, 1)`` (default 0.9).
        every: ``N``, the number of arrivals between momentum updates, an
            integer >= 1; the paper uses the number of workers.

    Example:
        >>> opt = delayed_nesterov(lr=0.5, momentum=0.5, every=2)
        >>> params = np.zeros(1)
        >>> state = opt.init(params)
        >>> for g in (1.0, 2.0):  # one Nesterov step on their mean 1.5: -0.5 * (1.5 + 0.5 * 1.5)
        ...     opt.apply(np.array([g]), state, params)
        ...     print(params.tolist(), state.momentum.tolist())
        [-0.25] [0.0]
        [-1.125] [1.5]
    """
    check_learning_rate("delayed_nesterov", lr)
    momentum = check_number("delayed_nesterov", "momentum", momentum, 0.0, 1.0)
    every = check_int("delayed_nesterov", "every", every, 1)
    return _DelayedNesterov(lr, momentum, every).optimizer()
