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

Example:
    >>> may_begin(committed=7, in_progress=2, steps=10)
    True
    >>> may_begin(committed=8, in_progress=2, steps=10)
    False
    >>> settle_first(committed=8, in_progress=2, steps=10)  # own pushes in flight: wait, ask again
    True
    >>> overshoot_bound(workers=4, exact=True), overshoot_bound(workers=4)
    (0, 3)
"""

from __future__ import annotations


def may_begin(committed: int, in_progress: int, steps: int) -> bool:
    """Whether a worker may begin another step: ``committed + in_progress < steps``."""
    return committed + in_progress < steps


def settle_first(committed: int, in_progress: int, steps: int) -> bool:
    """Whether a worker refused a step must first wait for its own pushes in flight
    (``in_progress > 0``) and ask :func:`may_begin` again, instead of stopping."""
    return in_progress > 0 and not may_begin(committed, in_progress, steps)


def overshoot_bound(workers: int, *, exact: bool = False) -> int:
    """The most pushes a run commits beyond ``steps``: 0 when every worker's steps in
    progress are seen (``exact``, the simulator), else ``workers - 1`` (a current count)."""
    return 0 if exact else max(workers - 1, 0)
