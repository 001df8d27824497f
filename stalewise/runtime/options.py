"""``RunOptions``: how to run a job, built and checked once by ``Job.train``.

Every runtime takes ``(config, strategy, options)``, so a new option is written
once, here, and a new runtime needs no copy of the long keyword list.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stalewise.protocol.loop import DIVERGE_AFTER
from stalewise.runtime.base import FAILURE_POLICIES, check_run

#: The shortest ``eval_interval``, in seconds (virtual in the simulator). A run records once
#: per interval; 1 ms is finer than any real evaluation and keeps a simulated run's records
#: (and its evaluations) to a thousand per virtual second.
MIN_EVAL_INTERVAL = 1e-3
#: The shortest ``worker_timeout``: a worker beats every ``min(1, worker_timeout / 4)`` s.
MIN_WORKER_TIMEOUT = 0.1
#: The shortest ``checkpoint_seconds`` (virtual in the simulator).
MIN_CHECKPOINT_SECONDS = 1e-3
#: The longest timeout, in seconds (about 3 years; longer ones overflow the OS's waits).
MAX_TIMEOUT = 1e8


def _real(value: object) -> bool:
    """True for an int or float (numpy's too), not a bool; NaN is refused by the comparisons."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class RunOptions:
    """The run-time options of one training run (see :meth:`stalewise.Job.train`).

    Timeouts are in wall seconds, at most :data:`MAX_TIMEOUT`; None waits forever.
    ``eval_interval`` is at least :data:`MIN_EVAL_INTERVAL`, ``worker_timeout``
    at least :data:`MIN_WORKER_TIMEOUT`, ``checkpoint_seconds`` at least
    :data:`MIN_CHECKPOINT_SECONDS` (straggler factors and delays: see
    :func:`stalewise.runtime.base.check_run`).
    """

    loss_and_grad: Callable[[Any, Any], tuple[float, Any]]
    data: Any  # data(worker, workers) -> batches, or one sequence of batches per worker
    workers: int
    steps: int  # pushes in all workers (the job's budget)
    evaluate: Callable[[Any], Mapping[str, float]] | None = None
    eval_interval: float = 0.5  # seconds between evaluations (virtual in the simulator)
    stragglers: Mapping[int, float] | Sequence[float] | None = None
    delays: Mapping[int, float] | None = None
    stop_at: Any = None  # anything stalewise.targets.parse accepts
    run: str = "run"
    on_record: Callable[[dict], None] | None = None
    progress: bool = False
    timeout: float | None = None  # the whole run
    start_timeout: float = 300.0  # a worker's start-up: spawn, data, warm-up step
    shard_start_timeout: float = 120.0  # a shard process's start-up
    join_timeout: float = 300.0  # start-up lease: expected workers that never join are dropped
    ack_timeout: float = 60.0  # a worker's wait for its last acks at the end
    stop_timeout: float = 10.0  # a process's wait to exit when the job ends
    sim: Any = None  # the simulator's SimConfig (runtime "sim" only)
    seed: int = 0  # the simulator's random seed (runtime "sim" only)
    checkpoint_dir: str | os.PathLike | None = None  # where checkpoints go (stalewise.checkpoint)
    checkpoint_every: int | None = None  # a checkpoint every this many updates (shard 0's version)
    checkpoint_seconds: float | None = None  # ... and/or every this many seconds (virtual in sim)
    checkpoint_keep: int = 2  # checkpoints kept (the newest)
    resume: bool = False  # start from the newest usable checkpoint in checkpoint_dir
    on_worker_failure: str = (
        "restart"  # "restart" | "drop" | "fail" (stalewise.runtime.base.Failures)
    )
    max_restarts: int | None = 3  # restarts per worker id (and per shard); None: no limit
    worker_timeout: float | None = 60.0  # seconds without a heartbeat before a worker is hung
    # pushes in a row refused as NaN/Inf or overflow before a worker has diverged; None: never
    diverge_after: int | None = DIVERGE_AFTER
    # derived in __post_init__
    slowdowns: tuple[float, ...] = field(init=False)  # per worker, >= 1
    extra_delays: tuple[float, ...] = field(init=False)  # per worker, seconds

    def for_workers(self) -> RunOptions:
        """These options without what only the parent uses (evaluation, record callback),
        which need not be picklable."""
        return dataclasses.replace(self, evaluate=None, on_record=None)

    def __post_init__(self) -> None:
        if not callable(self.loss_and_grad):
            raise TypeError(
                f"loss_and_grad must be a function f(params, batch) -> (loss, grads), "
                f"got {type(self.loss_and_grad).__name__}"
            )
        factors, extra = check_run(
            self.workers, self.steps, self.data, self.stragglers, self.delays
        )
        object.__setattr__(self, "slowdowns", tuple(factors))
        object.__setattr__(self, "extra_delays", tuple(extra))
        e = self.eval_interval
        if not (_real(e) and 0 < e < math.inf):
            raise ValueError(f"eval_interval must be a finite number of seconds > 0, got {e!r}")
        if e < MIN_EVAL_INTERVAL:
            raise ValueError(
                f"eval_interval must be >= {MIN_EVAL_INTERVAL:g} s, got {e!r}: a run records "
                "(and evaluates) once per interval of its time, virtual in the simulator"
            )
        if self.evaluate is not None and not callable(self.evaluate):
            raise TypeError(f"evaluate must be a function f(params) -> dict, got {self.evaluate!r}")
        for name in ("timeout", "start_timeout", "shard_start_timeout", "join_timeout",
                     "ack_timeout", "stop_timeout"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name == "timeout":
                continue
            if not (_real(value) and 0 <= value <= MAX_TIMEOUT):
                none = " (None: no limit)" if name == "timeout" else ""
                raise ValueError(
                    f"{name} must be a number of seconds in [0, {MAX_TIMEOUT:g}]{none}, "
                    f"got {value!r}"
                )
        self._check_checkpoints()
        self._check_failures()
        from stalewise import targets

        object.__setattr__(self, "stop_at", targets.parse(self.stop_at))

    def _check_failures(self) -> None:
        if self.on_worker_failure not in FAILURE_POLICIES:
            raise ValueError(
                f"on_worker_failure must be one of {', '.join(map(repr, FAILURE_POLICIES))}, "
                f"got {self.on_worker_failure!r}"
            )
        n = self.max_restarts
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"max_restarts must be an integer >= 0 or None, got {n!r}")
        t = self.worker_timeout
        if t is not None and not (_real(t) and 0 < t <= MAX_TIMEOUT):
            raise ValueError(
                f"worker_timeout must be a finite number of seconds > 0 or None, got {t!r}"
            )
        if t is not None and t < MIN_WORKER_TIMEOUT:
            raise ValueError(
                f"worker_timeout must be >= {MIN_WORKER_TIMEOUT:g} s or None, got {t!r}: a worker "
                "sends a heartbeat every min(1, worker_timeout / 4) seconds"
            )
        k = self.diverge_after
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"diverge_after must be an integer >= 1 or None, got {k!r}")

    def _check_checkpoints(self) -> None:
        d = self.checkpoint_dir
        if d is not None and not isinstance(d, str | os.PathLike):
            raise TypeError(f"checkpoint_dir must be a path (str or os.PathLike), got {d!r}")
        every = self.checkpoint_every
        if every is not None and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise ValueError(f"checkpoint_every must be an integer >= 1 (updates), got {every!r}")
        secs = self.checkpoint_seconds
        if secs is not None and not (_real(secs) and math.isfinite(secs) and secs > 0):
            raise ValueError(f"checkpoint_seconds must be a finite number > 0, got {secs!r}")
        if secs is not None and secs < MIN_CHECKPOINT_SECONDS:
            raise ValueError(
                f"checkpoint_seconds must be >= {MIN_CHECKPOINT_SECONDS:g} s, got {secs!r}: "
                "every checkpoint writes the whole model"
            )
        keep = self.checkpoint_keep
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"checkpoint_keep must be an integer >= 1, got {keep!r}")
        if not isinstance(self.resume, bool):
            raise TypeError(f"resume must be True or False, got {self.resume!r}")
        for name in ("checkpoint_every", "checkpoint_seconds", "resume"):
            if getattr(self, name) not in (None, False) and d is None:
                raise ValueError(f"{name} needs checkpoint_dir (where checkpoints are kept)")


#: Every option's default, from the fields above: ``Job.train``'s keyword defaults and
#: the config's ``[run]`` defaults read them here, so a default is stated once.
DEFAULTS: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(RunOptions)
    if f.default is not dataclasses.MISSING
}
