"""The hybrid consistency model's rule: synchronous while workers keep pace, else asynchronous.

Under :func:`stalewise.consistency.Hybrid` a shard runs in one of two modes:

* **synchronous** (BSP): a worker that pushed in the current round waits until
  every live worker has pushed; the round's mean is applied once;
* **asynchronous** (ASP): no waiting; every push is applied on arrival, with
  the job's staleness weight divided by ``sqrt(live workers)``. One learning
  rate then suits both modes: a synchronous round applies the mean of ``W``
  pushes once, and by the square-root scaling rule (Krizhevsky 2014; Hoffer et
  al. 2017) a step on a ``W``-times larger batch takes about ``sqrt(W)`` times
  the learning rate of one push. (Dividing by ``W``, the linear rule, made the
  asynchronous phases crawl with 16 workers; not dividing made a rate tuned for
  BSP overshoot with 4.)

The shard measures each worker's *pace*: the time from the pull it served to
that worker's next push (compute plus transfer; the runtime passes ``now``, wall
seconds in the local runtime, virtual seconds in the simulator), smoothed over
pushes. A worker is a *straggler* when its pace exceeds ``tolerance`` times the
median pace of the live workers. The mode is decided at round boundaries only
(in the asynchronous mode, a round is over when every live worker has pushed
since the last decision), so a shard switches between whole rounds:

* synchronous -> asynchronous when the round just closed had a straggler;
* asynchronous -> synchronous when no worker's pace exceeds ``tolerance / 1.25``
  times the median (the margin keeps a worker near the limit from flapping).

A shard starts synchronous. Every shard measures the same pushes and decides
by the same rule; as each measures its own arrival times, two shards can
switch one round apart near the limit. Every push is still applied exactly
once by every shard (or by none): only how a round's pushes are merged (mean
or one by one) can differ in that round.

Example:
    >>> pace = Pace(workers=3)
    >>> for w, took in enumerate([1.0, 1.1, 4.0]):
    ...     pace.pulled(w, 0.0)
    ...     pace.pushed(w, took)
    >>> pace.straggling([True, True, True], tolerance=2.0)
    True
    >>> pace.straggling([True, True, False], tolerance=2.0)  # worker 2 left
    False
"""

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
        if synchronous:
            return not self.straggling(live, tolerance)
        return not self.straggling(live, tolerance / HYSTERESIS)

    def state(self) -> np.ndarray:
        return self.pace.copy()

    def load(self, pace: np.ndarray) -> None:
        self.pace[:] = pace
        self._since[:] = math.nan
