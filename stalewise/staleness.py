"""How much a stale push counts.

A push's staleness ``tau``: the shard's version when it is applied minus the version pulled.
DC-ASGD (Zheng et al. 2017) compensates ``g``: ``g + dc_lambda * g * g * (w_now - w_pulled)``.

Example:
    >>> from stalewise import staleness
    >>> rule = staleness.inverse(max_staleness=8)
    >>> rule.weight(0), rule.weight(4)
    (1.0, 0.25)
    >>> rule.accepts(9)
    False
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

__all__ = ["Staleness", "constant", "exponential", "from_name", "inverse", "polynomial"]

_KINDS = ("constant", "inverse", "exponential", "polynomial")


class Staleness(NamedTuple):
    """A staleness rule. Build one with :func:`constant`, :func:`inverse`, ... ."""

    kind: str  # one of constant, inverse, exponential, polynomial
    param: float  # base of `exponential`, power of `polynomial`; unused otherwise
    max_staleness: float  # pushes with tau above this are rejected (inf: never)
    dc_lambda: float  # DC-ASGD delay-compensation strength (0: off)

    def weight(self, tau: int) -> float:
        """The step-size multiplier of a push with staleness ``tau`` (>= 0)."""
        if tau < 0:
            raise ValueError(f"staleness must be >= 0, got {tau}")
        if self.kind == "inverse":
            return 1.0 / max(1, tau)
        if self.kind == "exponential":
            return float(self.param**tau)
        if self.kind == "polynomial":
            return float((1.0 + tau) ** -self.param)
        return 1.0

    def accepts(self, tau: int) -> bool:
        """False when the push is too stale to apply."""
        return tau <= self.max_staleness

    def compensate(self, grads: np.ndarray, w_now: np.ndarray, w_pulled: np.ndarray) -> None:
        """Applies DC-ASGD compensation to ``grads`` in place (no-op when dc_lambda is 0)."""
        if not self.dc_lambda:
            return
        block = 1 << 16  # g += lam * g * g * (w_now - w_pulled) by blocks: no parameter-sized copy
        tmp = np.empty(min(block, grads.size), dtype=grads.dtype)
        for start in range(0, grads.size, block):
            stop = min(start + block, grads.size)
            t = tmp[: stop - start]
            np.subtract(w_now[start:stop], w_pulled[start:stop], out=t)
            t *= grads[start:stop]
            t *= grads[start:stop]
            t *= self.dc_lambda
            grads[start:stop] += t


def _real(value: object) -> float:
    """``value`` as a float if it is a real number (not a bool, not a string), else NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    return float(value)


def _make(kind: str, param: float, max_staleness: float | None, dc_lambda: float) -> Staleness:
    max_s = math.inf if max_staleness is None else _real(max_staleness)
    if max_s < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness!r}")
    if not (max_s == math.inf or max_s.is_integer()):  # NaN would refuse every push
        raise ValueError(
            f"max_staleness must be an integer >= 0 (a count of versions), math.inf or None, "
            f"got {max_staleness!r}"
        )
    lam = _real(dc_lambda)
    if not (lam >= 0 and math.isfinite(lam)):
        raise ValueError(f"dc_lambda must be a finite number >= 0, got {dc_lambda!r}")
    return Staleness(kind, float(param), max_s, lam)


def constant(*, max_staleness: float | None = None, dc_lambda: float = 0.0) -> Staleness:
    """Every push counts fully (plain asynchronous SGD)."""
    return _make("constant", 0.0, max_staleness, dc_lambda)


def inverse(*, max_staleness: float | None = None, dc_lambda: float = 0.0) -> Staleness:
    """Step size divided by the staleness, ``lr / max(1, tau)`` (Zhang et al. 2016)."""
    return _make("inverse", 0.0, max_staleness, dc_lambda)


def exponential(
    base: float = 0.5, *, max_staleness: float | None = None, dc_lambda: float = 0.0
) -> Staleness:
    """Step size times ``base ** tau`` with ``0 < base <= 1``."""
    if not 0 < _real(base) <= 1:
        raise ValueError(f"exponential staleness base must be in (0, 1], got {base!r}")
    return _make("exponential", base, max_staleness, dc_lambda)


def polynomial(
    power: float = 0.5, *, max_staleness: float | None = None, dc_lambda: float = 0.0
) -> Staleness:
    """Step size times ``(1 + tau) ** -power``; the default is ``1/sqrt(1 + tau)``."""
    if not (_real(power) >= 0 and math.isfinite(power)):
        raise ValueError(f"polynomial staleness power must be a finite number >= 0, got {power!r}")
    return _make("polynomial", power, max_staleness, dc_lambda)


def from_name(name: str, **kwargs: float) -> Staleness:
    """Builds a rule by name, as the config file and the CLI spell it."""
    makers = dict(zip(_KINDS, (constant, inverse, exponential, polynomial), strict=True))
    if name not in makers:
        raise ValueError(f"unknown staleness rule {name!r}; known: {', '.join(_KINDS)}")
    return makers[name](**kwargs)
