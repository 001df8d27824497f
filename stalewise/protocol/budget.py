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
overshoot of at most ``workers - 1``, and no partial round. ``r`` is the shards'
round, not the worker's own count (:func:`round_of`): the larger of the worker's
clock (its pull's answer, or the clock it joined at plus its pushes since) and the
round the shards have under way (their slowest counted clock, as last read), so a
late joiner that built its model while rounds ran, or a restart, begins in the
round under way and stays inside the budget. ``workers`` is the job's
number of workers (expected at the start): a round that a worker misses (it
died, or has not joined yet) has fewer pushes, so such a run ends with fewer
pushes than ``steps``, after the same number of rounds.

*At commit* (a loop you own, which may push without asking): a client given a
budget (``client.budget = steps``; ``sw.init`` and ``stalewise run`` give theirs)
refuses a push the rule would not begin (:func:`refuses`), before anything is
sent, unless its ``may_begin`` said yes since its last push. Under BSP it asks
again even then: the round may have moved on between the question and the push
(a joiner's first pull starts it in the round under way), and a push into a round
past the budget would start a partial round.

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
    >>> round_of(own=3, shards=9)  # a joiner that built its model while 6 rounds ran
    9
    >>> held(pushed=48, committed=24, handled=23)  # a checkpoint: one push in flight
    47
    >>> shard = {"incarnation": [2], "next_seq": [23]}
    >>> off_cut([shard, shard], worker=0, held=47, state=47) is None  # one cut
    True
    >>> off_cut([shard], worker=0, held=47, state=45)
    "rank 0's ctx.state is after 45 of its pushes, the shards' after 47: a resume repeats 2 of them"
    >>> refuses(10, granted=True, may_begin=lambda s: False, rounds=False)  # asked: granted
    False
    >>> refuses(10, granted=True, may_begin=lambda s: False, rounds=True)  # BSP: asked again
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any


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


def round_of(own: int, shards: int) -> int:
    """Under BSP: the round a worker's next push goes to, for :func:`may_begin_round`:
    ``own``, the worker's clock as it knows it (its pull's answer, or the clock it
    joined at plus its pushes since), or ``shards``, the round the shards have under
    way (their slowest counted clock), if that is later: a worker that starts counting
    after it joined (a late joiner at its first pull, a restart) starts there."""
    return max(own, shards)


def held(pushed: int, committed: int, handled: int) -> int:
    """What a checkpoint counts of a worker id's pushes: the pushes its saved state holds.
    ``pushed``: the id's count over its incarnations (bumped at each commit);
    ``committed``: its current incarnation's pushes committed, as read with ``pushed``;
    ``handled``: how many of those the saved state holds (the least over the shards). The
    pushes committed and not yet handled when the state was read are in no state, so a
    run resumed from it counts them as not made: counting them made a resumed BSP run,
    whose rounds go on from the saved version, end at 162 pushes of a 160 budget."""
    return max(pushed - max(committed - handled, 0), 0)


def off_cut(
    states: Sequence[Mapping[str, Any]], worker: int, held: int, state: int | None
) -> str | None:
    """Why a checkpoint is not one cut for ``worker`` (None: it is). One cut: every shard's
    saved state (``states``) holds the same pushes of the worker's incarnation, and its
    saved ``ctx.state``, after ``state`` of its pushes (None: it has none), is after the
    ``held`` ones (:func:`held`), so a resume applies each of its pushes once."""
    seats = {(int(s["incarnation"][worker]), int(s["next_seq"][worker])) for s in states}
    if len(seats) > 1:
        return f"worker {worker}: the shards hold different pushes of it, {sorted(seats)}"
    if state is None or state == held:
        return None
    n = held - state
    return (
        f"rank {worker}'s ctx.state is after {state} of its pushes, the shards' after {held}: "
        f"a resume {'repeats' if n > 0 else 'skips'} {abs(n)} of them"
    )


def refuses(
    steps: int | None, granted: bool, may_begin: Callable[[int], bool], *, rounds: bool
) -> bool:
    """At a push's commit: whether a client with the budget ``steps`` (None: none) must
    refuse it (see "At commit" above). ``granted``: the client's ``may_begin`` said yes
    since its last push; ``may_begin``: asks the rule now; ``rounds``: BSP, where the
    rule is asked even for a granted push."""
    if steps is None or (granted and not rounds):
        return False
    return not may_begin(steps)
