"""Delayed Nesterov: the server optimizer of asynchronous DiLoCo (Liu et al. 2024).

The momentum is updated once every ``N`` arrivals (``N`` = the workers), with their mean;
for the ``t``-th pseudo-gradient ``g_t``, ``m = b = 0`` at first, ``s`` the ``scale``::

    b = b + g_t
    p = p - lr * s * g_t / N                # every arrival: a plain gradient step
    if t % N == 0:                          # every N-th arrival:
        m = momentum * m + b / N            #   the momentum takes the buffer's mean
        b = 0
        p = p - lr * s * momentum * m       #   and makes its Nesterov look-ahead step

``N = 1`` is ``torch.optim.SGD(nesterov=True)``; a schedule sees the arrivals already applied."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stalewise.optim._validate import check_int, check_learning_rate, check_number
from stalewise.optim.base import LearningRate, Moments, Optimizer, state_type

__all__ = ["DelayedNesterovState", "delayed_nesterov"]


# m, and the sum of the pseudo-gradients since the last momentum update
DelayedNesterovState = state_type("DelayedNesterovState", __name__, ("momentum", "buffer"))


@dataclass(frozen=True)
class _DelayedNesterov(Moments):
    where, State = "delayed_nesterov", DelayedNesterovState
    lr: LearningRate
    momentum: float
    every: int

    def run(self, grads, state, params, scale, into_params) -> None:
        count, lr, _ = self.begin(grads, state, params, scale, into_params)
        step = -lr
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
    """Delayed Nesterov (the module docstring); ``every``: ``N``, the workers."""
    check_learning_rate("delayed_nesterov", lr)
    momentum = check_number("delayed_nesterov", "momentum", momentum, 0.0, 1.0)
    every = check_int("delayed_nesterov", "every", every, 1)
    return _DelayedNesterov(lr, momentum, every).optimizer()
