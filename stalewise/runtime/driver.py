"""The run skeleton every runtime shares: :func:`drive` runs a job over a :class:`Host`."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from stalewise import checkpoint, tree
from stalewise import runtime as runtime_lib
from stalewise.checkpoint import replay
from stalewise.runtime.errors import Failures, WorkerError
from stalewise.runtime.result import Recorder, TrainResult, end_reason, mean_loss

log = logging.getLogger(__name__)

# what Host.advance returns
TICK = "tick"  # the clock moved on (a real-time host's wait): records and checkpoints due are taken
RECORD = "record"  # the clock reached the record time asked for, nothing else is due
CHECKPOINT = "checkpoint"  # an event made a checkpoint due (the ``due`` predicate said so)
END = "end"  # the run is over: every worker's loop ended or no worker is left


def wait_for(until: float, now: float, tick: float) -> float:
    """Seconds a real-time host may wait at ``now``: one ``tick`` at most, none past ``until``."""
    return min(tick, max(0.0, until - now))


class Snapshot(NamedTuple):
    """What a checkpoint holds of a run (see :meth:`stalewise.checkpoint.Saver.save`)."""

    states: Sequence[dict]  # each shard's state_dict
    step: dict  # at least "pushes" and "time"; a runtime adds its own ("drawn", "sim")
    residuals: Sequence[np.ndarray] | None  # each worker's error feedback (None: none kept)


class Host(Protocol):
    """What a runtime implements for :func:`drive`: its ``runtime`` name, whether its clock
    is ``virtual``, ``checkpoint_info`` for a checkpoint's manifest, and these calls."""

    runtime: str
    virtual: bool
    checkpoint_info: dict

    def start(self, run: Run) -> None:
        """Starts the shards (from ``run.resume``'s states) and every worker (from ``run.drawn``
        and ``run.feedback``); returns when all are ready, not yet released."""

    def go(self) -> None:
        """Releases the workers together; the host's clock starts (or goes on, resumed)."""

    def advance(self, until: float, due: Callable[[], bool] | None) -> str:
        """Runs the job on towards time ``until``; returns ``TICK``, ``RECORD``, ``CHECKPOINT``
        (an event-driven host, once ``due()`` says so) or ``END``."""

    def now(self) -> float:
        """The host's clock: seconds since :meth:`go` (before it, the time the run starts at)."""

    def pushes(self) -> int:
        """Pushes counted toward ``steps`` and ``checkpoint_every`` (at the last :meth:`advance`)."""

    def stats(self, *, settled: bool = False) -> dict:
        """The shards' counters merged (:func:`~stalewise.runtime.result.merge_stats`)."""

    def losses(self) -> Sequence[float]:
        """Each worker's last loss (NaN: it has not pushed)."""

    def params(self) -> Any:
        """The parameters as an observer pulls them (a tree)."""

    def stop(self) -> bool:
        """``stop_at`` is reached: tells the workers to stop; True if the run ends at once."""

    def snapshot(self, now: float, *, failure: bool = False) -> Snapshot | None:
        """The run's state for a checkpoint at ``now`` (``failure``: a WorkerError stops the
        run); None when none can be taken now (the driver tries again when next due)."""

    def budget_spent(self) -> bool:
        """A worker's loop ended because the budget was spent."""

    def diverged(self) -> list[int]:
        """The workers that diverged (their loop raised ``loop.Diverged``)."""

    def finish(self, stats: dict) -> np.ndarray:
        """The run is over: adds the runtime's entries to ``stats``; returns the final params."""

    def close(self) -> None:
        """Stops everything it started; called once, whatever happened."""


