"""Consistency models: when may a worker start its next step, and how pushes merge.

A worker's *clock* is the number of pushes it has completed. Before a step, a
worker at clock ``c`` asks its shards whether it may start; the answer depends
only on the clocks of the live workers:

* ``ASP()``: always (fully asynchronous; every push is applied on arrival).
* ``SSP(bound=s)``: only if ``c - min(live clocks) <= s``; pushes are applied on
  arrival. ``SSP(0)`` gates like BSP, ``SSP(inf)`` is ASP.
* ``BSP()``: gates like ``SSP(0)`` and merges the pushes of a round: the mean of
  the round's pushes is applied once, when every live worker has pushed.

Example:
    >>> from stalewise import SSP
    >>> gate = SSP(bound=2)
    >>> gate.may_start(clock=5, min_clock=3), gate.may_start(clock=6, min_clock=3)
    (True, False)
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Consistency(NamedTuple):
    """A consistency model. Build one with :func:`ASP`, :func:`BSP` or :func:`SSP`."""

    kind: str  # "asp", "ssp" or "bsp"
    bound: float  # largest allowed gap between a worker's clock and the slowest live clock

    @property
    def averages_rounds(self) -> bool:
        """True when pushes are merged per round (BSP) instead of applied on arrival."""
        return self.kind == "bsp"

    def may_start(self, clock: int, min_clock: int) -> bool:
        """Whether a worker at ``clock`` may start a step while the slowest is at ``min_clock``."""
        return clock - min_clock <= self.bound

    def __str__(self) -> str:
        return f"SSP({self.bound:g})" if self.kind == "ssp" else self.kind.upper()


def ASP() -> Consistency:
    """Asynchronous parallel: no waiting, pushes applied on arrival."""
    return Consistency("asp", math.inf)


def BSP() -> Consistency:
    """Bulk-synchronous parallel: rounds; the mean of a round's pushes is applied once."""
    return Consistency("bsp", 0.0)


def SSP(bound: float = 4) -> Consistency:
    """Stale-synchronous parallel: no worker runs more than ``bound`` clocks ahead of the slowest.

    Args:
        bound: the staleness bound ``s`` (an integer >= 0, or ``math.inf``).
    """
    if not (bound >= 0 and (bound == math.inf or float(bound).is_integer())):
        raise ValueError(f"SSP bound must be an integer >= 0 or inf, got {bound!r}")
    return Consistency("ssp", float(bound))


def from_name(name: str, bound: float | None = None) -> Consistency:
    """Builds a model from its name ("asp", "bsp", "ssp") as configs and the CLI spell it."""
    key = name.lower()
    if key == "asp":
        return ASP()
    if key == "bsp":
        return BSP()
    if key == "ssp":
        return SSP(4 if bound is None else bound)
    raise ValueError(f"unknown consistency model {name!r}; known: asp, bsp, ssp")
