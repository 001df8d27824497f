"""A rank's side of a launched job: its :class:`Context` (from :func:`become`), launch state."""

from __future__ import annotations

import dataclasses
import logging
import runpy
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalewise.protocol.loop import Watch

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT = 300.0  #: Seconds a launched worker waits at ``sw.init`` for the others.


class LaunchError(RuntimeError):
    """A launched script could not be run as asked (a user error: one line)."""


@dataclasses.dataclass
class Context:
    """What :func:`stalewise.init` gives one worker: who it is, its client, and when to stop."""

    rank: int  #: this worker's id, 0 .. world_size - 1
    world_size: int  #: the number of workers
    client: Any  #: this worker's :class:`~stalewise.runtime.local.client.Client`
    steps: int | None = None  #: the job's budget of pushes in all (None: no budget)
    launched: bool = True  #: started by ``stalewise run`` (else: one worker, served here)
    #: this rank's small state (data position, RNG...), JSON values and arrays: checkpointed
    state: dict = dataclasses.field(default_factory=dict)
    _ckpt: Any = dataclasses.field(default=None, repr=False)  # its side of the checkpoints
    _server: Any = dataclasses.field(default=None, repr=False)
    _barrier: Any = dataclasses.field(default=None, repr=False)  # the launcher's start barrier
    _refused: int = dataclasses.field(default=0, repr=False)  # as the closed client said

    def __post_init__(self) -> None:
        self.budget(self.steps)
        if self.client is not None:  # its pushes' refusals warn, and end a diverged loop
            self.client.watch = Watch(self.rank)

    def log(self, *, loss: float) -> None:
        """Reports this rank's latest training loss (the progress line shows the ranks' mean)."""
        if hasattr(self.client, "log_loss"):
            self.client.log_loss(float(loss))

    def budget(self, steps: int | None) -> None:
        """Sets the job's budget: ``should_stop()`` asks it, and the client refuses a push past
        it that ``should_stop()`` did not grant (:class:`~stalewise.BudgetSpent`)."""
        self.steps = steps
        if self.client is not None:
            self.client.budget = steps

    @property
    def refused(self) -> int:
        """Pushes the client refused past the budget (:class:`~stalewise.BudgetSpent`)."""
        return self._refused if self.client is None else self.client.budget_refused

    def should_stop(self) -> bool:
        """True once the job's workers have pushed ``steps`` times in all, or the job stops."""
        if self._ckpt is not None:
            self._ckpt.tick(self)
        if self.client.stopping:
            return True
        return self.steps is not None and not self.client.may_begin(self.steps)

    def loop(self, into: Any = None) -> Iterator[int]:
        """``for step in ctx.loop(into=model)``: steps 0, 1, ... until :meth:`should_stop`, each
        (and the loop's end) first pulling the job's parameters into ``into`` (if given)."""
        step = 0
        while not self.should_stop():
            if into is not None:
                self.client.pull(into=into)
            yield step
            step += 1
        if into is not None:
            self.client.pull(into=into)

    def close(self) -> None:
        """Waits for this worker's last push and leaves the job (again: does nothing)."""
        if self.client is None:
            return
        if self._ckpt is not None:  # this rank's last state (unlaunched: the last checkpoint)
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close(self)
        self._refused = self.client.budget_refused
        client, self.client = self.client, None
        client.watch = None  # the loop is over: its last result ends nothing
        try:
            client.wait()
        finally:
            client.close()
            if self._server is not None:
                self._server.close()
                self._server = None


WORKER: Context | None = None  # this process is a launched rank: its context
INITIALISED = False  # stalewise.init() has been called in this process


def become(ctx: Context) -> None:
    """This process is a launched rank: :func:`stalewise.init` returns ``ctx`` to its script."""
    global WORKER, INITIALISED
    WORKER, INITIALISED = ctx, False


def run_script(script: str | Path, argv: list[str]) -> None:
    """Runs ``script`` as ``__main__`` with ``argv``, its folder first on ``sys.path``."""
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(str(script), run_name="__main__")


def rendezvous(ctx: Context) -> None:
    """Waits (:data:`RENDEZVOUS_TIMEOUT` s at most) until every launched worker reached ``init``."""
    if ctx._barrier is None:
        return
    try:
        ctx._barrier.wait(RENDEZVOUS_TIMEOUT)
    except threading.BrokenBarrierError:
        log.warning(
            "rank %d: not every worker reached sw.init (one ended first, or %g s passed); "
            "starting without them",
            ctx.rank,
            RENDEZVOUS_TIMEOUT,
        )
