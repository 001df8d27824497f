"""The budget rule: what counts toward a job's ``steps``, and when a worker may begin a step.

What counts: the pushes committed (:mod:`stalewise.protocol.commit`) by every worker id over
its incarnations, whatever the shards answer; ``docs/design-notes.md`` ("One budget rule").

Example:
    >>> [may_begin_round(r, workers=4, steps=10) for r in range(4)]  # 3 rounds: 12 pushes
    [True, True, True, False]
    >>> after_rollback(live={2}, ended={0})  # worker 0's loop ended after the copy
    [0, 2]
    >>> checkpoint_due(pushes=41, last=20, every=20), checkpoint_due(pushes=39, last=21, every=20)
    (True, False)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


class Budget:
    """A client's ``budget`` attribute: None (no budget) or the job's pushes in all, an
    integer in [1, 2**62), checked when it is set (one line naming the value)."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else obj.__dict__.get("_budget")

    def __set__(self, obj: Any, value: Any) -> None:
        ok = value is None or (type(value) is int and 1 <= value < 2**62)
        if not ok:
            raise ValueError(f"client.budget must be None or an integer >= 1, got {value!r}")
        obj.__dict__["_budget"] = value


def may_begin(committed: int, in_progress: int, steps: int) -> bool:
    """Whether a worker may begin another step: ``committed + in_progress < steps``."""
    return committed + in_progress < steps


def may_begin_round(round: int, workers: int, steps: int) -> bool:
    """Under BSP: whether a worker may begin round ``round``: ``round * workers < steps``."""
    return round * max(workers, 1) < steps


def settle_first(committed: int, in_progress: int, steps: int) -> bool:
    """Whether a worker refused a step must first wait for its own pushes in flight
    (``in_progress > 0``) and ask :func:`may_begin` again, instead of stopping."""
    return in_progress > 0 and not may_begin(committed, in_progress, steps)


def overshoot_bound(workers: int, *, exact: bool = False) -> int:
    """Most pushes committed past ``steps``: 0 if ``exact`` (simulator), else ``workers - 1``."""
    return 0 if exact else max(workers - 1, 0)


def round_of(own: int, shards: int) -> int:
    """Under BSP, the round a worker's next push goes to: the later of its and the shards'."""
    return max(own, shards)


def held(pushed: int, committed: int, handled: int) -> int:
    """What a checkpoint counts of a worker id's pushes (``pushed`` over its incarnations):
    those committed and not yet ``handled`` by every shard are counted as not made."""
    return max(pushed - max(committed - handled, 0), 0)


def handled(inc: int, committed: int, seats: Iterable[tuple[int, int]]) -> int:
    """How many of incarnation ``inc``'s ``committed`` pushes every shard handled."""
    return min(seq if i == inc else committed if i > inc else 0 for i, seq in seats)


def off_cut(
    states: Sequence[Mapping[str, Any]], worker: int, held: int, state: int | None
) -> str | None:
    """Why a checkpoint is not one cut for ``worker`` (None: it is): every shard's ``states``
    hold the same pushes of its incarnation, and its ``ctx.state``, after ``state`` of its
    pushes (None: none), is after the ``held`` ones (:func:`held`)."""
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


def after_rollback(live: Iterable[int], ended: Iterable[int]) -> list[int]:
    """The worker ids that carry on, as new incarnations, when the shards roll back to a
    copy: the ``live`` ones, and those whose loop ``ended`` on the budget after the copy."""
    return sorted({*live, *ended})


def checkpoint_due(pushes: int, last: int, every: int) -> bool:
    """Whether a checkpoint is due at the job's ``pushes`` (as :func:`may_begin` counts them),
    the last one's at ``last``: the count has passed a multiple of ``every`` since."""
    return pushes // every > last // every


def refuses(
    steps: int | None, granted: bool, may_begin: Callable[[int], bool], *, rounds: bool
) -> bool:
    """At a push's commit: whether a client with the budget ``steps`` (None: none) must refuse
    it (``granted``: ``may_begin`` said yes since its last push; ``rounds``: BSP)."""
    if steps is None or (granted and not rounds):
        return False
    return not may_begin(steps)
