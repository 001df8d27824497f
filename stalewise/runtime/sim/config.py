"""The simulator's configuration: :class:`SimConfig` and its TOML ``[sim]`` table.

A :class:`SimConfig` gathers the timing, network and fault models of
:mod:`stalewise.runtime.sim.models` into one frozen, picklable, hashable value
that checks its fields when it is made and names the bad field and value.
:meth:`SimConfig.from_dict` reads the flat table a TOML ``[sim]`` section
spells; :mod:`stalewise.runtime.sim` runs a job on it.

Example:
    >>> cfg = SimConfig(compute=Fixed(0.5), failures=[Failure(worker=1, time=3.0)])
    >>> cfg.compute.mean, cfg.failures
    (0.5, (Failure(worker=1, time=3.0),))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stalewise.runtime.sim.models import (
    Contention,
    Failure,
    Fixed,
    Join,
    Network,
    Service,
    ShiftedExponential,
    SimConfigError,
    Slowdown,
    Stragglers,
    _bad,
    _factor,
    _seconds,
)

__all__ = ["MAX_RECORDS", "TOML_KEYS", "SimConfig", "SimConfigError", "TooLongError"]

#: The most records (evaluations, one every ``eval_interval`` virtual seconds) one simulated
#: run may make: 100000 records of a few kB each, about 14 virtual hours at the default
#: interval of 0.5 s. A run that would need more stops with :class:`TooLongError` instead of
#: filling the memory (an interval of 1e-300 s, or a transfer of 1e300 s, would never end).
MAX_RECORDS = 100_000
#: The largest ``model_bytes``: a petabyte.
MAX_MODEL_BYTES = 10**15


class TooLongError(ValueError):
    """A simulated run would record more than :data:`MAX_RECORDS` times: its ``eval_interval``
    is too short for its virtual time, or its [sim] times and rates make that time endless."""

    def __init__(
        self, now: float, eval_interval: float, pushes: int, steps: int, limit: int = MAX_RECORDS
    ):
        self.now, self.eval_interval = now, eval_interval
        super().__init__(
            f"the simulated run reached virtual time {now:.6g} s with {pushes} of {steps} pushes "
            f"done and would record more than {limit} times (eval_interval = "
            f"{eval_interval:g} s): raise eval_interval, or check the [sim] times and rates "
            f"(compute, latency, bandwidth, service, speeds, model_bytes) that make it so long"
        )


@dataclass(frozen=True)
class SimConfig:
    """How the simulator times a run. Only time is simulated; gradients are real.

    Attributes:
        compute: step-time model, :class:`Fixed` or :class:`ShiftedExponential`
            (default: ``shift=8 ms`` + Exp with mean 2 ms).
        speeds: optional per-worker speed (step time is divided by it), one per worker.
        stragglers: optional persistent stragglers (the last ``count`` workers).
        slowdowns: transient slowdowns.
        failures: workers that fail at given virtual times. A failure is handled by the
            job's failure policy (``on_worker_failure``), as in the local runtime,
            unless a later :class:`Join` of that worker says when it comes back.
        joins: workers that (re)join at given virtual times.
        restart_delay: virtual seconds a worker restarted by the failure policy
            takes to come back (default 1 s: a new process starting, loading its
            data and running a first step on one machine).
        network: latency and link bandwidths.
        service: per-shard service time of a request.
        contention: how much slower a step's compute and a shard's apply run with more
            processes runnable than alone (:class:`Contention`, measured by
            ``stalewise calibrate``); None (the default): no contention, every
            worker and shard runs at its own speed whatever the others do.
        model_bytes: pretend the full parameter vector has this many bytes on the
            wire and at the shards (each shard's slice and each push scaled alike),
            while computing on the real, smaller task. It changes timing only:
            the numbers the optimizer sees are those of the real task, so the
            loss curve is the small model's on the big model's clock.

    Example:
        >>> cfg = SimConfig(stragglers=Stragglers(count=1, slowdown=4.0),
        ...                 failures=[Failure(worker=2, time=1.5)])
        >>> cfg.failures
        (Failure(worker=2, time=1.5),)
        >>> SimConfig(model_bytes=-1)
        Traceback (most recent call last):
        ...
        stalewise.runtime.sim.models.SimConfigError: SimConfig.model_bytes = -1: must be None or an integer > 0
    """

    compute: Fixed | ShiftedExponential = field(default_factory=ShiftedExponential)
    speeds: tuple[float, ...] | None = None
    stragglers: Stragglers | None = None
    slowdowns: tuple[Slowdown, ...] = ()
    failures: tuple[Failure, ...] = ()
    joins: tuple[Join, ...] = ()
    network: Network = field(default_factory=Network)
    service: Service = field(default_factory=Service)
    model_bytes: int | None = None
    restart_delay: float = 1.0
    contention: Contention | None = None

    def __post_init__(self) -> None:
        kinds = {"compute": (Fixed, ShiftedExponential), "network": Network, "service": Service}
        for name, kind in kinds.items():
            if not isinstance(getattr(self, name), kind):
                raise _bad("SimConfig", name, getattr(self, name), f"must be a {_names(kind)}")
        if self.contention is not None and not isinstance(self.contention, Contention):
            raise _bad("SimConfig", "contention", self.contention, "must be None or a Contention")
        if self.stragglers is not None and not isinstance(self.stragglers, Stragglers):
            raise _bad("SimConfig", "stragglers", self.stragglers, "must be None or a Stragglers")
        if self.speeds is not None:
            speeds = _tuple(self, "speeds")
            for i, s in enumerate(speeds):
                _factor("SimConfig", f"speeds[{i}]", s)
        for name, kind in TOML_LISTS.items():
            for i, item in enumerate(_tuple(self, name)):
                if not isinstance(item, kind):
                    raise _bad("SimConfig", f"{name}[{i}]", item, f"must be a {kind.__name__}")
        mb = self.model_bytes
        bad_int = not isinstance(mb, int | np.integer) or isinstance(mb, bool)
        if mb is not None and (bad_int or mb <= 0):
            raise _bad("SimConfig", "model_bytes", mb, "must be None or an integer > 0")
        if mb is not None and mb > MAX_MODEL_BYTES:
            raise _bad(
                "SimConfig", "model_bytes", mb, f"must be <= {MAX_MODEL_BYTES:g} (a petabyte)"
            )
        _seconds("SimConfig", "restart_delay", self.restart_delay)

    def check_workers(self, workers: int) -> None:
        """Checks the fields that depend on the number of workers of a run."""
        if self.speeds is not None and len(self.speeds) != workers:
            need = f"needs one speed per worker ({workers})"
            raise _bad("SimConfig", "speeds", self.speeds, need)
        if self.stragglers is not None and self.stragglers.count > workers:
            need = f"is more than the {workers} workers"
            raise _bad("SimConfig", "stragglers.count", self.stragglers.count, need)
        for name in TOML_LISTS:
            for i, item in enumerate(getattr(self, name)):
                if item.worker >= workers:
                    need = f"not a worker of this run (0..{workers - 1})"
                    raise _bad("SimConfig", f"{name}[{i}].worker", item.worker, need)

    def absent_at_start(self) -> set[int]:
        """The workers whose first failure-or-join event is a join: they start absent."""
        first: dict[int, tuple[float, int]] = {}
        for kind, items in ((0, self.failures), (1, self.joins)):
            for e in items:
                if e.worker not in first or (e.time, kind) < first[e.worker]:
                    first[e.worker] = (e.time, kind)
        return {w for w, (_, kind) in first.items() if kind == 1}

    @classmethod
    def from_dict(cls, table: Mapping[str, Any], where: str = "sim") -> SimConfig:
        """Builds a config from a flat table, as a TOML ``[sim]`` table spells it.

        Keys: ``compute`` ("fixed" | "exponential"), ``step_time`` (fixed),
        ``shift`` and ``rate`` (exponential), ``speeds`` (list), ``stragglers``
        ({count, slowdown}), ``slowdowns`` (list of {worker, factor, start, end}),
        ``failures`` and ``joins`` (lists of {worker, time}), ``latency``,
        ``bandwidth``, ``worker_bandwidth``, ``shard_bandwidth``,
        ``service_time``, ``service_rate``, ``model_bytes``, ``restart_delay``,
        ``contention_step`` and ``contention_apply`` (lists of factors, both or neither).

        Raises:
            SimConfigError: naming the bad field and value (``sim: ShiftedExponential.rate =
                -1: ...``); a ValueError for an unknown key or a missing field.

        Example:
            >>> cfg = SimConfig.from_dict({"compute": "fixed", "step_time": 0.5,
            ...                            "failures": [{"worker": 1, "time": 3.0}]})
            >>> cfg.compute, cfg.failures[0].time
            (Fixed(time=0.5), 3.0)
        """
        for key in table:
            if key not in TOML_KEYS:
                known = ", ".join(sorted(TOML_KEYS))
                raise ValueError(f"{where}.{key}: unknown option (known: {known})")
        t = dict(table)
        try:
            return cls(
                compute=_compute_from(t),
                speeds=tuple(t["speeds"]) if "speeds" in t else None,
                stragglers=Stragglers(**t["stragglers"]) if "stragglers" in t else None,
                **{k: tuple(kind(**d) for d in t.get(k, ())) for k, kind in TOML_LISTS.items()},
                network=Network(**{k: t[n] for n, k in _NET_KEYS.items() if n in t}),
                service=Service(**{k: t[n] for n, k in _SERVICE_KEYS.items() if n in t}),
                model_bytes=t.get("model_bytes"),
                restart_delay=t.get("restart_delay", 1.0),
                contention=_contention_from(t),
            )
        except SimConfigError as e:
            raise SimConfigError(e.owner, e.key, e.value, e.need, where) from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None


_NET_KEYS = {k: k for k in ("latency", "bandwidth", "worker_bandwidth", "shard_bandwidth")}
_SERVICE_KEYS = {"service_time": "time", "service_rate": "rate"}
#: The [sim] keys that are lists of tables, and the model each table makes.
TOML_LISTS = {"slowdowns": Slowdown, "failures": Failure, "joins": Join}
_OTHER_KEYS = ("compute", "step_time", "shift", "rate", "speeds", "stragglers")
_CONTENTION_KEYS = ("contention_step", "contention_apply")
#: Every key of a TOML [sim] table.
TOML_KEYS = frozenset(
    (*_OTHER_KEYS, *TOML_LISTS, "restart_delay", "model_bytes", *_NET_KEYS, *_SERVICE_KEYS,
     *_CONTENTION_KEYS)
)  # fmt: skip


def _contention_from(t: dict) -> Contention | None:
    have = [k for k in _CONTENTION_KEYS if k in t]
    if not have:
        return None
    if len(have) == 1:
        raise ValueError(f"{have[0]} needs {set(_CONTENTION_KEYS).difference(have).pop()} too")
    return Contention(step=t["contention_step"], apply=t["contention_apply"])


def _compute_from(t: dict) -> Fixed | ShiftedExponential:
    kind = t.get("compute", "exponential")
    if kind == "fixed":
        if "shift" in t or "rate" in t:
            raise ValueError("shift and rate belong to compute = 'exponential'")
        return Fixed(**({"time": t["step_time"]} if "step_time" in t else {}))
    if kind == "exponential":
        if "step_time" in t:
            raise ValueError("step_time belongs to compute = 'fixed' (exponential: shift + 1/rate)")
        return ShiftedExponential(**{k: t[k] for k in ("shift", "rate") if k in t})
    raise SimConfigError("", "compute", kind, "known models are 'fixed' and 'exponential'")


def _names(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _tuple(cfg: SimConfig, name: str) -> tuple:
    value = getattr(cfg, name)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise _bad("SimConfig", name, value, "must be a sequence")
    value = tuple(value)
    object.__setattr__(cfg, name, value)  # lists become tuples: the config stays hashable
    return value
