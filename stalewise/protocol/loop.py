"""The one worker loop every runtime drives: begin, pull, strategy step, push.

The loop, a generator without I/O, asks its runtime:

* :data:`BEGIN`: answer True to start a step, False to end the loop;
* :data:`PULL`: answer with the pulled parameters (the user's tree);
* :data:`CLOCK` (after each PULL, for a ``timed`` strategy): answer with the runtime's clock (s);
* a :class:`Push`: push ``update``, emulate the compute time, and answer with the
  :class:`~stalewise.protocol.messages.PushResult` of every push completed since the last
  answer, when its ``settle`` and ``overlap`` say (:mod:`stalewise.protocol.pipeline`);
* an :class:`Ahead` (with ``overlap=True`` and a strategy that ``overlaps``): emulate its
  steps; answer with the results completed meanwhile.

Example:
    >>> import numpy as np
    >>> from stalewise import strategies
    >>> lg = lambda p, b: (0.0, {"x": p["x"]})
    >>> loop = worker_loop(strategies.gradients(), lg, iter([None] * 2))
    >>> budget = iter([True, True, False])
    >>> def answer(request):
    ...     if request is BEGIN:
    ...         return next(budget)
    ...     if request is PULL:
    ...         return {"x": np.ones(2)}
    ...     return []
    >>> run(loop, answer).steps
    2
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stalewise.protocol.messages import APPLIED, REFUSED, SPLIT, PushResult
from stalewise.strategies import LossAndGrad, Strategy

log = logging.getLogger(__name__)

DIVERGE_AFTER = 20  # pushes in a row refused for a numerical fault that make a worker Diverged
NUMERICAL = frozenset({"not_finite", "overflow"})  # refusals that mean the training diverges
WARN_EVERY = 10.0  # wall seconds: after the first, a worker's refusals are summarised this often


class Diverged(RuntimeError):
    """A worker's last ``pushes`` pushes were all refused for NaN/Inf or overflow."""

    def __init__(self, worker: int, pushes: int, reason: str | None):
        super().__init__(
            f"worker {worker} diverged: its last {pushes} pushes were refused as NaN/Inf "
            f"or overflow (diverge_after={pushes}); the last: {reason}"
        )
        self.worker, self.pushes, self.reason = worker, pushes, reason


class _Request:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


BEGIN = _Request("BEGIN")
PULL = _Request("PULL")
CLOCK = _Request("CLOCK")


class Push(NamedTuple):
    """The loop asks its runtime to push ``update``."""

    update: Any  # a tree with the params' structure
    loss: float  # training loss of the step
    local_steps: int  # minibatches the step consumed
    compute: float  # wall seconds the strategy step took
    settle: bool = False  # answer once acknowledged; the next PULL includes it
    overlap: bool = False  # answer once sent; an Ahead follows, the next PULL includes it


class Ahead(NamedTuple):
    """The loop took ``local_steps`` inner steps, ``compute`` wall seconds, while its last
    push was in flight; the runtime emulates their time (the push may land meanwhile)."""

    local_steps: int
    compute: float


def emulated(request: Push | Ahead, slowdown: float, delay: float) -> float:
    """Seconds (>= 0) a real-time runtime waits after ``request``'s real compute to emulate a
    worker ``slowdown`` times slower with ``delay`` more seconds per local step.

    Example:
        >>> emulated(Ahead(local_steps=2, compute=1.0), slowdown=3.0, delay=0.5)
        5.0
    """
    return max((request.compute + delay * request.local_steps) * slowdown - request.compute, 0.0)


@dataclass
class LoopStats:
    """What one worker's loop did; the generator's return value."""

    steps: int = 0  # pushes made
    outcomes: Counter = field(default_factory=Counter)  # status -> count of reported pushes
    refusals: Counter = field(default_factory=Counter)  # refusal kind -> count
    refused_in_a_row: int = 0  # numerical refusals since the last applied push
    warned_at: float = field(default=-math.inf, repr=False)  # monotonic time of the last warning


