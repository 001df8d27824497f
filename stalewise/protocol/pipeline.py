"""A worker's pull and its own push in flight: the pipelining rule every runtime follows.

The worker loop (:mod:`stalewise.protocol.loop`) yields a ``Push``, then ``BEGIN``
and ``PULL`` for its next step. Between them:

* **Answering the push.** A gradient push is answered as soon as it is committed
  and sent: the worker's next pull and step overlap its acknowledgement. A
  settling push (``Push.settle``: model averaging) is answered only once every
  shard has acknowledged it, and the next pull holds it (read-your-writes):
  :func:`answer_at_acks`.
* **At most one push in flight** (:data:`IN_FLIGHT`): a worker commits its next
  push only once every shard has acknowledged the previous one (its one push
  buffer is free again). Every runtime follows it.
* **What the next pull reads.** A worker whose clock the shards count from 0
  with it (its first incarnation, joined at clock 0) and that needs no record of
  its pull at the shard (no DC-ASGD) *reads the shards' newest snapshots*
  (:func:`reads_snapshots`), without a request the shard would queue behind its
  work, when its own clock, its pushes committed *including the one in flight*,
  passes every shard's gate against that shard's slowest clock
  (:func:`may_read`; always under ASP). The snapshot may lack the push in
  flight: that push then reaches the shards while the worker computes, and the
  worker's next push is one version staler. Otherwise (the gate is closed, a
  hybrid shard decides its mode itself, DC-ASGD, a restarted or late worker) the
  pull is a *request* to each shard, sent behind the push on the same channel:
  the shard handles the push first, serves the pull when its gate lets the
  worker start, so the pull holds the push.
* **A pull that must hold the worker's own push** (a loop you own: ``pull()``
  after ``push()``, read-your-writes) waits for that push's acks, which name the
  version each shard reached; it reads a shard's snapshot if that is at least
  the acked version, and otherwise asks that shard to serve it (a request
  behind the push, as above), so it never waits for a busy shard's next
  publication.

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

#: Pushes a worker may have committed and not seen acknowledged by every shard.
IN_FLIGHT = 1
#: Seconds: the longest a busy shard defers publishing a new version (every runtime's).
PUBLISH_EVERY = 0.02


def answer_at_acks(push: Any) -> bool:
    """Whether the runtime answers the loop's ``push`` only once every shard acked it."""
    return bool(push.settle)


def exact_pulls(config: Any) -> bool:
    """Whether a worker's pull must be served the shard's current parameters, asked of
    the shard (a gated model: the gate is the shard's; DC-ASGD: the shard keeps the pull),
    rather than the newest snapshot it published."""
    return config.consistency.gated or bool(config.staleness.dc_lambda)


def reads_snapshots(config: Any, *, incarnation: int, joined_at: int) -> bool:
    """Whether a worker's pulls read the shards' newest snapshots (subject to
    :func:`may_read`) rather than ask each shard.

    Args:
        config: the job's :class:`~stalewise.protocol.ServerConfig`.
        incarnation: the worker's incarnation (1: its first).
        joined_at: the worker's clock at the shards when it joined (the slowest
            live clock): its own count of pushes is its clock only from 0.
    """
    if config.staleness.dc_lambda:  # the shard keeps what each worker pulled
        return False
    return not config.consistency.gated or (incarnation <= 1 and joined_at == 0)


def may_read(consistency: Consistency, committed: int, min_clocks: Iterable[int]) -> bool:
    """Whether a worker that has committed ``committed`` pushes (the one in flight
    included) may read the snapshots, the shards' slowest live clocks being
    ``min_clocks``: every shard's gate lets it start."""
    return all(consistency.may_start(committed, int(c)) for c in min_clocks)


class Publication:
    """When a shard publishes a new snapshot of its slice for the pulls that read one
    (ASP; Ray's shard actors): at once for an exact pull (:func:`exact_pulls`, or a
    read-your-writes pull that needs a newer version), else at most every ``every``
    seconds, and more rarely if publishing would take more than ``share`` of the
    shard's time (a large slice under a stream of pushes).
    """

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
