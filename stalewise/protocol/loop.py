"""The one worker loop every runtime drives: begin, pull, strategy step, push.

The loop is a generator that does no I/O: it *asks* its runtime for what it
needs and the runtime answers, so a blocking runtime (local processes, Ray
actors) and an event-driven one (the simulator) run the very same loop:

* it yields :data:`BEGIN`: answer True to start a step (budget left, not
  stopped) or False to end the loop;
* it yields :data:`PULL`: answer with the pulled parameters (the user's tree);
* it yields a :class:`Push`: push ``update``, emulate or simulate the compute
  time, and answer with the :class:`~stalewise.protocol.messages.PushResult` of
  every push that completed since the last answer (a list, maybe empty).

:func:`run` drives it with a function that answers each request.

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
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stalewise.protocol.messages import REFUSED, PushResult
from stalewise.strategies import LossAndGrad, Strategy

log = logging.getLogger(__name__)


class _Request:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


BEGIN = _Request("BEGIN")
PULL = _Request("PULL")


class Push(NamedTuple):
    """The loop asks its runtime to push ``update``."""

    update: Any  # a tree with the params' structure
    loss: float  # training loss of the step
    local_steps: int  # minibatches the step consumed
    compute: float  # wall seconds the strategy step took


@dataclass
class LoopStats:
    """What one worker's loop did; the generator's return value."""

    steps: int = 0  # pushes made
    outcomes: Counter = field(default_factory=Counter)  # status -> count of reported pushes
    refusals: Counter = field(default_factory=Counter)  # refusal kind -> count


def worker_loop(
    strategy: Strategy, loss_and_grad: LossAndGrad, batches: Iterator, *, worker: int = 0
) -> Generator[Any, Any, LoopStats]:
    """A worker's whole life: see the module docstring for the requests it makes."""
    stats = LoopStats()
    state = None
    first = True
    while (yield BEGIN):
        params = yield PULL
        if first:
            state, first = strategy.init(params), False
        t0 = time.perf_counter()
        step = strategy.step(state, params, loss_and_grad, batches)
        state = step.state
        push = Push(step.update, float(step.loss), int(step.local_steps), time.perf_counter() - t0)
        del step, params  # not kept alive (a model-sized array each) while the runtime works
        results = yield push
        del push
        stats.steps += 1
        report(results, stats, worker)
    return stats


def report(results: list[PushResult] | None, stats: LoopStats, worker: int) -> None:
    """Counts push outcomes and warns about refusals as they are learned.

    The first refusal of each kind is reported with its reason, then the 10th,
    100th, ... with the counts, so a run refusing thousands of pushes stays legible.
    """
    for r in results or ():
        stats.outcomes[r.status] += 1
        if r.status != REFUSED:
            continue
        kind = r.kind or "refused"
        stats.refusals[kind] += 1
        n = stats.refusals[kind]
        if n == 1:
            log.warning("worker %d: push %d refused: %s", worker, r.seq, r.reason)
        elif n == 10 ** (len(str(n)) - 1):  # 10, 100, 1000, ...
            log.warning(
                "worker %d: %d pushes refused as %s (%d of %d pushes so far); last: %s",
                worker,
                n,
                kind,
                sum(stats.refusals.values()),
                stats.steps,
                r.reason,
            )


def run(loop: Generator[Any, Any, LoopStats], answer: Callable[[Any], Any]) -> LoopStats:
    """Drives ``loop`` to its end, answering each request with ``answer(request)``."""
    request = next(loop)
    while True:
        try:
            request = loop.send(answer(request))
        except StopIteration as stop:
            return stop.value
