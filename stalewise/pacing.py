"""A worker's rounds timed by its runtime's clock: what one round and one local step cost.

Strategies that pace themselves (:func:`stalewise.strategies.adaptive.comm_budget`, dynamic
local updates of :func:`stalewise.strategies.averaging.local_sgd`) ask the worker loop for
the runtime's clock (:data:`stalewise.protocol.loop.CLOCK`): monotonic wall time
in the local and Ray runtimes, virtual time in the simulator. The loop hands it
to :meth:`stalewise.strategies.Strategy.started` after every pull, so a round is
the time from one pull's arrival to the next: the local steps (compute, real,
emulated or simulated, a straggler's slowness included), the push, the pull and
any waiting at the SSP/BSP gate. Under BSP a fast worker's rounds therefore
last as long as the slowest worker's, which is what its choice of ``H`` costs.

:class:`RoundCost` fits the round's length ``T`` against its local steps ``H``
with the model ``T = c + s * H``: ``c`` the seconds of a round that do not grow
with ``H`` (communication, per-round overhead) and ``s`` the seconds of one
local step. It is an exponentially weighted least-squares fit (each new round
has weight 1, older ones ``memory`` times their previous weight), so it follows
a worker that slows down or speeds up within about ``1 / (1 - memory)`` rounds.
The fit needs rounds of different ``H``: while the weighted spread of ``H`` is
below ``SPREAD`` of its mean, or the fit is not physical (``c < 0`` or ``s <=
0``), it falls back to ``c = 0, s = mean T / mean H`` (every second is charged
to the local steps), or, when the round time does not grow with ``H`` at all,
``s = 0`` and ``c = mean T``.

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
        """``(c, s)``: seconds of a round that do not grow with H, seconds of a local step.

        None before the first round.
        """
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
