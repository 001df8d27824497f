"""Consistency models: when may a worker start its next step, and how pushes merge.

A worker's *clock* is its completed pushes; a gate compares it with the slowest live one.

Example:
    >>> gate = SSP(bound=2)
    >>> gate.may_start(clock=5, min_clock=3), gate.may_start(clock=6, min_clock=3)
    (True, False)
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

__all__ = ["ASP", "BSP", "SSP", "Consistency", "Hybrid", "from_name"]


class Consistency(NamedTuple):
    """A consistency model. Build one with :func:`ASP`, :func:`BSP`, :func:`SSP` or :func:`Hybrid`."""

    kind: str  # "asp", "ssp", "bsp" or "hybrid"
    bound: float  # largest allowed gap between a worker's clock and the slowest live clock
    tolerance: float = 0.0  # hybrid: a straggler's pace, as a multiple of the median's

    @property
    def gated(self) -> bool:
        """True when a worker may have to wait before a step (SSP, BSP, hybrid), not under ASP."""
        return self.bound != math.inf

    @property
    def averages_rounds(self) -> bool:
        """True when pushes are merged per round (BSP) instead of applied on arrival."""
        return self.kind == "bsp"

    def may_start(self, clock: int, min_clock: int) -> bool:
        """Whether a worker at ``clock`` may start a step while the slowest is at ``min_clock``
        (hybrid: always False; ask :meth:`stalewise.protocol.Shard.may_start`)."""
        return self.kind != "hybrid" and clock - min_clock <= self.bound

    def __str__(self) -> str:
        if self.kind == "hybrid":
            return f"Hybrid({self.tolerance:g})"
        return f"SSP({self.bound:g})" if self.kind == "ssp" else self.kind.upper()


def ASP() -> Consistency:
    """Asynchronous parallel: no waiting, pushes applied on arrival."""
    return Consistency("asp", math.inf)


def BSP() -> Consistency:
    """Bulk-synchronous parallel: rounds; the mean of a round's pushes is applied once."""
    return Consistency("bsp", 0.0)


def SSP(bound: float = 4) -> Consistency:
    """Stale-synchronous parallel: no worker runs more than ``bound`` (an integer >= 0, or
    ``math.inf``) clocks ahead of the slowest."""
    real = isinstance(bound, numbers.Real) and not isinstance(bound, bool)
    if not (real and bound >= 0 and (bound == math.inf or float(bound).is_integer())):
        raise ValueError(f"SSP bound must be an integer >= 0 or inf, got {bound!r}")
    return Consistency("ssp", float(bound))


def Hybrid(tolerance: float = 2.0) -> Consistency:
    """BSP while the workers keep pace, ASP while a straggler would hold them back.

    A shard switches to ASP at a round's end when a worker's time from pull to push exceeds
    ``tolerance`` (> 1) times the median, back once none exceeds ``tolerance / 1.25`` times it."""
    real = isinstance(tolerance, numbers.Real) and not isinstance(tolerance, bool)
    if not (real and 1.0 < tolerance < math.inf):
        raise ValueError(f"Hybrid tolerance must be a finite number > 1, got {tolerance!r}")
    return Consistency("hybrid", 0.0, float(tolerance))


def from_name(name: str, bound: float | None = None) -> Consistency:
    """A model from its name ("asp", "bsp", "ssp", "hybrid"); ``bound``: SSP's, or the tolerance."""
    key = name.lower()
    if key == "asp":
        return ASP()
    if key == "bsp":
        return BSP()
    if key == "ssp":
        return SSP(4 if bound is None else bound)
    if key == "hybrid":
        return Hybrid(2.0 if bound is None else bound)
    raise ValueError(f"unknown consistency model {name!r}; known: asp, bsp, ssp, hybrid")
