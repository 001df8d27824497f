"""The option groups of ``Job.train`` (e.g. ``failures=sw.Failures("drop")``): small frozen objects,
checked when made (an ``OptionError`` naming ``Group.field``); every default is ``DEFAULTS``'s."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from stalewise.runtime.options import _CHECKS, DEFAULTS, OptionError, OptionTypeError

__all__ = ["Checkpoints", "Emulation", "Failures", "Metrics", "Simulation", "Timeouts"]


class _Group:
    """A frozen group of run options; ``FIELDS`` maps each field to its RunOptions name."""

    FIELDS: ClassVar[dict[str, str]]
    KEYWORD: ClassVar[str]  # its keyword of Job.train

    def __post_init__(self) -> None:
        for name, option in self.FIELDS.items():
            check = _CHECKS.get(option)
            if check is None:
                continue
            try:
                object.__setattr__(self, name, check(getattr(self, name)))
            except OptionError as e:
                kind = OptionTypeError if isinstance(e, TypeError) else OptionError
                raise kind(f"{type(self).__name__}.{name}", e.problem) from None

    def run_options(self) -> dict[str, Any]:
        """The group's values under their :class:`RunOptions` names."""
        return {option: getattr(self, name) for name, option in self.FIELDS.items()}


@dataclass(frozen=True)
class Checkpoints(_Group):
    """Checkpoints of the job (:mod:`stalewise.checkpoint`) in folder ``dir``: one at the end of the
    run, and every ``every`` updates and/or ``seconds`` seconds; the newest ``keep`` are kept.
    ``resume``: start from the newest usable one (none yet: afresh, warned). ``fsync`` (local,
    Ray): the shards' push logs reach the disk before each ack (docs/design-notes.md, "Push log").

    Example:
        >>> Checkpoints("ckpt", every=0)
        Traceback (most recent call last):
        ...
        stalewise.runtime.options.OptionError: Checkpoints.every must be an integer >= 1 (pushes) or None, got 0
    """

    dir: str | os.PathLike
    every: int | None = DEFAULTS["checkpoint_every"]
    seconds: float | None = DEFAULTS["checkpoint_seconds"]
    keep: int = DEFAULTS["checkpoint_keep"]
    fsync: bool = DEFAULTS["checkpoint_fsync"]
    resume: bool = DEFAULTS["resume"]

    KEYWORD: ClassVar[str] = "checkpoints"
    FIELDS: ClassVar[dict[str, str]] = {"dir": "checkpoint_dir", "every": "checkpoint_every",
        "seconds": "checkpoint_seconds", "keep": "checkpoint_keep", "resume": "resume",
        "fsync": "checkpoint_fsync"}  # fmt: skip

    def __post_init__(self) -> None:
        if self.dir is None:
            raise OptionTypeError(
                "Checkpoints.dir", "must be a path (str or os.PathLike), got None"
            )
        super().__post_init__()


@dataclass(frozen=True)
class Failures(_Group):
    """What happens to a worker that dies, hangs or raises (``docs/reliability.md``).

    Args:
        policy: ``"restart"`` it as a new incarnation at the current params, ``"drop"`` it
            (the others spend the budget), or ``"fail"`` the job (:class:`WorkerError`).
            A dead shard is restarted unless ``"fail"``.
        max_restarts: restarts allowed per worker id (and per shard); None: no limit.
        worker_timeout: seconds without a heartbeat after which a worker is hung and killed
            (local runtime; None: never); one call of ``loss_and_grad`` must be shorter.
        diverge_after: a worker whose last this many pushes were all refused (NaN/Inf,
            overflow) stops; once all have, the job raises :class:`DivergedError`. None: never."""

    policy: str = DEFAULTS["on_worker_failure"]
    max_restarts: int | None = DEFAULTS["max_restarts"]
    worker_timeout: float | None = DEFAULTS["worker_timeout"]
    diverge_after: int | None = DEFAULTS["diverge_after"]

    KEYWORD: ClassVar[str] = "failures"
    FIELDS: ClassVar[dict[str, str]] = {"policy": "on_worker_failure",
        "max_restarts": "max_restarts", "worker_timeout": "worker_timeout",
        "diverge_after": "diverge_after"}  # fmt: skip


@dataclass(frozen=True)
class Timeouts(_Group):
    """Wall seconds things may take: ``total``, the whole run (TimeoutError; None: no limit); a
    worker's ``start``, a shard's ``shard_start``, a late worker's ``join`` (then it stops holding
    back the gates), the last ``ack`` of a worker's pushes and a process's ``stop``."""

    total: float | None = DEFAULTS["timeout"]
    start: float = DEFAULTS["start_timeout"]
    shard_start: float = DEFAULTS["shard_start_timeout"]
    join: float = DEFAULTS["join_timeout"]
    ack: float = DEFAULTS["ack_timeout"]
    stop: float = DEFAULTS["stop_timeout"]

    KEYWORD: ClassVar[str] = "timeouts"
    FIELDS: ClassVar[dict[str, str]] = {"total": "timeout", "start": "start_timeout",
        "shard_start": "shard_start_timeout", "join": "join_timeout", "ack": "ack_timeout",
        "stop": "stop_timeout"}  # fmt: skip


