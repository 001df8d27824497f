"""Picklable learning-rate schedules, count -> lr; the first update uses ``schedule(0)`` (optax)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from stalewise.optim._validate import check_int, check_number


@dataclass(frozen=True)
class Constant:
    value: float

    def __call__(self, count: int) -> float:
        return self.value


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup from 0 to ``peak``, then cosine decay to ``floor``."""

    peak: float
    warmup: int
    total: int
    floor: float = 0.0

    def __call__(self, count: int) -> float:
        if count < self.warmup:
            return self.peak * count / self.warmup
        if count >= self.total:
            return self.floor
        progress = (count - self.warmup) / (self.total - self.warmup)
        return self.floor + (self.peak - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class StepDecay:
    lr: float
    every: int
    gamma: float

    def __call__(self, count: int) -> float:
        return self.lr * self.gamma ** (count // self.every)


def constant(value: float) -> Constant:
    """A constant learning rate.

    Example:
        >>> constant(0.1)(0), constant(0.1)(10_000)
        (0.1, 0.1)
    """
    return Constant(check_number("constant", "value", value, 0.0))


def warmup_cosine(peak: float, warmup: int, total: int, floor: float = 0.0) -> WarmupCosine:
    """Linear warmup then cosine decay, as optax's ``warmup_cosine_decay_schedule``.

    ``peak * n / warmup`` for ``n < warmup``; then
    ``floor + (peak - floor) * (1 + cos(pi * (n - warmup) / (total - warmup))) / 2``
    for ``warmup <= n < total``; ``floor`` (in ``[0, peak]``) from ``total`` on.

    Example:
        >>> s = warmup_cosine(1.0, warmup=10, total=110, floor=0.1)
        >>> s(0), s(5), s(10), round(s(60), 6), s(110), s(10_000)
        (0.0, 0.5, 1.0, 0.55, 0.1, 0.1)
    """
    peak = check_number("warmup_cosine", "peak", peak, 0.0)
    warmup = check_int("warmup_cosine", "warmup", warmup, 0)
    total = check_int("warmup_cosine", "total", total, warmup)
    floor = check_number("warmup_cosine", "floor", floor, 0.0, peak, hi_open=False)
    return WarmupCosine(peak, warmup, total, floor)


def step_decay(lr: float, every: int, gamma: float) -> StepDecay:
    """Multiplies the learning rate by ``gamma`` every ``every`` steps (torch's ``StepLR``).

    Example:
        >>> s = step_decay(1.0, every=10, gamma=0.5)
        >>> s(0), s(9), s(10), s(25)
        (1.0, 1.0, 0.5, 0.25)
    """
    lr = check_number("step_decay", "lr", lr, 0.0)
    every = check_int("step_decay", "every", every, 1)
    gamma = check_number("step_decay", "gamma", gamma, 0.0)
    return StepDecay(lr, every, gamma)
