"""The budget rule: what counts toward a job's ``steps``, and when a worker may begin a step.

*What counts*: the pushes **committed** (:mod:`stalewise.protocol.commit`), by
every worker id over all its incarnations. A committed push counts whatever the
shards answer (a push refused as ``too_stale`` or ``not_finite`` was a step); a
step abandoned before its commit (its worker failed while pulling or computing)
does not. This is the count a run reports as its pushes.

*When a worker may begin a step*: while ``committed + in_progress < steps``
(:func:`may_begin`), where ``committed`` is the count above as the worker can
read it and ``in_progress`` the steps begun and not counted in it that the worker
knows of. A worker whose answer is no while some of its own pushes are in flight
waits for their acknowledgements and asks again (its pushes may have been
counted in ``committed`` already); it stops when the answer is no with nothing
of its own in flight (:func:`settle_first`).

How each runtime reads the two counts, and the overshoot (pushes committed
beyond ``steps``) it allows:

* simulator: both exact (the events run one at a time, and ``in_progress``
  counts every worker's steps begun and not committed): no overshoot;
* local processes: ``committed`` exact (one counter per worker id in shared
  memory, bumped by the commit itself), ``in_progress`` the worker's own, which
  is 0 at a step's start (a push commits before the next step begins); the
  other workers' steps under way are not seen, so at most ``workers - 1`` of
  them may commit after the count reached ``steps - 1``: an overshoot of at most
  ``workers - 1``;
* Ray: ``committed`` as shard 0 last said it (every committed push reaches
  every shard), ``in_progress`` the worker's own pushes in flight; the overshoot
  is at most ``workers - 1`` when shard 0's count is current at the check (a
  pull's reply under SSP/BSP, or an ack); under ASP a step starts from shard 0's
  newest snapshot, whose count may lack the other workers' pushes handled since
  it was published (at most ``publish_every`` seconds), which adds those pushes.

*Rounds* (BSP, where a round's pushes are averaged and applied together): a
partial last round would apply the mean of a few workers' pushes as if it were
the whole round's (with DiLoCo, one worker's pseudo-gradient under the outer
momentum), a worse step than none. So under BSP the rule counts whole rounds: a
worker may begin its step of round ``r`` (0-based, the shards' clock for it)
while the ``r`` rounds before it, ``workers`` pushes each, are fewer than
``steps`` pushes (:func:`may_begin_round`). Every worker of a round gets the
same answer, so the budget becomes ``ceil(steps / workers)`` full rounds: an
overshoot of at most ``workers - 1``, and no partial round. A runtime reads
``r`` as the clock the worker joined at plus its pushes since (local processes,
simulator), or as its pull's answer gives it (Ray). ``workers`` is the job's
number of workers (expected at the start): a round that a worker misses (it
died, or has not joined yet) has fewer pushes, so such a run ends with fewer
pushes than ``steps``, after the same number of rounds.

Example:
    >>> may_begin(committed=7, in_progress=2, steps=10)
    True
    >>> may_begin(committed=8, in_progress=2, steps=10)
    False
    >>> settle_first(committed=8, in_progress=2, steps=10)  # own pushes in flight: wait, ask again
    True
    >>> overshoot_bound(workers=4, exact=True), overshoot_bound(workers=4)
    (0, 3)
    >>> [may_begin_round(r, workers=4, steps=10) for r in range(4)]  # 3 rounds: 12 pushes
    [True, True, True, False]
"""

from __future__ import annotations


def may_begin(committed: int, in_progress: int, steps: int) -> bool:
    """Whether a worker may begin another step: ``committed + in_progress < steps``."""
    return committed + in_progress < steps


def may_begin_round(round: int, workers: int, steps: int) -> bool:
    """Under BSP: whether a worker may begin its step of round ``round`` (0-based) of a
    job of ``workers`` workers: ``round * workers < steps`` (whole rounds only)."""
    return round * max(workers, 1) < steps


def settle_first(committed: int, in_progress: int, steps: int) -> bool:
    """Whether a worker refused a step must first wait for its own pushes in flight
    (``in_progress > 0``) and ask :func:`may_begin` again, instead of stopping."""
    return in_progress > 0 and not may_begin(committed, in_progress, steps)


def overshoot_bound(workers: int, *, exact: bool = False) -> int:
    """The most pushes a run commits beyond ``steps``: 0 when every worker's steps in
    progress are seen (``exact``, the simulator), else ``workers - 1`` (a current count,
    or whole BSP rounds in any runtime)."""
    return 0 if exact else max(workers - 1, 0)
