"""The rule of :func:`stalewise.consistency.Hybrid`, a worker's *pace* being the smoothed time from
a served pull to its next push. Why: ``docs/design-notes.md`` ("Protocol")."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

SMOOTHING = 0.5  # weight of the newest measurement in a worker's pace
HYSTERESIS = 1.25  # back to synchronous only below tolerance / HYSTERESIS


class Pace:
    """Each worker's smoothed time from a served pull to its next push."""

    def __init__(self, workers: int):
        self.pace = np.full(workers, math.nan)  # NaN: not measured yet
        self._since = np.full(workers, math.nan)  # when the last pull was served

    def pulled(self, worker: int, now: float | None) -> None:
        if now is not None:
            self._since[worker] = now

    def pushed(self, worker: int, now: float | None) -> None:
        since = self._since[worker]
        if now is None or math.isnan(since):
            return
        took = max(now - since, 0.0)
        old = self.pace[worker]
        self.pace[worker] = took if math.isnan(old) else SMOOTHING * took + (1 - SMOOTHING) * old
        self._since[worker] = math.nan  # a push without a pull before it is not measured

    def forget(self, worker: int) -> None:
        """A new incarnation: its pace is measured afresh."""
        self.pace[worker] = self._since[worker] = math.nan

    def straggling(self, live: Sequence[bool], tolerance: float) -> bool:
        """Whether a live worker's pace exceeds ``tolerance`` times the live median."""
        paces = self.pace[np.asarray(live, dtype=bool)]
        paces = paces[~np.isnan(paces)]
        if paces.size < 2:
            return False
        median = float(np.median(paces))
        return bool(paces.max() > tolerance * median) if median > 0 else False

    def decide(self, synchronous: bool, live: Sequence[bool], tolerance: float) -> bool:
        """The mode for the next round: True for synchronous."""
        return not self.straggling(live, tolerance if synchronous else tolerance / HYSTERESIS)

    def state(self) -> np.ndarray:
        return self.pace.copy()

    def load(self, pace: np.ndarray, since: np.ndarray | None = None) -> None:
        self.pace[:] = pace
        self._since[:] = math.nan if since is None else since