@dataclass(frozen=True)
class Emulation(_Group):
    """A slower cluster, emulated: ``stragglers``, a slowdown factor per worker (``{3: 4.0}``
    or one per worker), ``delays``, extra seconds per step for some workers, and ``transport``,
    seconds each push spends in transit before the shards see it (local runtime)."""

    stragglers: Mapping[int, float] | Sequence[float] | None = DEFAULTS["stragglers"]
    delays: Mapping[int, float] | None = DEFAULTS["delays"]
    transport: float = DEFAULTS["transport"]

    KEYWORD: ClassVar[str] = "emulation"
    FIELDS: ClassVar[dict[str, str]] = {"stragglers": "stragglers", "delays": "delays",
                                        "transport": "transport"}  # fmt: skip


@dataclass(frozen=True)
class Metrics(_Group):
    """The run's metrics records: one ``every`` seconds (virtual in the simulator), with
    an evaluation when ``evaluate`` is given; ``name``, the run's name in them;
    ``on_record(record)``, called with each as it is made; ``loggers``, more consumers,
    e.g. ``[sw.loggers.TensorBoardLogger("runs/tb")]`` (:mod:`stalewise.loggers`; one that
    raises is dropped with a warning); ``progress``: a progress bar."""

    every: float = DEFAULTS["eval_interval"]
    name: str = DEFAULTS["run"]
    on_record: Callable[[dict], None] | None = DEFAULTS["on_record"]
    loggers: Any = None
    progress: bool = DEFAULTS["progress"]

    KEYWORD: ClassVar[str] = "metrics"
    # on_record and loggers reach RunOptions as one callback (stalewise.loggers.Loggers)
    FIELDS: ClassVar[dict[str, str]] = {
        "every": "eval_interval",
        "name": "run",
        "progress": "progress",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.on_record is not None and not callable(self.on_record):
            raise OptionTypeError("Metrics.on_record", f"must be a function f(record), got "
                                  f"{self.on_record!r}")  # fmt: skip


@dataclass(frozen=True)
class Simulation(_Group):
    """The simulator, configured, as ``runtime=``: ``config``, a ``SimConfig`` (None: the
    default); ``seed``, the simulator's own, not the task's."""

    config: Any = DEFAULTS["sim"]
    seed: int = DEFAULTS["sim_seed"]

    KEYWORD: ClassVar[str] = "runtime"
    FIELDS: ClassVar[dict[str, str]] = {"config": "sim", "seed": "sim_seed"}
    name: ClassVar[str] = "sim"  # the runtime it configures

    def __post_init__(self) -> None:
        from stalewise.runtime.sim.config import SimConfig

        if self.config is not None and not isinstance(self.config, SimConfig):
            raise OptionTypeError(
                "Simulation.config", f"must be a SimConfig or None, got {self.config!r}"
            )
        super().__post_init__()


#: Job.train's groups, in the order of its keywords; then the simulator's (``runtime=``).
TRAIN_GROUPS = (Metrics, Checkpoints, Failures, Timeouts, Emulation)
GROUPS: tuple[type[_Group], ...] = (*TRAIN_GROUPS, Simulation)


def run_options(*groups: _Group | None) -> dict[str, Any]:
    """The :class:`RunOptions` keywords of ``groups`` (None: that group's defaults)."""
    out: dict[str, Any] = {}
    for group in groups:
        if group is not None:
            out |= group.run_options()
    return out


def check_group(value: Any, kind: type[_Group]) -> Any:
    """``value`` if it is a ``kind`` or None, else a one-line TypeError naming its keyword."""
    if value is None or isinstance(value, kind):
        return value
    raise OptionTypeError(kind.KEYWORD, f"must be a sw.{kind.__name__}(...) or None, got {value!r}")


def checkpoint_fields(where: str, checkpoints: Any) -> tuple[Any, Any, bool]:
    """``(dir, every, resume)`` of ``sw.init``'s and ``Job.serve``'s ``checkpoints`` (None:
    none); they save by pushes only, so ``seconds`` and ``keep`` are refused."""
    if check_group(checkpoints, Checkpoints) is None:
        return None, None, False
    for name in ("seconds", "keep"):
        if getattr(checkpoints, name) != DEFAULTS[Checkpoints.FIELDS[name]]:
            raise OptionError(f"Checkpoints.{name}", f"is for Job.train; {where} saves by pushes")
    return checkpoints.dir, checkpoints.every, checkpoints.resume