class Run:
    """One run driven over a host: what the host may read, and :meth:`train`."""

    def __init__(self, host: Host, config: Any, strategy: Any, options: Any):
        self.host, self.config, self.strategy, self.options = host, config, strategy, options
        hint = ""  # the failure policy's fatal errors say how to resume
        if options.checkpoint_dir is not None:
            hint = (
                f"\nCheckpoints are in {options.checkpoint_dir}: resume with Job.train(..., "
                "checkpoints=sw.Checkpoints(DIR, resume=True)) or `stalewise train CONFIG --resume "
                "RUN_DIR`."
            )
        self.failures = Failures(options.on_worker_failure, options.max_restarts, hint=hint)
        # a host outside the registry (a test's, a user's own driver) has no such rule
        known = host.runtime in runtime_lib.names()
        own = runtime_lib.describe(host.runtime).resumes_from if known else None
        self.resume = checkpoint.resume_point(
            config, options, runtime=host.runtime, resumes_from=own
        )
        self.logs = known and runtime_lib.describe(host.runtime).logs_pushes
        if self.resume is not None and self.logs:
            self.resume = replay.logged(self.resume, config)
        self.saver: checkpoint.Saver | None = None
        self.recorder: Recorder | None = None

    @property
    def pushes_at_start(self) -> int:
        """The pushes the resumed checkpoint had counted (0: a fresh run)."""
        return 0 if self.resume is None else int(self.resume.step.get("pushes", 0))

    @functools.cached_property
    def drawn(self) -> list[int]:
        """The batches each worker id had drawn at the resumed checkpoint (zeros: none)."""
        return checkpoint.drawn_of(self.resume, self.options.room)

    @functools.cached_property
    def feedback(self) -> list[Any] | None:
        """Each worker's error-feedback state to start from (None: the codec keeps none)."""
        return checkpoint.feedback_of(self.resume, self.config, self.options.room)

    def _save(self, now: float, *, final: bool = False, failure: bool = False) -> None:
        assert self.saver is not None
        snap = self.host.snapshot(now, failure=failure)
        if snap is not None:  # a write that fails warns and is kept in failures
            self.saver.save(snap.states, snap.step, snap.residuals, final=final)

    def _record(self, now: float, pushes: int) -> bool:
        assert self.recorder is not None
        host, o = self.host, self.options
        return self.recorder.record(
            now, pushes, host.stats(), mean_loss(host.losses()), o.evaluate, host.params
        )

    def train(self) -> TrainResult:
        """Starts the host, runs the record/checkpoint loop to the end, returns the result."""
        host, o = self.host, self.options
        try:
            if self.resume is not None:
                log.info(
                    "%s: resumed from %s (version %d) and %d pushes of its logs",
                    host.runtime,
                    self.resume.path,
                    self.resume.version,
                    self.resume.step.get("replayed", 0),
                )
            host.start(self)
            if o.evaluate is not None and not host.virtual:  # the first call may load data
                o.evaluate(host.params())  # or compile: not training time
            self.recorder = Recorder(
                o.run, o.steps, stop_at=o.stop_at, on_record=o.on_record, progress=o.progress
            )
            try:
                return self._run()
            finally:
                self.recorder.close()
        finally:
            host.close()

    def _run(self) -> TrainResult:
        host, o, recorder = self.host, self.options, self.recorder
        assert recorder is not None
        if o.checkpoint_dir is not None:
            self.saver = checkpoint.Saver(
                self.config, self.strategy, o, runtime=host.runtime, pushes=host.pushes(),
                now=host.now(), failures=self.failures,
                **host.checkpoint_info,
            )  # fmt: skip
        saver = self.saver
        due = None
        if saver is not None and saver.periodic:
            due = lambda: saver.due(host.pushes(), host.now())  # noqa: E731
        settled = True  # no push is left in flight at the end
        if saver is not None and self.logs:  # before any push: the push logs begin at it
            self._save(host.now())
        try:
            host.go()
            deadline = math.inf if o.timeout is None else time.perf_counter() + o.timeout
            k, at = 0, host.now()  # the next record: at once, then at k * eval_interval
            while True:
                step = host.advance(at, due)
                now, pushes = host.now(), host.pushes()
                recorder.progress(pushes)
                if step == END:
                    break
                if step == RECORD or (step == TICK and now >= at):
                    k = max(k + 1, math.floor(now / o.eval_interval) + 1)
                    at = k * o.eval_interval
                    if self._record(now, pushes) and host.stop():
                        settled = False  # the run ends at once, pushes in flight
                        break
                if step != RECORD and saver is not None and saver.due(pushes, now):
                    self._save(now)
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"training did not finish within the timeout ({o.timeout} s)"
                    )
        except WorkerError:
            if saver is not None:  # the state at the failure, to resume from
                with contextlib.suppress(Exception):
                    self._save(host.now(), failure=True)
            raise
        if not recorder.records or recorder.records[-1]["time"] != now:
            self._record(now, pushes)  # the end's record
        stats = host.stats(settled=settled)
        ended, reason = end_reason(
            recorder,
            self.failures,
            pushes=pushes,
            steps=o.steps,
            budget_spent=host.budget_spent(),
            diverged=host.diverged(),
            stats=stats,
            version=stats["version"],
            run=o.run,
        )
        recorder.finish(reason)
        if saver is not None:  # the end of the run: every worker has left
            self._save(now, final=True)
        flat = host.finish(stats)
        params = tree.unflatten(flat, self.config.spec, copy=True)
        return TrainResult(
            params, flat, recorder.records, stats, now, pushes, self.failures.events, reason, ended
        )


def drive(host: Host, config: Any, strategy: Any, options: Any) -> TrainResult:
    """Runs the job of ``config`` over ``host`` with ``options``; :meth:`Host.close` at the end."""
    return Run(host, config, strategy, options).train()
