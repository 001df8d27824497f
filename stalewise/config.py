"""Job configuration files (TOML) for ``stalewise train``.

A config has four tables; every key is checked, and a bad one is reported with
its full name (``optimizer.b3: unknown option``)::

    [task]                        # what to train
    name = "digits"               # a built-in task (stalewise.tasks.names()) ...
    # factory = "mypkg.jobs:make" # ... or a module:function returning a task object
    args = { hidden = 64 }        # keyword arguments for the task
    seed = 0

    [optimizer]                   # the server optimizer (stalewise.optim)
    name = "lamb"
    lr = 0.01                     # or: schedule = { name = "warmup_cosine", peak = 0.01, warmup = 50, total = 2000 }
    weight_decay = 0.0            # any other option of that optimizer

    [server]
    consistency = "ssp"           # asp | ssp | bsp
    bound = 4                     # ssp only
    staleness = "inverse"         # constant | inverse | exponential | polynomial
    max_staleness = 16            # optional
    dc_lambda = 0.0               # DC-ASGD delay compensation (0: off)
    shards = 2

    [run]
    workers = 4
    steps = 2000                  # pushes in all
    delay = 0.005                 # emulated compute seconds per step, every worker
    stragglers = { 3 = 4.0 }      # worker -> slowdown factor
    eval_interval = 0.5
    stop_at = { accuracy = 0.95 } # a loss stops at <= (stalewise.targets); or { x = [0.9, "max"] }
    runtime = "local"             # or "sim" (the simulator; see the [sim] table)

    [sim]                         # the simulator's timing/network model (stalewise.runtime.sim.config)
    compute = "exponential"       # fixed | exponential (shifted)
    latency = 0.0005              # seconds per message
    bandwidth = 1.25e9            # bytes/s of every link

A task object needs ``init_params(seed)``, ``loss_and_grad(params, batch)``,
``batches(worker, workers, seed)`` and ``evaluate(params)`` (see stalewise.tasks).
"""

from __future__ import annotations

import importlib
import inspect
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalewise import consistency as consistency_lib
from stalewise import optim, targets, tasks
from stalewise import staleness as staleness_lib
from stalewise.api import RUNTIMES, Job
from stalewise.runtime.base import slowdowns
from stalewise.runtime.sim.config import SimConfig

TABLES = {
    "task": {"name", "factory", "args", "seed"},
    "optimizer": None,  # checked against the chosen optimizer's signature
    "server": {
        "consistency",
        "bound",
        "staleness",
        "staleness_param",
        "max_staleness",
        "dc_lambda",
        "shards",
    },
    "run": {"workers", "steps", "delay", "stragglers", "eval_interval", "stop_at", "runtime"},
    "sim": None,  # checked by SimConfig.from_dict
}
OPTIMIZERS = ("sgd", "adam", "adamw", "lamb", "lars")
SCHEDULES = ("constant", "warmup_cosine", "step_decay")


class ConfigError(ValueError):
    """A config file or table has a bad key or value; the message names it."""