def worker_loop(
    strategy: Strategy,
    loss_and_grad: LossAndGrad,
    batches: Iterator,
    *,
    worker: int = 0,
    diverge_after: int | None = DIVERGE_AFTER,
    overlap: bool = False,
) -> Generator[Any, Any, LoopStats]:
    """A worker's whole life (the module docstring). ``diverge_after``: raise :class:`Diverged`
    after this many numerical refusals in a row; ``overlap``: the runtime answers :class:`Ahead`."""
    if diverge_after is not None and (
        isinstance(diverge_after, bool) or not isinstance(diverge_after, int) or diverge_after < 1
    ):
        raise ValueError(f"diverge_after must be an integer >= 1 or None, got {diverge_after!r}")
    stats = LoopStats()
    state = None
    first = True
    timed = bool(getattr(strategy, "timed", False))
    settles = bool(getattr(strategy, "settles", False))
    ahead = overlap and settles and bool(getattr(strategy, "overlaps", False))
    while (yield BEGIN):
        params = yield PULL
        now = (yield CLOCK) if timed else None
        if first:
            state, first = strategy.init(params), False
        if timed:
            if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
                raise TypeError(
                    f"worker {worker}: the runtime answered the loop's CLOCK request with "
                    f"{now!r}; it must answer with its clock in seconds (a finite number)"
                )
            strategy.started(state, float(now))
        t0 = time.perf_counter()
        step = strategy.step(state, params, loss_and_grad, batches)
        state = step.state
        push = Push(
            step.update,
            float(step.loss),
            int(step.local_steps),
            time.perf_counter() - t0,
            settles,
            ahead,
        )
        del step, params  # not kept alive (a model-sized array each) while the runtime works
        results = yield push
        del push
        stats.steps += 1
        report(results, stats, worker, diverge_after=diverge_after)
        if ahead:  # the steps that need no pull, while the push is in flight
            t0 = time.perf_counter()
            n = strategy.ahead(state, loss_and_grad, batches)
            results = yield Ahead(int(n), time.perf_counter() - t0)
            report(results, stats, worker, diverge_after=diverge_after)
    return stats


class Watch:
    """A loop the user owns (``sw.init``'s), watched as :func:`worker_loop` watches its own."""

    def __init__(self, worker: int, diverge_after: int | None = DIVERGE_AFTER):
        self.worker, self.diverge_after = worker, diverge_after
        self.stats = LoopStats()
        self.pulled = False  # the client pulled at least once

    def pushing(self) -> None:
        self.stats.steps += 1
        if not self.pulled and self.stats.steps == 1:
            log.warning(
                "worker %d pushed before its first pull: the job's parameters never reach "
                "its model, so it trains nothing; pull before each step "
                "(ctx.client.pull(into=model))",
                self.worker,
            )

    def result(self, result: PushResult) -> None:
        report([result], self.stats, self.worker, diverge_after=self.diverge_after)


def report(
    results: list[PushResult] | None,
    stats: LoopStats,
    worker: int,
    *,
    diverge_after: int | None = None,
) -> None:
    """Counts push outcomes, warns about refusals (the first of each kind, the 10th, 100th, ...,
    else one every ``WARN_EVERY`` s at most); :class:`Diverged` after ``diverge_after``."""
    for r in results or ():
        stats.outcomes[r.status] += 1
        if r.status == APPLIED:
            stats.refused_in_a_row = 0
        if r.status not in (REFUSED, SPLIT):
            continue
        kind = r.kind or "refused"
        stats.refusals[kind] += 1
        if kind in NUMERICAL:
            stats.refused_in_a_row += 1
        _warn(r, kind, stats, worker)
        if diverge_after is not None and stats.refused_in_a_row >= diverge_after:
            raise Diverged(worker, stats.refused_in_a_row, r.reason)


def _warn(r: PushResult, kind: str, stats: LoopStats, worker: int) -> None:
    n, now = stats.refusals[kind], time.monotonic()
    what = "split (applied by some shards only)" if r.status == SPLIT else "refused"
    if n == 1:
        log.warning(
            "worker %d: push %d %s: %s (%d of %d pushes refused so far)",
            worker,
            r.seq,
            what,
            r.reason,
            sum(stats.refusals.values()),
            stats.steps,
        )
    elif n == 10 ** (len(str(n)) - 1) or now - stats.warned_at >= WARN_EVERY:  # 10, 100, ...
        log.warning(
            "worker %d: %d pushes refused as %s (%d of %d pushes so far); last: push %d %s: %s",
            worker,
            n,
            kind,
            sum(stats.refusals.values()),
            stats.steps,
            r.seq,
            what,
            r.reason,
        )
    else:
        return
    stats.warned_at = now


def run(loop: Generator[Any, Any, LoopStats], answer: Callable[[Any], Any]) -> LoopStats:
    """Drives ``loop`` to its end, answering each request with ``answer(request)``."""
    request = next(loop)
    while True:
        try:
            request = loop.send(answer(request))
        except StopIteration as stop:
            return stop.value
