"""A worker's pull and its own push in flight: the pipelining rule every runtime follows.

A worker has at most :data:`IN_FLIGHT` push in flight; its next pull reads the shards' snapshots
when it may, else it is a request behind the push. Why: ``docs/design-notes.md``.

Example:
    >>> import stalewise as sw
    >>> may_read(sw.SSP(1), committed=3, min_clocks=[2, 2])   # 3 - 2 <= 1
    True
    >>> may_read(sw.BSP(), committed=3, min_clocks=[2, 3])    # the round is not closed
    False
    >>> may_read(sw.Hybrid(), committed=0, min_clocks=[0])    # only the shard knows its mode
    False
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stalewise.consistency import Consistency

IN_FLIGHT = 1  #: Pushes a worker may have committed and not seen acknowledged by every shard.
PUBLISH_EVERY = 0.02  #: Seconds: the most a busy shard defers publishing a version (all runtimes).
READ_WAIT = 10.0  #: Copies of its slice: the longest a shard defers a step for a worker copying it.


def step_wait(readers: Iterable[float], now: float, copy: float) -> float:
    """Seconds a shard defers its next step for the workers copying its live params since
    ``readers`` (a step would tear their copies), each at most :data:`READ_WAIT` ``copy``."""
    return max((t + READ_WAIT * copy - now for t in readers), default=0.0)


def answer_at_acks(push: Any) -> bool:
    """Whether the runtime answers the loop's ``push`` only once every shard acked it."""
    return bool(push.settle)


def exact_pulls(config: Any) -> bool:
    """Whether a worker's pull must be served by the shard (a gated model, DC-ASGD)."""
    return config.consistency.gated or bool(config.staleness.dc_lambda)


def reads_snapshots(config: Any, *, incarnation: int, joined_at: int) -> bool:
    """Whether a worker's pulls read the shards' newest snapshots (subject to :func:`may_read`)
    rather than ask each shard; ``joined_at``: its clock when it joined."""
    if config.staleness.dc_lambda:  # the shard keeps what each worker pulled
        return False
    return not config.consistency.gated or (incarnation <= 1 and joined_at == 0)


def may_read(consistency: Consistency, committed: int, min_clocks: Iterable[int]) -> bool:
    """Whether a worker that has committed ``committed`` pushes (the one in flight
    included) passes every shard's gate, the slowest live clocks being ``min_clocks``."""
    return all(consistency.may_start(committed, int(c)) for c in min_clocks)


def publish_due(
    version: int, published: int, *, busy: bool, clock_moved: bool, since: float
) -> bool:
    """Whether a shard at ``version`` (``published`` last, ``since`` seconds ago) copies its params
    out for pulls after a turn: when idle, every :data:`PUBLISH_EVERY` s while busy (more
    requests waiting), and at once when its slowest clock moved (never ahead of the params)."""
    return version != published and (not busy or clock_moved or since > PUBLISH_EVERY)


class Publication:
    """When a shard publishes a new snapshot of its slice: at once for an exact pull, else at
    most every ``every`` seconds, less often if publishing would take over ``share`` of its time."""

    def __init__(self, every: float, share: float = 0.25):
        self.every, self.share = every, share
        self.version, self.at, self.cost = -1, float("-inf"), 0.0  # cost: a moving average

    def due(self, version: int, now: float, *, exact: bool) -> bool:
        """Whether to publish ``version`` now, for a pull (``exact``: one that must read it)."""
        return self.version < 0 or (
            self.version != version and (exact or now - self.at >= self.every)
        )

    def published(self, version: int, *, start: float, end: float) -> None:
        """``version`` was published between ``start`` and ``end`` (seconds)."""
        self.version, self.at = version, end
        self.cost = 0.8 * self.cost + 0.2 * (end - start)

    def wait(self, version: int, now: float, extra: float = 0.0) -> float | None:
        """After a push: seconds until ``version`` is to be published (<= 0: now; None:
        it is published). ``extra``: what a publication costs beyond the copy (seconds)."""
        if self.version == version:
            return None
        return self.at + max(self.every, (self.cost + extra) / self.share) - now