@dataclass
class RunConfig:
    """A parsed config: what ``stalewise train`` needs to run."""

    task: Any
    job: Job
    train: dict[str, Any] = field(default_factory=dict)  # keyword arguments of Job.train
    seed: int = 0
    sim: SimConfig | None = None  # the [sim] table: used when the runtime is "sim"
    delay: float = 0.0  # run.delay: emulated compute seconds per step, every worker

    def train_kwargs(self, runtime: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``job.train``, for the config's runtime or ``runtime``."""
        kwargs = dict(self.train)
        if runtime:
            if runtime not in RUNTIMES:
                raise ConfigError(
                    f"runtime: unknown runtime {runtime!r} (known: {', '.join(RUNTIMES)})"
                )
            kwargs["runtime"] = runtime
        if kwargs["runtime"] == "sim":
            kwargs |= {"sim": self.sim, "seed": self.seed}
        return kwargs


def load(path: str | Path) -> RunConfig:
    """Reads and checks a TOML config file."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    try:
        return parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def parse(raw: dict[str, Any]) -> RunConfig:
    """Checks a config already read into a dict and builds the task and the job."""
    for key in raw:
        if key not in TABLES:
            raise ConfigError(f"{key}: unknown table (known: {', '.join(TABLES)})")
    for name, allowed in TABLES.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{name}: must be a table, got {table!r}")
        for key in table if allowed is not None else ():
            if key not in allowed:
                raise ConfigError(
                    f"{name}.{key}: unknown option (known: {', '.join(sorted(allowed))})"
                )
    t, o, s, r, sim = (raw.get(k, {}) for k in TABLES)
    seed = _get(t, "task.seed", int, 0)
    task = _task(t)
    job = Job(
        task.init_params(seed),
        optimizer=_optimizer(o),
        consistency=_consistency(s),
        staleness=_staleness(s),
        shards=_get(s, "server.shards", int, 1, low=1),
    )
    stragglers = {}
    for w, f in r.get("stragglers", {}).items():
        try:
            stragglers[int(w)] = float(f)
        except (TypeError, ValueError):
            raise ConfigError(
                f"run.stragglers.{w}: need a worker id and a number, got {f!r}"
            ) from None
    workers = _get(r, "run.workers", int, 4, low=1)
    try:
        slowdowns(stragglers, workers)
    except ValueError as e:
        raise ConfigError(f"run.{e}") from None
    delay = _get(r, "run.delay", float, 0.0, low=0)
    train = {
        "workers": workers,
        "steps": _get(r, "run.steps", int, 1000, low=1),
        "runtime": _get(r, "run.runtime", str, "local"),
        "eval_interval": _get(r, "run.eval_interval", float, 0.5, low=0),
        "stragglers": stragglers,
        "delays": dict.fromkeys(range(workers), delay) if delay else None,
        "stop_at": _stop_at(r.get("stop_at")),
    }
    try:
        sim_config = SimConfig.from_dict(sim)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if train["runtime"] not in RUNTIMES:
        raise ConfigError(
            f"run.runtime: unknown runtime {train['runtime']!r} (known: {', '.join(RUNTIMES)})"
        )
    return RunConfig(task, job, train, seed, sim_config, delay)


def _get(table: dict, name: str, kind: type, default: Any, low: float | None = None) -> Any:
    value = table.get(name.split(".")[-1], default)
    ok_types = (int, float) if kind is float else (kind,)
    if not isinstance(value, ok_types) or isinstance(value, bool):
        raise ConfigError(f"{name}: expected {kind.__name__}, got {value!r}")
    if low is not None and value < low:
        raise ConfigError(f"{name}: must be >= {low}, got {value!r}")
    return kind(value)


def _stop_at(spec: Any) -> tuple[targets.Target, ...] | None:
    """run.stop_at as Targets (None if absent or empty); a bad entry names its key."""
    try:
        return targets.parse(spec, where="run.stop_at") or None
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def _task(t: dict) -> Any:
    args = t.get("args", {})
    if not isinstance(args, dict):
        raise ConfigError(f"task.args: must be a table, got {args!r}")
    if ("name" in t) == ("factory" in t):
        raise ConfigError(
            "task: give exactly one of task.name (built-in) or task.factory (module:function)"
        )
    if "name" in t:
        try:
            return tasks.get(t["name"], **args)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"task.name: {e}") from None
    target = t["factory"]
    module, _, func = str(target).partition(":")
    if not module or not func:
        raise ConfigError(f"task.factory: expected 'module:function', got {target!r}")
    try:
        factory = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"task.factory: cannot load {target!r}: {e}") from None
    task = factory(**args)
    missing = [
        m for m in ("init_params", "loss_and_grad", "batches", "evaluate") if not hasattr(task, m)
    ]
    if missing:
        raise ConfigError(f"task.factory: {target} returned an object without {', '.join(missing)}")
    return task


def _schedule(spec: Any) -> Any:
    if not isinstance(spec, dict) or "name" not in spec:
        raise ConfigError(f"optimizer.schedule: expected a table with a name, got {spec!r}")
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    if spec["name"] not in SCHEDULES:
        raise ConfigError(
            f"optimizer.schedule.name: unknown schedule {spec['name']!r} (known: {', '.join(SCHEDULES)})"
        )
    return _call(getattr(optim, spec["name"]), kwargs, "optimizer.schedule")


def _optimizer(o: dict) -> Any:
    name = o.get("name", "sgd")
    if name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer.name: unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})"
        )
    kwargs = {k: v for k, v in o.items() if k not in ("name", "schedule")}
    if "schedule" in o:
        if "lr" in o:
            raise ConfigError("optimizer: give optimizer.lr or optimizer.schedule, not both")
        kwargs["lr"] = _schedule(o["schedule"])
    for key in ("exclude_from_weight_decay", "exclude_from_adaptation"):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key])
    return _call(getattr(optim, name), kwargs, "optimizer")


def _call(fn: Any, kwargs: dict, where: str) -> Any:
    params = inspect.signature(fn).parameters
    for key in kwargs:
        if key not in params:
            raise ConfigError(
                f"{where}.{key}: unknown option for {fn.__name__} (known: {', '.join(params)})"
            )
    try:
        return fn(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _consistency(s: dict) -> consistency_lib.Consistency:
    try:
        return consistency_lib.from_name(s.get("consistency", "asp"), s.get("bound"))
    except ValueError as e:
        raise ConfigError(f"server.consistency: {e}") from None


def _staleness(s: dict) -> staleness_lib.Staleness:
    kwargs = {k: s[k] for k in ("max_staleness", "dc_lambda") if k in s}
    name = s.get("staleness", "constant")
    if "staleness_param" in s:
        kwargs[{"exponential": "base", "polynomial": "power"}.get(name, "staleness_param")] = s[
            "staleness_param"
        ]
    try:
        return staleness_lib.from_name(name, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"server.staleness: {e}") from None
