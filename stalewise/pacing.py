"""A worker's rounds timed by its runtime's clock: what one round and one local step cost.

A round is the time from one pull's arrival to the next (:data:`stalewise.protocol.loop.CLOCK`);
:class:`RoundCost` fits ``T = c + s * H`` (older rounds weigh ``memory`` times less).

Example:
    >>> cost = RoundCost()
    >>> for h in (4, 16, 4, 16):
    ...     cost = cost.add(h, 0.5 + 0.25 * h)  # 0.5 s of communication, 0.25 s a step
    >>> c, s = cost.fit()
    >>> round(c, 6), round(s, 6)
    (0.5, 0.25)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SPREAD = 0.05  # the weighted std of H, relative to its mean, below which c and s are not separated


@dataclass(frozen=True)
class RoundCost:
    """Weighted sums of the rounds seen so far, for the fit ``T = c + s * H``; see the module."""

    memory: float = 0.9
    w: float = 0.0  # sum of weights
    h: float = 0.0  # sum of w * H
    t: float = 0.0  # sum of w * T
    hh: float = 0.0  # sum of w * H^2
    ht: float = 0.0  # sum of w * H * T
    rounds: int = 0  # rounds added

    def add(self, steps: int, seconds: float) -> RoundCost:
        """With one more round of ``steps`` local steps that lasted ``seconds`` (>= 0, finite)."""
        h, t, m = float(steps), max(float(seconds), 0.0), self.memory
        if not (h > 0 and math.isfinite(t)):
            return self  # a round that says nothing about the cost (a clock that went wrong)
        return RoundCost(
            m,
            m * self.w + 1.0,
            m * self.h + h,
            m * self.t + t,
            m * self.hh + h * h,
            m * self.ht + h * t,
            self.rounds + 1,
        )

    def fit(self) -> tuple[float, float] | None:
        """``(c, s)``: seconds of a round that do not grow with H, of a local step (or None)."""
        if self.w <= 0:
            return None
        mh, mt = self.h / self.w, self.t / self.w
        var = self.hh / self.w - mh * mh
        if var > (SPREAD * mh) ** 2:
            s = (self.ht / self.w - mh * mt) / var
            c = mt - s * mh
            if s > 0 and c >= 0:
                return c, s
            if s <= 0:  # longer rounds were no slower: all of a round is communication
                return mt, 0.0
        return 0.0, mt / mh  # H did not vary (or c < 0): charge everything to the steps
