"""``sw.RunOptions``: how to run a job; every run option's default and check, stated once."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stalewise import runtime as runtime_lib
from stalewise import targets
from stalewise.protocol.loop import DIVERGE_AFTER
from stalewise.runtime.base import check_run
from stalewise.runtime.errors import FAILURE_POLICIES
from stalewise.targets import _is_int as _count  # an int, not a bool
from stalewise.targets import _is_number as _real  # an int or float, not a bool

#: The shortest ``eval_interval``, in seconds (virtual in the simulator).
MIN_EVAL_INTERVAL = 1e-3
#: The shortest ``worker_timeout``: a worker beats every ``min(1, worker_timeout / 4)`` s.
MIN_WORKER_TIMEOUT = 0.1
MIN_CHECKPOINT_SECONDS = 1e-3  #: The shortest ``checkpoint_seconds`` (virtual in the simulator).
#: The longest timeout, in seconds (about 3 years; longer ones overflow the OS's waits).
MAX_TIMEOUT = 1e8


class OptionError(ValueError):
    """A bad run option: ``option`` names it (a :class:`RunOptions` field), ``problem`` says why."""

    def __init__(self, option: str, problem: str):
        self.option, self.problem = option, problem
        super().__init__(f"{option} {problem}")


class OptionTypeError(OptionError, TypeError):
    """An :class:`OptionError` of the wrong type (a TypeError too)."""


def _timeout(name: str, value: Any) -> Any:
    if value is None and name == "timeout":
        return value
    if not (_real(value) and 0 <= value <= MAX_TIMEOUT):
        none = " (None: no limit)" if name == "timeout" else ""
        raise OptionError(
            name, f"must be a number of seconds in [0, {MAX_TIMEOUT:g}]{none}, got {value!r}"
        )
    return value


def _eval_interval(e: Any) -> Any:
    if not (_real(e) and 0 < e < math.inf):
        raise OptionError("eval_interval", f"must be a finite number of seconds > 0, got {e!r}")
    if e < MIN_EVAL_INTERVAL:
        raise OptionError(
            "eval_interval",
            f"must be >= {MIN_EVAL_INTERVAL:g} s, got {e!r}: a run records (and evaluates) "
            "once per interval of its time, virtual in the simulator",
        )
    return e


def _function(name: str, what: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is not None and not callable(value):
            raise OptionTypeError(name, f"must be a function {what}, got {value!r}")
        return value

    return check


def _integer(name: str, low: int, *, none: bool = False, unit: str = "") -> Callable[[Any], Any]:
    """The check of an integer option ``>= low`` (``none``: None is allowed too)."""

    def check(n: Any) -> Any:
        if (n is None and none) or (_count(n) and n >= low):
            return n
        also = " or None" if none else ""
        raise OptionError(name, f"must be an integer >= {low}{unit}{also}, got {n!r}")

    return check


def _transport(t: Any) -> Any:
    if not (_real(t) and 0 <= t <= 60):
        raise OptionError("transport", f"must be a number of seconds in [0, 60], got {t!r}")
    return float(t)


def _on_worker_failure(value: Any) -> Any:
    if value not in FAILURE_POLICIES:
        raise OptionError(
            "on_worker_failure",
            f"must be one of {', '.join(map(repr, FAILURE_POLICIES))}, got {value!r}",
        )
    return value


def _worker_timeout(t: Any) -> Any:
    if t is not None and not (_real(t) and 0 < t <= MAX_TIMEOUT):
        raise OptionError(
            "worker_timeout", f"must be a finite number of seconds > 0 or None, got {t!r}"
        )
    if t is not None and t < MIN_WORKER_TIMEOUT:
        raise OptionError(
            "worker_timeout",
            f"must be >= {MIN_WORKER_TIMEOUT:g} s or None, got {t!r}: a worker sends a "
            "heartbeat every min(1, worker_timeout / 4) seconds",
        )
    return t


def _checkpoint_dir(d: Any) -> Any:
    if d is not None and not isinstance(d, str | os.PathLike):
        raise OptionTypeError("checkpoint_dir", f"must be a path (str or os.PathLike), got {d!r}")
    return d


def _checkpoint_seconds(secs: Any) -> Any:
    if secs is not None and not (_real(secs) and math.isfinite(secs) and secs > 0):
        raise OptionError("checkpoint_seconds", f"must be a finite number > 0, got {secs!r}")
    if secs is not None and secs < MIN_CHECKPOINT_SECONDS:
        raise OptionError(
            "checkpoint_seconds",
            f"must be >= {MIN_CHECKPOINT_SECONDS:g} s, got {secs!r}: every checkpoint writes "
            "the whole model",
        )
    return secs


def _flag(name: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, bool):
            raise OptionTypeError(name, f"must be True or False, got {value!r}")
        return value

    return check


MAX_WORKERS = 16  #: The worker ids ``workers="auto"`` makes room for.


def _workers(value: Any) -> Any:
    """``workers``: an int >= 1, ``(min, max)`` with ``1 <= min <= max`` (elastic), or ``"auto"``
    (elastic, following the cluster's free CPUs). Returns it, a list as a tuple."""
    if value == "auto" and isinstance(value, str):
        return value
    if isinstance(value, tuple | list):
        if len(value) == 2 and all(_count(x) for x in value) and 1 <= value[0] <= value[1]:
            return tuple(value)
    elif _count(value) and value >= 1:
        return value
    raise OptionError(
        "workers",
        f'must be an integer >= 1, (min, max) with 1 <= min <= max, or "auto", got {value!r}',
    )


_TIMEOUTS = ("timeout", "start_timeout", "shard_start_timeout", "join_timeout", "ack_timeout",
             "stop_timeout")  # fmt: skip

#: The check of each option checkable alone: ``f(value) -> value`` (normalized), or OptionError.
_CHECKS: dict[str, Callable[[Any], Any]] = {
    "workers": _workers,
    "eval_interval": _eval_interval,
    "evaluate": _function("evaluate", "f(params) -> dict"),
    **{name: functools.partial(_timeout, name) for name in _TIMEOUTS},
    "sim_seed": _integer("sim_seed", 0),
    "checkpoint_dir": _checkpoint_dir,
    "checkpoint_every": _integer("checkpoint_every", 1, none=True, unit=" (pushes)"),
    "checkpoint_seconds": _checkpoint_seconds,
    "checkpoint_keep": _integer("checkpoint_keep", 1),
    "checkpoint_fsync": _flag("checkpoint_fsync"),
    "resume": _flag("resume"),
    "on_worker_failure": _on_worker_failure,
    "max_restarts": _integer("max_restarts", 0, none=True),
    "worker_timeout": _worker_timeout,
    "transport": _transport,
    "diverge_after": _integer("diverge_after", 1, none=True),
    "stop_at": targets.parse,
}


@dataclass(frozen=True)
class RunOptions:
    """The run-time options of one training run (see :meth:`stalewise.Job.train`); a bad
    one raises :class:`OptionError` naming it. Timeouts are in wall seconds."""

    loss_and_grad: Callable[[Any, Any], tuple[float, Any]]
    data: Any  # data(worker, workers) -> batches, or one sequence of batches per worker
    workers: Any  # an int, (min, max) or "auto" (see _workers)
    steps: int  # pushes in all workers (the job's budget)
    evaluate: Callable[[Any], Mapping[str, float]] | None = None
    eval_interval: float = 0.5  # seconds between evaluations (virtual in the simulator)
    stragglers: Mapping[int, float] | Sequence[float] | None = None
    delays: Mapping[int, float] | None = None
    transport: float = 0.0  # emulated seconds each push spends in transit (local runtime)
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
    sim_seed: int = 0  # the simulator's random seed (runtime "sim" only), not the task's
    checkpoint_dir: str | os.PathLike | None = None  # where checkpoints go (stalewise.checkpoint)
    checkpoint_every: int | None = None  # a checkpoint every this many pushes of the job
    checkpoint_seconds: float | None = None  # ... and/or every this many seconds (virtual in sim)
    checkpoint_keep: int = 2  # checkpoints kept (the newest)
    checkpoint_fsync: bool = False  # push logs fsynced before the acks (local runtime, Ray)
    resume: bool = False  # start from the newest usable checkpoint in checkpoint_dir
    on_worker_failure: str = "restart"  # "restart" | "drop" | "fail" (errors.Failures)
    max_restarts: int | None = 3  # restarts per worker id (and per shard); None: no limit
    worker_timeout: float | None = 60.0  # seconds without a heartbeat before a worker is hung
    diverge_after: int | None = DIVERGE_AFTER  # see protocol.loop.worker_loop; None: never
    slowdowns: tuple[float, ...] = field(init=False)  # per worker, >= 1
    extra_delays: tuple[float, ...] = field(init=False)  # per worker, seconds
    room: int = field(init=False)  # the worker ids, 0 .. room - 1 (an elastic run's max)
    expected: int = field(init=False)  # the workers expected (an elastic run's min)

    @staticmethod
    def check(name: str, value: Any) -> Any:
        """Checks one option alone as ``RunOptions`` does: its value (normalized) or OptionError."""
        if name not in _CHECKS:
            raise KeyError(f"{name!r} is not a run option checked alone (known: {sorted(_CHECKS)})")
        return _CHECKS[name](value)

    @property
    def elastic(self) -> bool:
        """Whether the worker count may change during the run."""
        return self.expected < self.room

    def check_runtime(self, runtime: str) -> None:
        """Raises :class:`OptionError` (``workers``) if this run is elastic and ``runtime``'s
        ``Job.train`` does not support that (its :class:`~stalewise.runtime.Runtime`)."""
        if self.transport and not runtime_lib.describe(runtime).transport:
            raise OptionError("transport", f"is emulated by runtime "
                              f"{runtime_lib.able('transport')} only, not {runtime!r}")  # fmt: skip
        if self.elastic and not runtime_lib.describe(runtime).elastic_train:
            able = " or ".join(map(repr, runtime_lib.names("elastic_train")))
            raise OptionError(
                "workers",
                f"={self.workers!r} (elastic, {self.expected}..{self.room} workers) "
                f"is supported by Job.train on runtime {able} "
                f"only, not {runtime!r}; pass an integer (job.serve(workers=(min, max)) is "
                "elastic on every runtime with a server)",
            )

    def for_workers(self) -> RunOptions:
        """These options without what only the parent uses (evaluation, record callback)."""
        return dataclasses.replace(self, evaluate=None, on_record=None)

    def __post_init__(self) -> None:
        if not callable(self.loss_and_grad):
            raise OptionTypeError(
                "loss_and_grad",
                f"must be a function f(params, batch) -> (loss, grads), "
                f"got {type(self.loss_and_grad).__name__}",
            )
        workers = _workers(self.workers)  # room for the worker ids, and those expected
        if workers == "auto":
            lo, hi = 1, MAX_WORKERS
        elif isinstance(workers, tuple):
            lo, hi = workers
        else:
            lo = hi = workers
        object.__setattr__(self, "room", hi)
        object.__setattr__(self, "expected", lo)
        factors, extra = check_run(self.room, self.steps, self.data, self.stragglers, self.delays)
        object.__setattr__(self, "slowdowns", tuple(factors))
        object.__setattr__(self, "extra_delays", tuple(extra))
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name)))
        for name in ("checkpoint_every", "checkpoint_seconds", "resume"):
            if getattr(self, name) not in (None, False) and self.checkpoint_dir is None:
                raise OptionError(name, "needs checkpoint_dir (where checkpoints are kept)")


#: Every option's default, from the fields above.
DEFAULTS: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(RunOptions)
    if f.default is not dataclasses.MISSING
}
