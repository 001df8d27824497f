"""When is a silent worker hung? :class:`Silence`: phi accrual over its heartbeats (Hayashibara
et al., 2004); a launched rank: a fixed bound (:func:`silent_rank`). Why: ``docs/design-notes.md``.

Example:
    >>> s = Silence(upper=60.0)
    >>> for t in range(20):               # a beat every second
    ...     s.beat(float(t))
    >>> s.hung(25.0) is None, s.hung(29.5) is not None
    (True, True)
    >>> s.hung(29.5)
    'no heartbeat for 10.5 s, 10.5x its usual interval of 1 s (phi 80.1 >= 8): hung or stopped'
    >>> silent_rank(silence=301.0, others=5, limit=300.0), silent_rank(301.0, 0, 300.0)
    (True, False)
    >>> silent_rank(silence=301.0, others=1, limit=300.0, rounds=True)  # BSP: they wait
    False
"""

from __future__ import annotations

import math
from collections import deque

THRESHOLD = 8.0  # phi at which a silence is a hang: odds below 1e-8
FLOOR = 10.0  # seconds of silence before phi may call a worker hung
MIN_SPREAD = 0.5  # the deviation of the intervals, at least this fraction of their mean
MIN_SAMPLES = 5  # intervals needed before the worker's rhythm is trusted
WINDOW = 100  # intervals kept: the worker's recent rhythm


class Silence:
    """One worker's heartbeats, and whether its silence now means it hung. ``upper``
    (``worker_timeout``): a longer silence is a hang whatever the history (None: phi only)."""

    def __init__(self, upper: float | None, *, threshold: float = THRESHOLD, floor: float = FLOOR):
        self.upper, self.threshold, self.floor = upper, threshold, floor
        self.last: float | None = None  # when the last beat was heard
        self.intervals: deque[float] = deque(maxlen=WINDOW)

    def beat(self, now: float) -> None:
        """A beat heard at ``now`` (the runtime's clock; beats must not go back in time)."""
        if self.last is not None and now > self.last:
            self.intervals.append(now - self.last)
        if self.last is None or now > self.last:
            self.last = now

    def start(self, now: float) -> None:
        """The worker (a new incarnation) starts now; its predecessor's rhythm, if any, is kept."""
        self.last = now

    def mean(self) -> float | None:
        """The mean interval between beats, once ``MIN_SAMPLES`` are known."""
        if len(self.intervals) < MIN_SAMPLES:
            return None
        return sum(self.intervals) / len(self.intervals)

    def phi(self, now: float) -> float:
        """``-log10 P(interval >= silence)`` since the last beat (0 while the rhythm is unknown)."""
        m = self.mean()
        if m is None or self.last is None:
            return 0.0
        n = len(self.intervals)
        var = sum((x - m) ** 2 for x in self.intervals) / n
        spread = max(math.sqrt(var), MIN_SPREAD * m, 1e-6)
        silence = now - self.last
        tail = 0.5 * math.erfc((silence - m) / (spread * math.sqrt(2.0)))
        return math.inf if tail <= 0.0 else max(0.0, -math.log10(tail))

    def hung(self, now: float) -> str | None:
        """Why the worker is taken for hung at ``now`` (None: it is not)."""
        if self.last is None:
            return None
        silence = now - self.last
        if self.upper is not None and silence > self.upper:
            return (
                f"no heartbeat for {silence:.1f} s (worker_timeout={self.upper:g} s): "
                "hung or stopped"
            )
        if silence < self.floor:
            return None
        phi = self.phi(now)
        if phi < self.threshold:
            return None
        m = self.mean()
        assert m is not None  # phi > 0 needs a known rhythm
        return (
            f"no heartbeat for {silence:.1f} s, {silence / m:.3g}x its usual interval of "
            f"{m:.3g} s (phi {phi:.3g} >= {self.threshold:g}): hung or stopped"
        )


def late_start(since: float, now: float, limit: float) -> str | None:
    """Why a worker setting up since ``since`` fails at ``now`` (None: within ``limit`` s)."""
    return f"did not start within start_timeout={limit:g} s" if now - since > limit else None


def silent_rank(silence: float | None, others: int, limit: float, *, rounds: bool = False) -> bool:
    """Whether a launched rank is hung: it pushed, then nothing for ``limit`` s (0: never;
    ``silence`` None: no push yet) while the ``others`` pushed; never under BSP (``rounds``)."""
    return bool(limit) and not rounds and silence is not None and silence >= limit and others > 0
