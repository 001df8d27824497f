"""The simulator's configuration: :class:`SimConfig`, the models of
:mod:`stalewise.runtime.sim.models` in one frozen, hashable value, and its TOML ``[sim]`` table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from stalewise.runtime.sim.models import (
    Contention,
    Copies,
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
    _number,
    _seconds,
)

__all__ = ["MAX_RECORDS", "TOML_KEYS", "SimConfig", "SimConfigError", "TooLongError"]

#: The most records (one every ``eval_interval`` virtual seconds) a simulated run may make:
#: a few kB each, about 14 virtual hours at 0.5 s; past it, :class:`TooLongError`.
MAX_RECORDS = 100_000
MAX_MODEL_BYTES = 10**15  #: The largest ``model_bytes``: a petabyte.


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
    """How the simulator times a run (docs/calibrate.md); gradients are real.

    Attributes:
        compute: :class:`Fixed` or :class:`ShiftedExponential` (default: 8 ms + Exp, mean 2 ms).
        speeds: optional per-worker speed (step time is divided by it), one per worker.
        stragglers, slowdowns, failures, joins, network, service, contention: the models of
            :mod:`~stalewise.runtime.sim.models` (no contention by default).
        restart_delay: virtual seconds a restarted worker takes to come back (default 1).
        loop: the worker loop's own seconds per push besides compute, delays and transfers (0).
        own_read: the chance a lone worker's snapshot read right after its push holds it (None: 0).
        copies: what copying the parameters' bytes costs on the cores (:class:`Copies`;
            None, the default: only the links and the shard's ``service`` charge bytes).
        model_bytes: the parameter bytes to time on the wire and at the shards (timing only).

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
    loop: float = 0.0
    own_read: float | None = None
    copies: Copies | None = None

    def __post_init__(self) -> None:
        kinds = {"compute": (Fixed, ShiftedExponential), "network": Network, "service": Service}
        for name, kind in {**kinds, **_OPTIONAL, "stragglers": Stragglers}.items():
            value, kind = getattr(self, name), kind if isinstance(kind, tuple) else (kind,)
            if not isinstance(value, kind) and (name in kinds or value is not None):
                need = "a" if name in kinds else "None or a"
                need += " " + " or ".join(k.__name__ for k in kind)
                raise _bad("SimConfig", name, value, f"must be {need}")
        if self.speeds is not None:
            for i, s in enumerate(_tuple(self, "speeds")):
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
        _seconds("SimConfig", "loop", self.loop)
        if self.own_read is not None:
            _number("SimConfig", "own_read", self.own_read, high=1.0)

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

        Its keys (:data:`TOML_KEYS`) are SimConfig's fields, with the models' fields spelled
        flat (:data:`_FLAT`: ``step_time``, ``contention_wake``, ``copy_rate``, ...).
        SimConfigError names the bad field and value, with its key as ``path``.

        Example:
            >>> cfg = SimConfig.from_dict({"compute": "fixed", "step_time": 0.5,
            ...                            "failures": [{"worker": 1, "time": 3.0}]})
            >>> cfg.compute, cfg.failures[0].time
            (Fixed(time=0.5), 3.0)
        """
        t = dict(table)
        for key in t:
            if key not in TOML_KEYS:
                known = ", ".join(sorted(TOML_KEYS))
                raise SimConfigError("", key, ..., f"unknown option (known: {known})", where)
        kind = t.pop("compute", "exponential")
        if not isinstance(kind, str) or kind not in _COMPUTE:
            need = "known models are 'fixed' and 'exponential'"
            raise SimConfigError("", "compute", kind, need, where)
        if ("contention_step" in t) != ("contention_apply" in t):
            have, need = sorted(("contention_step", "contention_apply"), key=lambda k: k not in t)
            raise SimConfigError("", "", ..., f"{have} needs {need} too", where)
        copy = sorted(k for k in t if k.startswith("copy_"))
        if copy and "copy_rate" not in t:
            raise SimConfigError("", "", ..., f"{copy[0]} needs copy_rate too", where)
        models = {"compute": _COMPUTE[kind][0], "network": Network, "service": Service, **_OPTIONAL}
        flat: dict[str, dict] = {name: {} for name in models}
        for key, (name, f) in _FLAT.items():
            if key in t and f not in _field_names(models[name]):
                raise SimConfigError("", key, ..., _COMPUTE[kind][1], where)
            if key in t:
                flat[name][f] = t.pop(key)
        for name, kwargs in flat.items():
            if kwargs or name not in _OPTIONAL:  # an optional model: its keys or None
                keys = {f: k for k, (n, f) in _FLAT.items() if n == name}
                t[name] = _make(models[name], kwargs, where, keys.get)
        for key, model in TOML_LISTS.items():
            if not isinstance(t.get(key, ()), list | tuple):
                need = f"expected a list of tables ({', '.join(_field_names(model))})"
                raise SimConfigError("", key, t[key], need, where)
            t[key] = tuple(
                _table(model, d, f"{key}[{i}]", where) for i, d in enumerate(t.get(key, ()))
            )
        if "stragglers" in t:
            t["stragglers"] = _table(Stragglers, t["stragglers"], "stragglers", where)
        return _make(cls, t, where, str)


#: The [sim] keys that are lists of tables, and the model each table makes.
TOML_LISTS = {"slowdowns": Slowdown, "failures": Failure, "joins": Join}
#: The [sim] keys of a model's field, spelled flat: key -> (SimConfig's field, the model's).
_FLAT = {
    "step_time": ("compute", "time"),
    **{k: ("compute", k) for k in ("shift", "rate")},
    **{f.name: ("network", f.name) for f in fields(Network)},
    **{f"service_{f.name}": ("service", f.name) for f in fields(Service)},
    **{f"contention_{f.name}": ("contention", f.name) for f in fields(Contention)},
    **{f"copy_{f.name}": ("copies", f.name) for f in fields(Copies)},
}
#: The models a [sim] table may leave out (None): their flat keys make them.
_OPTIONAL = {"contention": Contention, "copies": Copies}
#: Every key of a TOML [sim] table: SimConfig's fields, with its models' fields spelled flat.
TOML_KEYS = frozenset(
    {f.name for f in fields(SimConfig)} - {"network", "service", *_OPTIONAL} | set(_FLAT)
)
#: compute = "fixed" | "exponential": the model, and what a key of the other one is told.
_COMPUTE = {
    "fixed": (Fixed, "shift and rate belong to compute = 'exponential'"),
    "exponential": (
        ShiftedExponential,
        "step_time belongs to compute = 'fixed' (exponential: shift + 1/rate)",
    ),
}


def _field_names(model: Any) -> list[str]:
    return [f.name for f in fields(model)]


def _make(model: Any, kwargs: dict, where: str, path: Any) -> Any:
    """``model(**kwargs)``; an error's ``path`` is ``path(field)``, its key in the [sim] table."""
    try:
        return model(**kwargs)
    except SimConfigError as e:
        key = path(e.key.partition("[")[0])
        raise SimConfigError(e.owner, e.key, e.value, e.need, where, key) from None


def _table(model: Any, value: Any, path: str, where: str) -> Any:
    """The table at ``path`` (``stragglers``, ``failures[0]``) as a ``model``."""
    known = ", ".join(_field_names(model))
    if not isinstance(value, Mapping):
        raise SimConfigError("", path, value, f"expected a table ({known})", where)
    for k in value:
        if k not in _field_names(model):
            raise SimConfigError("", f"{path}.{k}", ..., f"unknown option (known: {known})", where)
    try:
        return _make(model, dict(value), where, f"{path}.{{}}".format)
    except TypeError as e:  # a field missing
        raise SimConfigError("", path, ..., str(e), where) from None


def _tuple(cfg: SimConfig, name: str) -> tuple:
    value = getattr(cfg, name)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise _bad("SimConfig", name, value, "must be a sequence")
    value = tuple(value)
    object.__setattr__(cfg, name, value)  # lists become tuples: the config stays hashable
    return value
