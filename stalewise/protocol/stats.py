"""A shard's counters (:class:`ShardStats`) and its live-clock bookkeeping (``_ClockTracker``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ShardStats:
    """Counters a shard keeps; cheap to copy and to merge across shards."""

    applied: int = 0  # pushes applied (in BSP: pushes merged into a round)
    rounds: int = 0  # optimizer steps taken (== version)
    rejected: Counter = field(default_factory=Counter)  # reason kind -> count
    duplicates: int = 0
    staleness: Counter = field(default_factory=Counter)  # tau -> count, applied pushes
    bytes_in: int = 0
    bytes_out: int = 0
    mode_switches: int = 0  # hybrid: switches between synchronous and asynchronous rounds

    def as_dict(self) -> dict[str, Any]:
        n = sum(self.staleness.values())
        return {
            "applied": self.applied,
            "rounds": self.rounds,
            "rejected": dict(self.rejected),
            "duplicates": self.duplicates,
            "staleness_mean": sum(t * c for t, c in self.staleness.items()) / n if n else 0.0,
            "staleness_max": max(self.staleness, default=0),
            "staleness_counts": dict(self.staleness),  # tau -> applied pushes
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "mode_switches": self.mode_switches,
        }


class _ClockTracker:
    """How many live workers are at each clock, and the slowest live clock (amortised O(1))."""

    def __init__(self, workers: int):
        self.live = workers  # number of live workers
        self._count = {0: workers}  # clock -> live workers at it (no zero entries)
        self._min = 0

    @classmethod
    def of(cls, clocks: np.ndarray, live: np.ndarray) -> _ClockTracker:
        """The tracker of a shard whose workers are at ``clocks``, those in ``live`` live."""
        tracker = cls(0)
        counts = Counter(int(c) for c in clocks[live])
        tracker.live = int(np.count_nonzero(live))
        tracker._count = dict(counts)
        tracker._min = min(counts, default=0)
        return tracker

    def min(self) -> int:
        """The slowest live clock (0 when no worker is live)."""
        return self._min if self.live else 0

    def add(self, clock: int) -> None:
        """A worker becomes live at ``clock``."""
        if not self.live or clock < self._min:
            self._min = clock
        self._count[clock] = self._count.get(clock, 0) + 1
        self.live += 1

    def remove(self, clock: int) -> None:
        """A live worker at ``clock`` leaves."""
        self.live -= 1
        self._drop(clock)

    def advance(self, clock: int) -> None:
        """A live worker moves from ``clock`` to ``clock + 1``."""
        self._count[clock + 1] = self._count.get(clock + 1, 0) + 1
        self._drop(clock)

    def _drop(self, clock: int) -> None:
        n = self._count.pop(clock) - 1
        if n:
            self._count[clock] = n
        elif self.live:
            while self._min not in self._count:
                self._min += 1
