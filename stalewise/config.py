"""Job configuration files (TOML) for ``stalewise train`` and ``stalewise sim``.

A config has six tables; every key and value is checked before anything runs,
and a bad one is reported with its full name and what was expected
(``optimizer.b3: unknown option for adam``, ``optimizer.lr: expected a number,
got '0.01'``)::

    [task]                        # what to train
    name = "digits"               # a built-in task (stalewise.tasks.names()) ...
    # factory = "mytask:make"     # ... or a module:function returning a task object
    args = { hidden = 64 }        # keyword arguments for the task (checked against its signature)
    seed = 0                      # passed to init_params(seed) and batches(worker, workers, seed)

    [optimizer]                   # the server optimizer (stalewise.optim); optional with a [strategy]
    name = "lamb"                 # sgd | adam | adamw | lamb | lars  # that recommends one
    lr = 0.01                     # or: schedule = { name = "warmup_cosine", peak = 0.01, warmup = 50, total = 2000 }
    weight_decay = 0.0            # any other option of that optimizer

    [strategy]                    # what workers push (stalewise.strategies); default: gradients
    name = "diloco"               # gradients | local_sgd | diloco | easgd | adaptive
    local_steps = 20              # any option of that constructor (see below): H
    inner = { name = "adamw", lr = 0.003 }  # the worker's optimizer: a table like [optimizer]

    [server]
    consistency = "ssp"           # asp | ssp | bsp | hybrid
    bound = 4                     # ssp only
    tolerance = 2.0               # hybrid only: a straggler is this many times the median's pace
    staleness = "inverse"         # constant | inverse | exponential | polynomial
    staleness_param = 0.5         # exponential (base) and polynomial (power) only
    max_staleness = 16            # optional: an integer >= 0 (versions)
    dc_lambda = 0.0               # DC-ASGD delay compensation (0: off)
    shards = 2                    # 1 .. min(1024, number of parameters)
    codec = "topk:0.01"           # none | fp16 | bf16 | int8 | sign | topk:F, or a table (stalewise.codecs)
    pull_codec = "int8"           # delta pulls (runtime "sim"): a codec as above; default "full"

    [run]                         # defaults and checks: stalewise.RunOptions (Job.train's)
    workers = 4                   # 1 .. 4096 local processes (16384 simulated)
    steps = 2000                  # pushes in all, 1 .. 10**9
    delay = 0.005                 # emulated compute seconds per step, every worker
    stragglers = { 3 = 4.0 }      # worker -> slowdown factor (1 .. 10000)
    eval_interval = 0.5           # seconds between evaluations (>= 0.001)
    stop_at = { accuracy = 0.95 } # a loss stops at <= (stalewise.targets); or { x = [0.9, "max"] }
    runtime = "local"             # or "sim" (the simulator; see the [sim] table), or "ray"
    address = "auto"              # runtime "ray": the cluster (stalewise.runtime.ray.connect)
    on_worker_failure = "restart" # restart | drop | fail: a worker that dies, hangs or raises
    max_restarts = 3              # restarts allowed per worker id (and per shard; false: no limit)
    worker_timeout = 60           # seconds without a heartbeat: hung (>= 0.1; false: never)
    diverge_after = 20            # pushes in a row refused as NaN/Inf: diverged (false: never)

    [sim]                         # the simulator's timing/network model (stalewise.runtime.sim.config)
    compute = "exponential"       # fixed | exponential (shifted)
    latency = 0.0005              # seconds per message (times: 0 .. 1e7 virtual seconds)
    bandwidth = 1.25e9            # bytes/s of every link (rates: >= 1, or inf)

The [strategy] table
--------------------
``name`` picks a constructor of :mod:`stalewise.strategies`; every other key is
one of its keyword arguments, checked against its signature and by the
constructor itself (``strategy.local_steps: must be an integer >= 1, got 0``):

=============  ===========================================================================
``gradients``  (no options) one gradient per push, the default
``local_sgd``  ``local_steps``, ``inner`` (required), ``reset_inner``, ``dynamic``, ``period``
``diloco``     ``local_steps``, ``inner`` (default adamw lr 1e-3), ``outer_lr``,
               ``outer_momentum``, ``asynchronous``, ``every``, ``reset_inner``, ``dynamic``,
               ``period``
``easgd``      ``alpha``, ``local_steps``, ``inner`` (all required), ``reset_inner``
``adaptive``   ``inner``, ``local_steps``, ``min_steps``, ``outer`` (``"local_sgd"`` or
               ``"diloco"``), ``smoothing``, ``reset_inner``, ``outer_lr``,
               ``outer_momentum``, ``asynchronous``, ``every``, ``schedule``
=============  ===========================================================================

``streaming_diloco`` takes ``diloco``'s options but ``reset_inner``, ``dynamic`` and
``period``, and ``fragments`` (a count, or a list of leaf-name patterns), ``offsets``,
``delay`` and ``alpha``.

``local_steps`` is ``H``, the local steps per push, in every strategy;
``every`` is only delayed Nesterov's ``N`` (asynchronous DiLoCo), ``period``
only seconds (``dynamic``). The old keys ``steps`` (``local_sgd``, ``diloco``,
``fixed``), ``every`` (``easgd``) and ``start`` (``adaptive``, ``comm_budget``,
``adacomm``) still work for one release, with a DeprecationWarning naming the new key.

``inner`` is a table built exactly like ``[optimizer]`` (``name``, ``lr`` or
``schedule``, any option of that optimizer); its errors name
``strategy.inner.lr`` and so on. ``schedule`` (``adaptive`` only) is
``{ name = "adacomm", local_steps = 32, min_steps = 1 }`` or ``{ name = "fixed", local_steps = 8 }``.

Without an ``[optimizer]`` table the job uses the strategy's recommended server
optimizer (``sgd(1.0)`` for local SGD and EASGD, Nesterov ``sgd(0.7,
momentum=0.9)`` for DiLoCo; with ``asynchronous = true`` delayed Nesterov with
``every`` or, if not given, ``run.workers``); an ``[optimizer]`` table
overrides it. ``gradients`` recommends none, so it needs an ``[optimizer]``.
``stalewise sim CONFIG --over strategy --values gradients,local_sgd:8,diloco:20``
compares strategies: see :meth:`RunConfig.sweep_strategy`.

The task contract
-----------------
A task object (built-in, or returned by the factory) needs four methods:

* ``init_params(seed)``: the initial parameters (any pytree stalewise.tree takes);
* ``loss_and_grad(params, batch) -> (loss, grads)``;
* ``batches(worker, workers, seed)``: an iterator over ``worker``'s minibatches
  (of ``workers`` in all), shuffled by ``seed``. stalewise always calls it with
  the three arguments, ``seed`` being the config's ``[task] seed`` (see
  :func:`stalewise.tasks.with_seed`); the built-in tasks default ``seed`` to 0 so
  that ``data=task.batches`` also works in ``Job.train``, which calls
  ``data(worker, workers)``;
* ``evaluate(params) -> {"loss": ..., ...}``: held-out metrics.

Their signatures are checked when the config is loaded, ``batches`` is asked
for one batch of the last worker and, if ``run.stop_at`` is given, ``evaluate``
is run once to check that the metrics exist. The task and its methods must be
picklable (module-level classes and functions): the local runtime sends them
to worker processes.

A factory runs code
-------------------
``factory = "mytask:make"`` imports the module ``mytask`` and calls ``make(**args)``:
loading a config with a factory runs that module's code, with your rights, as
running a training script would. Load only configs you would run as scripts.

The module is looked up first in the config file's folder, then in the current
working directory, then on ``sys.path`` (installed packages). A folder it was
found in is put on ``sys.path`` only while the module is imported, and again,
together with ``PYTHONPATH``, while :meth:`RunConfig.run` (``stalewise train``)
or ``stalewise sim`` runs the job (see :meth:`RunConfig.importable`), so that
the worker processes of the local runtime can import the task by module name;
both are restored afterwards. If you pass the task's functions to ``Job.train``
yourself, do it inside ``with cfg.importable():``.

Limits
------
Absurd sizes are refused before anything is allocated: at most
:func:`max_workers` workers (4096 local processes, 16384 simulated workers),
:data:`MAX_SHARDS` shards (and no more than parameters), :data:`MAX_STEPS`
steps, and delays of at most :data:`MAX_DELAY` seconds per step. Times and rates
are bounded so that no run can be endless: ``eval_interval`` at least 1 ms,
``worker_timeout`` at least 0.1 s, straggler factors at most 10000, and in the
[sim] table virtual times (steps, latency, service, restarts, scripted events)
of at most 1e7 s, bandwidths and service rates of at least 1 byte/s (see
:mod:`stalewise.runtime.sim.models`); a simulated run that would still record
more than :data:`~stalewise.runtime.sim.config.MAX_RECORDS` times stops with a
``sim`` (or ``run.eval_interval``) error. Arrays and tables nest at most
:data:`MAX_DEPTH` levels.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import math
import os
import re
import sys
import tomllib
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from stalewise import codecs, optim, targets, tasks, tree
from stalewise import consistency as consistency_lib
from stalewise import runtime as runtime_lib
from stalewise import staleness as staleness_lib
from stalewise import strategies as strategies_lib
from stalewise.api import Job
from stalewise.options import Emulation, Failures, Metrics, Simulation
from stalewise.runtime.base import MAX_DELAY, MAX_SLOWDOWN, TrainResult
from stalewise.runtime.options import DEFAULTS, OptionError, RunOptions
from stalewise.runtime.sim.config import TOML_KEYS as _SIM_KEYS
from stalewise.runtime.sim.config import TOML_LISTS as _SIM_LISTS
from stalewise.runtime.sim.config import SimConfig, TooLongError
from stalewise.runtime.sim.models import SimConfigError, Stragglers

TABLES = {
    "task": {"name", "factory", "args", "seed"},
    "optimizer": None,  # checked against the chosen optimizer's signature
    "server": {
        "consistency",
        "bound",
        "tolerance",
        "staleness",
        "staleness_param",
        "max_staleness",
        "dc_lambda",
        "shards",
        "codec",
        "pull_codec",
    },
    "run": {
        "workers",
        "steps",
        "delay",
        "stragglers",
        "eval_interval",
        "stop_at",
        "runtime",
        "address",
        *Failures.FIELDS.values(),  # on_worker_failure, max_restarts, worker_timeout, ...
    },
    "sim": None,  # checked key by key against SimConfig.from_dict
    "strategy": None,  # checked against the chosen strategy's signature
}
OPTIMIZERS = ("sgd", "adam", "adamw", "lamb", "lars")
SCHEDULES = ("constant", "warmup_cosine", "step_decay")
STRATEGIES = ("gradients", "local_sgd", "diloco", "streaming_diloco", "easgd", "adaptive")
PERIOD_SCHEDULES = ("comm_budget", "adacomm", "fixed")  # strategy.schedule of "adaptive"
#: The option a ``NAME:H`` value of ``stalewise sim --over strategy`` sets, per strategy.
PERIOD_KEY = dict.fromkeys(
    ("local_sgd", "diloco", "streaming_diloco", "easgd", "adaptive"), "local_steps"
)
CONSISTENCY = ("asp", "ssp", "bsp", "hybrid")
STALENESS_PARAM = {"exponential": "base", "polynomial": "power"}  # server.staleness_param

#: The most parameter-server shards (and never more than the parameters).
MAX_SHARDS = 1024
#: The most pushes a run may be given.
MAX_STEPS = 10**9
#: The deepest nesting of arrays and tables a config may have.
MAX_DEPTH = 32
#: The task methods a factory's object must have, with the arguments stalewise passes.
TASK_METHODS = {
    "init_params": ("seed",),
    "loss_and_grad": ("params", "batch"),
    "batches": ("worker", "workers", "seed"),
    "evaluate": ("params",),
}


class ConfigError(ValueError):
    """A bad config key or value, or a bad command-line flag.

    Attributes:
        key: what is wrong, as the user spells it: ``run.workers``, ``--values``,
            or the config file for an unreadable file.
        problem: what was expected and what was given.
        path: the config file the key is in (None for flags and file errors).
    """

    def __init__(self, key: str, problem: str, path: str | os.PathLike[str] | None = None):
        self.key, self.problem, self.path = key, problem, path
        super().__init__(key, problem)

    def __str__(self) -> str:
        text = f"{self.key}: {self.problem}"
        return f"{text} (in {self.path})" if self.path is not None else text


def max_workers(runtime: str) -> int:
    """The most workers a run on ``runtime`` may have."""
    return runtime_lib.describe(runtime).max_workers


@dataclass
class RunConfig:
    """A parsed config: what ``stalewise train`` needs to run."""

    task: Any
    job: Job
    train: dict[str, Any] = field(default_factory=dict)  # keyword arguments of Job.train
    seed: int = 0
    sim: SimConfig | None = None  # the [sim] table: used when the runtime is "sim"
    delay: float = 0.0  # run.delay: emulated compute seconds per step, every worker
    paths: tuple[str, ...] = ()  # folders the task factory's module was found in
    _metrics: tuple[str, ...] | None = field(default=None, repr=False)
    optimizer_table: dict[str, Any] = field(default_factory=dict, repr=False)  # [optimizer]
    strategy_table: dict[str, Any] = field(default_factory=dict, repr=False)  # [strategy]
    address: str | None = None  # run.address: the Ray cluster (runtime "ray")
    path: str | None = None  # the config file it was read from (by load)

    @property
    def data(self) -> Callable[[int, int], Any]:
        """The ``data(worker, workers)`` of ``Job.train``: ``task.batches`` with ``seed`` bound."""
        return tasks.with_seed(self.task, self.seed).batches

    def seeded_task(self) -> Any:
        """The task with ``seed`` bound: ``batches(worker, workers)``, e.g. for :func:`stalewise.sweep.sweep`."""
        return tasks.with_seed(self.task, self.seed)

    def train_kwargs(self, runtime: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``job.train``, for the config's runtime or ``runtime`` (a
        name: :meth:`run` makes "sim" ``sw.Simulation`` of the [sim] table and task seed)."""
        kwargs = dict(self.train)
        if runtime:
            if runtime not in runtime_lib.names():
                raise ConfigError(
                    "--runtime",
                    f"unknown runtime {runtime!r} (known: {', '.join(runtime_lib.names())})",
                )
            if runtime != kwargs["runtime"]:
                self.check_workers(kwargs["workers"], runtime, "run.workers")
            kwargs["runtime"] = runtime
        return kwargs

    def check_workers(self, workers: int, runtime: str, key: str) -> None:
        """Checks that a run on ``runtime`` may have ``workers`` workers; errors name ``key``.

        The limit of the runtime, the [sim] table's per-worker settings (runtime
        "sim") and the task's batches for that many workers are checked.
        """
        _check_workers(workers, runtime, key)
        if runtime == "sim" and self.sim is not None:
            _check_sim_workers(self.sim, workers, key)
        _check_batches(self.task, workers, self.seed, key)

    def sweep_strategy(self, value: str, key: str = "--values") -> strategies_lib.Strategy:
        """The strategy of one ``stalewise sim --over strategy`` value, ``NAME`` or ``NAME:H``.

        It takes the options of the config's [strategy] table that ``NAME``'s
        constructor accepts (``inner``, ``reset_inner``, ``alpha``...); ``H``
        sets ``local_steps``. In a sweep each strategy runs with its
        recommended server optimizer; ``gradients``, which recommends none, with
        the [optimizer] table's, which it then requires. Errors name ``key``.
        """
        try:
            name, period = parse_strategy_value(value)
        except ValueError as e:
            raise ConfigError(key, str(e)) from None
        fn = getattr(strategies_lib, name)
        sig = _signature(fn)
        accepted = set(sig.parameters) if sig is not None else set()
        table = _new_keys(fn, self.strategy_table, "strategy")
        table = {k: v for k, v in table.items() if k in accepted}
        if period is not None:
            table[PERIOD_KEY[name]] = period
        try:
            strategy = strategy_from_table({"name": name, **table})
        except ConfigError as e:
            raise ConfigError(key, f"{value!r}: {e.key}: {e.problem}") from None
        assert strategy is not None
        if strategy.server_optimizer(self.train["workers"]) is None and not self.optimizer_table:
            raise ConfigError(
                key,
                f"{value!r} recommends no server optimizer: add an [optimizer] table to the "
                "config (in a strategy sweep, only the strategies that recommend none use it)",
            )
        return strategy

    def metrics(self) -> tuple[str, ...]:
        """The names of the metrics ``task.evaluate`` returns (evaluated once, at the initial parameters)."""
        if self._metrics is None:
            with self.importable():
                self._metrics = _metric_names(self.task, self.task.init_params(self.seed))
        return self._metrics

    @contextlib.contextmanager
    def importable(self) -> Iterator[None]:
        """Within the block, the task factory's module can be imported by name, here and in
        processes started here: its folder is put first on ``sys.path`` and on ``PYTHONPATH``
        (nothing happens if the module came from ``sys.path`` itself). Both are restored after.
        """
        with _on_path(self.paths, env=True):
            yield

    def run(
        self, runtime: str | None = None, *, address: str | None = None, **kwargs: Any
    ) -> TrainResult:
        """Trains the job on the task: ``job.train`` with the config's run settings.

        Args:
            runtime: overrides ``run.runtime``.
            address: overrides ``run.address``: the Ray cluster to connect to first
                (runtime "ray"; see :func:`stalewise.runtime.ray.connect`).
            **kwargs: more keyword arguments of ``Job.train`` (``metrics``, ``checkpoints``,
                ``timeouts``, ...); a group given here replaces the config's.
        """
        train = self.train_kwargs(runtime) | kwargs
        if train["runtime"] == "sim":  # the task's seed also seeds the simulator
            train["runtime"] = Simulation(self.sim, seed=self.seed)
        if train["runtime"] == "ray" and (address or self.address):
            from stalewise.runtime import ray as ray_runtime

            try:
                ray_runtime.connect(address or self.address)
            except ConnectionError as e:
                raise ConfigError("--address" if address else "run.address", str(e)) from None
        with self.importable():
            try:
                return self.job.train(
                    self.task.loss_and_grad,
                    data=self.data,
                    evaluate=self.task.evaluate,
                    **train,
                )
            except TooLongError as e:  # the config's times make the simulated run endless
                key = "sim" if self.sim not in (None, SimConfig()) else "run.eval_interval"
                raise ConfigError(key, str(e), self.path) from None


def load(
    path: str | os.PathLike[str],
    *,
    runtime: str | None = None,
    codec: str | None = None,
    pull_codec: str | None = None,
) -> RunConfig:
    """Reads and checks a TOML config file; a task factory's module may sit next to it.

    ``runtime`` overrides ``run.runtime`` (``stalewise train --runtime``); the
    limits and the [sim] table are checked for it. ``codec`` overrides
    ``server.codec`` (``--codec``), ``pull_codec`` ``server.pull_codec``
    (``--pull-codec``).
    """
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(str(p), "no such config file") from None
    except IsADirectoryError:
        raise ConfigError(str(p), "is a folder, not a config file") from None
    except OSError as e:
        raise ConfigError(str(p), f"cannot read the config file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(str(p), f"not a text file: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(p), f"not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays and tables
        raise ConfigError(
            str(p), f"not a config: its arrays or tables nest more than {MAX_DEPTH} levels deep"
        ) from None
    try:
        cfg = parse(
            raw, base=p.resolve().parent, runtime=runtime, codec=codec, pull_codec=pull_codec
        )
    except ConfigError as e:
        e.path = str(p)
        raise
    cfg.path = str(p)
    return cfg


def parse(
    raw: dict[str, Any],
    *,
    base: str | os.PathLike[str] | None = None,
    runtime: str | None = None,
    codec: str | None = None,
    pull_codec: str | None = None,
) -> RunConfig:
    """Checks a config already read into a dict and builds the task and the job.

    Everything a value can be checked against without the task is checked
    first; then the task is built (running a factory's code), its parameters
    made and the job built.

    Args:
        raw: the config's tables.
        base: the config file's folder, where a task factory's module is looked
            for first (then the current working directory, then ``sys.path``).
        runtime: overrides ``run.runtime``.
        codec: overrides ``server.codec`` (``stalewise train --codec``).
        pull_codec: overrides ``server.pull_codec`` (``--pull-codec``; ``"full"``: off).

    Raises:
        ConfigError: naming the bad key.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError("config", f"expected tables, got {raw!r}")
    _check_depth(raw)
    for key in raw:
        if key not in TABLES:
            raise ConfigError(key, f"unknown table (known: {', '.join(TABLES)})")
    for name, allowed in TABLES.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(name, f"must be a table, got {table!r}")
        for key in table if allowed is not None else ():
            if key not in allowed:
                raise ConfigError(
                    f"{name}.{key}", f"unknown option (known: {', '.join(sorted(allowed))})"
                )
    t, o, s, r, sim_table, st = (raw.get(k, {}) for k in TABLES)

    # 1. everything that needs no task, in the order of the file
    _check_task_table(t)
    seed = _get(t, "task.seed", int, 0, low=0)
    configured = _get(r, "run.runtime", str, "local")
    for key, name in (("run.runtime", configured), ("--runtime", runtime)):
        if name is not None and name not in runtime_lib.names():
            known = ", ".join(runtime_lib.names())
            raise ConfigError(key, f"unknown runtime {name!r} (known: {known})")
        missing = name and runtime_lib.describe(name).missing()
        if missing:
            raise ConfigError(key, missing)
    address = r.get("address")
    if address is not None and not (isinstance(address, str) and address.strip()):
        raise ConfigError("run.address", f"expected an address such as 'auto', got {address!r}")
    if address is not None and configured != "ray":
        raise ConfigError("run.address", f"is for runtime 'ray'; run.runtime is {configured!r}")
    runtime = runtime or configured
    workers = _get(r, "run.workers", int, 4, low=1)
    _check_workers(workers, runtime, "run.workers")
    steps = _get(r, "run.steps", int, 1000, low=1, high=MAX_STEPS)
    delay = _get(r, "run.delay", float, 0.0, low=0, high=MAX_DELAY)
    eval_interval = _run_option(r, "eval_interval")
    stragglers = _stragglers(r.get("stragglers"), workers)
    stop_at = _stop_at(r.get("stop_at"))
    failures = Failures(**{k: _run_option(r, name) for k, name in Failures.FIELDS.items()})
    consistency = _consistency(s)
    staleness = _staleness(s)
    shards = _get(s, "server.shards", int, 1, low=1, high=MAX_SHARDS)
    codec_policy = _codec(s.get("codec", "none"), "server.codec")
    if codec is not None:
        codec_policy = _codec(codec, "--codec")
    pull_key = "--pull-codec" if pull_codec is not None else "server.pull_codec"
    pulls_policy = _pull_codec(s.get("pull_codec") if pull_codec is None else pull_codec, pull_key)
    why = runtime_lib.pull_refusal(pulls_policy, runtime)
    if why is not None:
        raise ConfigError(pull_key, why)
    strategy = strategy_from_table(st)
    optimizer = _server_optimizer(o, "optimizer" in raw, strategy, workers)
    if strategy is not None:
        try:
            strategy.check_consistency(consistency, recommended="optimizer" not in raw)
        except ValueError as e:
            raise ConfigError("server.consistency", str(e)) from None
    sim_config = _sim(sim_table)
    if runtime == "sim":
        _check_sim_workers(sim_config, workers, "run.workers")

    # 2. the task (a factory runs user code), its parameters, the job
    task, paths = _task(t, base)
    with _on_path(paths):
        try:  # a built-in task refuses sizes too large for memory when it is made (above)
            params = task.init_params(seed)
            job = _job(
                params,
                optimizer=optimizer,
                consistency=consistency,
                staleness=staleness,
                shards=shards,
                strategy=strategy,
                codec=codec_policy,
                pull_codec=pulls_policy,
            )
            _check_batches(task, workers, seed, "run.workers")
            metrics = _metric_names(task, params) if stop_at else None
        except MemoryError as e:
            raise ConfigError(
                "task.args" if t.get("args") else "task",
                f"the task's parameters or data do not fit in memory: {e or 'MemoryError'}",
            ) from None
    for target in stop_at or ():
        if target.metric not in metrics and target.metric != "train_loss":
            raise ConfigError(
                f"run.stop_at.{target.metric}",
                f"not a metric of the task (its metrics: {', '.join((*metrics, 'train_loss'))})",
            )
    delays = dict.fromkeys(range(workers), delay) if delay else None
    train = {
        "workers": workers,
        "steps": steps,
        "runtime": runtime,
        "stop_at": stop_at,
        "metrics": Metrics(every=eval_interval),
        "emulation": Emulation(stragglers, delays) if stragglers or delays else None,
        "failures": failures,
    }
    return RunConfig(
        task, job, train, seed, sim_config, delay, paths, metrics, o, st, address=address
    )


# ----------------------------------------------------------------------------- values


def _check_depth(raw: Mapping[str, Any]) -> None:
    """Refuses values nested more than MAX_DEPTH levels (no config needs a tenth of that):
    checking, printing or copying them would recurse past Python's limit."""
    todo: list[tuple[str, Any, int]] = [(str(k), v, 1) for k, v in raw.items()]
    while todo:
        key, value, depth = todo.pop()
        if depth > MAX_DEPTH:
            top = ".".join(key.split("[")[0].split(".")[:2])  # run.stop_at, not its 33 levels
            raise ConfigError(top, f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, Mapping):
            todo.extend((f"{key}.{k}", v, depth + 1) for k, v in value.items())
        elif isinstance(value, list | tuple):
            todo.extend((f"{key}[{i}]", v, depth + 1) for i, v in enumerate(value))


def _describe(kinds: Sequence[str]) -> str:
    return " or ".join(dict.fromkeys(kinds))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _get(
    table: dict,
    name: str,
    kind: type,
    default: Any,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
) -> Any:
    """``table[key]`` (the last part of ``name``) checked: its type, finite, in range."""
    value = table.get(name.split(".")[-1], default)
    ok = {int: _is_int, float: _is_number, str: lambda v: isinstance(v, str)}[kind](value)
    if not ok:
        what = {int: "an integer", float: "a number", str: "a string"}[kind]
        raise ConfigError(name, f"expected {what}, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(name, f"expected a finite number, got {value!r}")
    if low is not None and (value <= low if open_low else value < low):
        raise ConfigError(name, f"must be {'>' if open_low else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ConfigError(name, f"must be <= {high}, got {value!r}")
    return kind(value)


#: [run] keys whose None (never) is spelled ``false`` in TOML, which has no None.
NEVER_IS_FALSE = ("max_restarts", "worker_timeout", "diverge_after")


def _run_option(table: dict, name: str) -> Any:
    """``run.<name>`` (default: :data:`~stalewise.runtime.options.DEFAULTS`'s), checked by
    :meth:`RunOptions.check`, the check ``Job.train`` runs; an error names ``run.<name>``."""
    value = table.get(name, DEFAULTS[name])
    if value is False and name in NEVER_IS_FALSE:
        return None
    try:
        return RunOptions.check(name, value)
    except OptionError as e:
        problem = (
            e.problem.replace(" or None", " or false") if name in NEVER_IS_FALSE else e.problem
        )
        raise ConfigError(f"run.{name}", problem) from None


def _check_workers(workers: int, runtime: str, key: str) -> None:
    limit = max_workers(runtime)
    if workers > limit:
        what = "local worker processes" if runtime == "local" else f"workers on runtime {runtime!r}"
        most = max(runtime_lib.names(), key=max_workers)
        hint = f"; runtime {most!r} takes up to {max_workers(most)}" if most != runtime else ""
        raise ConfigError(key, f"at most {limit} {what}, got {workers}{hint}")


def _stragglers(spec: Any, workers: int) -> dict[int, float]:
    """run.stragglers: a table {worker = slowdown factor}."""
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        example = "{ 3 = 4.0 }"
        if isinstance(spec, list) and all(_is_number(f) for f in spec):
            slow = [f"{w} = {f:g}" for w, f in enumerate(spec) if f != 1]
            example = f"{{ {', '.join(slow)} }} for {spec!r}" if slow else "{ 3 = 4.0 }"
        raise ConfigError(
            "run.stragglers",
            f"expected a table of worker = slowdown factor, such as {example}, got {spec!r}",
        )
    out = {}
    for w, f in spec.items():
        try:
            worker = int(w)
        except ValueError:
            raise ConfigError(
                "run.stragglers", f"expected worker ids (integers) as keys, got {w!r}"
            ) from None
        if not 0 <= worker < workers:
            raise ConfigError(
                "run.stragglers", f"unknown worker {worker} (workers are 0..{workers - 1})"
            )
        if not _is_number(f) or not math.isfinite(f):
            raise ConfigError(
                f"run.stragglers.{w}", f"expected a slowdown factor (a number >= 1), got {f!r}"
            )
        if f < 1:
            raise ConfigError(f"run.stragglers.{w}", f"a slowdown factor must be >= 1, got {f!r}")
        if f > MAX_SLOWDOWN:
            raise ConfigError(
                f"run.stragglers.{w}", f"a slowdown factor must be <= {MAX_SLOWDOWN:g}, got {f!r}"
            )
        out[worker] = float(f)
    return out


def _stop_at(spec: Any) -> tuple[targets.Target, ...] | None:
    """run.stop_at as Targets (None if absent or empty); a bad entry names its key."""
    if spec is not None and not isinstance(spec, dict):
        raise ConfigError(
            "run.stop_at",
            f"expected a table of metric = value to reach such as stop_at = {{ accuracy = 0.95 }}; "
            f"run.stop_at={spec!r} names no metric",
        )
    try:
        found = targets.parse(spec, where="run.stop_at") or None
    except (TypeError, ValueError) as e:
        error = _keyed(str(e), "run.stop_at")
        if "should go down or up" in error.problem:
            error.problem += (
                f' (write {error.key.rpartition(".")[2]} = [value, "min"] or [value, "max"])'
            )
        raise error from None
    return found


def _keyed(message: str, default_key: str) -> ConfigError:
    """A ConfigError from a ``"key: problem"`` message (``default_key`` if it has no key)."""
    key, sep, problem = message.partition(": ")
    if sep and re.fullmatch(r"[\w.\[\]-]+", key) and key.startswith(default_key):
        return ConfigError(key, problem)
    return ConfigError(default_key, message)


# ------------------------------------------------------------------ calling constructors


def _kinds(annotation: Any) -> list[tuple[str, Callable[[Any], bool]]] | None:
    """What a TOML value may be for a parameter annotation: (description, check) pairs.

    None means "not checked" (no annotation, ``Any`` or a type we cannot read);
    an empty list means nothing TOML can spell (a callable, a class) fits.
    """
    if annotation is inspect.Parameter.empty or annotation is Any or isinstance(annotation, str):
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        found: list = []
        for a in args:
            k = _kinds(a)
            if k is None:
                return None
            found += k
        return found
    if origin is typing.Literal:
        return [(f"one of {', '.join(map(repr, args))}", lambda v: v in args)]
    if annotation is bool:
        return [("true or false", lambda v: isinstance(v, bool))]
    if annotation is int:
        return [("an integer", _is_int)]
    if annotation is float:
        return [("a number", _is_number)]
    if annotation is str:
        return [("a string", lambda v: isinstance(v, str))]
    if annotation in (list, tuple) or origin in (list, tuple, Sequence, Iterable):
        inner = [a for a in args if a is not Ellipsis]
        elem = _kinds(typing.Union[tuple(inner)]) if inner else None  # noqa: UP007
        if not elem:
            return [("a list", lambda v: isinstance(v, list))]
        names = _describe([_PLURALS.get(d, "values") for d, _ in elem])

        def each(v: Any) -> bool:
            return isinstance(v, list) and all(any(c(x) for _, c in elem) for x in v)

        pairs = [(f"a list of {names}", each)]
        if str in inner and origin is not list:  # a str is a sequence of str too
            pairs.insert(0, ("a string", lambda v: isinstance(v, str)))
        return pairs
    if annotation is dict or origin in (dict, Mapping, typing.Mapping):
        return [("a table", lambda v: isinstance(v, dict))]
    return []


_PLURALS = {"a string": "strings", "a number": "numbers", "an integer": "integers"}


def _signature(fn: Any) -> inspect.Signature | None:
    for kwargs in ({"eval_str": True}, {}):
        try:
            return inspect.signature(fn, **kwargs)
        except (TypeError, ValueError, NameError, SyntaxError):
            continue
    return None


def _call(
    fn: Any,
    kwargs: dict[str, Any],
    where: str,
    label: str,
    *,
    keys: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
    user_code: bool = False,
) -> Any:
    """Calls ``fn(**kwargs, **extra)`` after checking ``kwargs`` against its signature.

    Unknown, missing and ill-typed keyword arguments are ConfigErrors naming
    ``where.key`` (or ``keys[name]``); so are the ``TypeError``, ``ValueError`` and
    ``OSError`` the call raises, named after the argument the message mentions
    first (else ``where``, or ``task.factory`` for ``user_code``). ``extra``
    arguments are passed unchecked.
    """
    keys = dict(keys or {})
    extra = dict(extra or {})

    def key_of(name: str) -> str:
        return keys.get(name, f"{where}.{name}")

    sig = _signature(fn)
    if sig is not None:
        params = sig.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        named = [
            n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        for key in kwargs:
            if key not in named and not takes_any:
                known = ", ".join(
                    keys.get(n, n).rpartition(".")[2] for n in named if n not in extra
                )
                known = f"known: {known}" if known else "it takes none"
                raise ConfigError(key_of(key), f"unknown option for {label} ({known})")
        missing = [
            n
            for n in named
            if params[n].default is inspect.Parameter.empty and n not in kwargs and n not in extra
        ]
        if missing:
            raise ConfigError(
                key_of(missing[0]), f"missing: {label} needs {', '.join(map(key_of, missing))}"
            )
        for key, value in kwargs.items():
            kinds = _kinds(params[key].annotation) if key in params else None
            if kinds and not any(check(value) for _, check in kinds):
                raise ConfigError(
                    key_of(key), f"expected {_describe([d for d, _ in kinds])}, got {value!r}"
                )
    try:
        return fn(**kwargs, **extra)
    except (TypeError, ValueError, OSError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        message = re.sub(rf"^{re.escape(getattr(fn, '__name__', ''))}(\(\))?: ", "", message)
        mentioned = [
            (m.start(), name)
            for name in kwargs
            if (m := re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message))
        ]
        if user_code:
            message = f"{label} raised {type(e).__name__}: {message}"
        if not mentioned:
            raise ConfigError("task.factory" if user_code else where, message) from None
        name = min(mentioned)[1]
        if not user_code and message.startswith(f"{name} must "):
            message = message[len(name) + 1 :]
        raise ConfigError(key_of(name), message) from None


# --------------------------------------------------------------------------- the tables


def _check_task_table(t: dict) -> None:
    if ("name" in t) == ("factory" in t):
        raise ConfigError(
            "task", "give exactly one of task.name (built-in) or task.factory (module:function)"
        )
    if "name" in t and not isinstance(t["name"], str):
        raise ConfigError("task.name", f"expected a string, got {t['name']!r}")
    if "name" in t and t["name"] not in tasks.names():
        raise ConfigError(
            "task.name", f"unknown task {t['name']!r} (known: {', '.join(tasks.names())})"
        )
    if "factory" in t:
        target = t["factory"]
        module, _, func = target.partition(":") if isinstance(target, str) else ("", "", "")
        dotted = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
        if not (re.fullmatch(dotted, module) and re.fullmatch(dotted, func)):
            raise ConfigError(
                "task.factory", f"expected 'module:function' such as 'mytask:make', got {target!r}"
            )
    if not isinstance(t.get("args", {}), dict):
        raise ConfigError("task.args", f"must be a table, got {t['args']!r}")


def _task(t: dict, base: str | os.PathLike[str] | None) -> tuple[Any, tuple[str, ...]]:
    """Builds the task; returns it and the folders its factory's module was found in."""
    args = t.get("args", {})
    if "name" in t:
        try:
            cls = tasks.task_class(t["name"])
        except ImportError as e:
            raise ConfigError(
                "task.name", f"task {t['name']!r} needs a package that is not installed: {e}"
            ) from None
        return _call(cls, args, "task.args", f"task {t['name']!r}"), ()
    target = t["factory"]
    factory, paths = _load_factory(target, base)
    if not callable(factory):
        raise ConfigError("task.factory", f"{target} is a {type(factory).__name__}, not a function")
    with _on_path(paths):
        task = _call(factory, args, "task.args", target, user_code=True)
    _check_task_object(task, target)
    return task, paths


def _load_factory(target: str, base: str | os.PathLike[str] | None) -> tuple[Any, tuple[str, ...]]:
    module, _, func = target.partition(":")
    top = module.split(".")[0]
    folders = list(dict.fromkeys(str(Path(d).resolve()) for d in (base, os.getcwd()) if d))
    importlib.invalidate_caches()  # the module may have been written after start-up
    found = next(
        (d for d in folders if importlib.machinery.PathFinder.find_spec(top, [d]) is not None),
        None,
    )
    paths = (found,) if found else ()
    loaded = sys.modules.get(top)
    if found and loaded is not None and not _is_under(loaded, found):
        where = getattr(loaded, "__file__", None) or "a built-in module"
        raise ConfigError(
            "task.factory",
            f"cannot load {target!r} from {found}: a module named {top!r} is already "
            f"imported from {where}; rename your module",
        )
    try:
        with _on_path(paths):
            obj = importlib.import_module(module)
    except (ImportError, SyntaxError) as e:
        looked = ", ".join([*folders, "sys.path"])
        raise ConfigError(
            "task.factory", f"cannot load {target!r}: {e} (looked in {looked})"
        ) from None
    for part in func.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                "task.factory", f"cannot load {target!r}: {module} has no {func!r}"
            ) from None
    return obj, paths


def _is_under(module: types.ModuleType, folder: str) -> bool:
    places = [getattr(module, "__file__", None), *getattr(module, "__path__", [])]
    return any(p and Path(p).resolve().is_relative_to(folder) for p in places)


@contextlib.contextmanager
def _on_path(paths: Sequence[str], *, env: bool = False) -> Iterator[None]:
    """Puts ``paths`` first on ``sys.path`` (and ``PYTHONPATH`` if ``env``) within the block."""
    if not paths:
        yield
        return
    added = [p for p in paths if p not in sys.path]
    sys.path[:0] = added
    old = os.environ.get("PYTHONPATH")
    if env:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)
        if env:
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old


def _check_task_object(task: Any, target: str) -> None:
    """A factory's object has the task methods, taking the arguments stalewise passes."""
    missing = [m for m in TASK_METHODS if not callable(getattr(task, m, None))]
    if missing:
        raise ConfigError(
            "task.factory",
            f"{target} returned {type(task).__name__}, without the task method(s) "
            f"{', '.join(missing)} (see stalewise.tasks.Task)",
        )
    for method, arg_names in TASK_METHODS.items():
        sig = _signature(getattr(task, method))
        if sig is None:
            continue
        try:
            sig.bind(*range(len(arg_names)))
        except TypeError as e:
            raise ConfigError(
                "task.factory",
                f"{target} returned a task whose {method}() cannot be called as "
                f"{method}({', '.join(arg_names)}): {e}",
            ) from None


def _check_batches(task: Any, workers: int, seed: int, key: str) -> None:
    """The task gives the last of ``workers`` workers a batch (stalewise's call, with the seed)."""
    w = workers - 1
    try:
        next(iter(task.batches(w, workers, seed)))
        return
    except StopIteration:
        problem = "gave no batches"
    except (TypeError, ValueError) as e:
        problem = f"failed: {e}"
    call = f"task.batches({w}, {workers}, {seed})"
    if workers > 1:
        try:
            next(iter(task.batches(0, 1, seed)))
        except (StopIteration, TypeError, ValueError):
            pass
        else:  # one worker is fine: the count is the problem
            raise ConfigError(key, f"the task cannot feed {workers} workers: {call} {problem}")
    raise ConfigError("task", f"{call} {problem}")


def _metric_names(task: Any, params: Any) -> tuple[str, ...]:
    metrics = task.evaluate(params)
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            "task", f"evaluate(params) must return a dict of metrics, got {type(metrics).__name__}"
        )
    return tuple(metrics)


def _job(params: Any, **kwargs: Any) -> Job:
    try:
        return Job(params, **kwargs)
    except (TypeError, ValueError) as e:
        if str(e).startswith("shards="):
            size = tree.flatten(params)[1].size
            raise ConfigError(
                "server.shards",
                f"must be at most the number of parameters ({size}), got {kwargs['shards']}",
            ) from None
        raise ConfigError(
            "task", f"init_params() gave parameters stalewise cannot use: {e}"
        ) from None


def _schedule(spec: Any, where: str, lib: Any = optim, known: Sequence[str] = SCHEDULES) -> Any:
    """A schedule table ``{ name = ..., ... }`` at ``where``: of the optimizers' learning rate
    (:data:`SCHEDULES`), or ``adaptive``'s period (``lib`` strategies, :data:`PERIOD_SCHEDULES`)."""
    if not isinstance(spec, dict) or "name" not in spec:
        example = (
            'name = "constant", value = 0.01'
            if lib is optim
            else 'name = "adacomm", local_steps = 32'
        )
        raise ConfigError(
            where, f"expected a table with a name, such as {{ {example} }}, got {spec!r}"
        )
    name = spec["name"]
    if name not in known:
        raise ConfigError(f"{where}.name", f"unknown schedule {name!r} (known: {', '.join(known)})")
    fn = getattr(lib, name)
    kwargs = {k: v for k, v in _new_keys(fn, spec, where).items() if k != "name"}
    return _call(fn, kwargs, where, name)


def _optimizer(o: dict, where: str = "optimizer") -> Any:
    """An [optimizer]-like table as a stalewise optimizer; errors name ``where.key``."""
    name = o.get("name", "sgd")
    if name not in OPTIMIZERS:
        raise ConfigError(
            f"{where}.name", f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})"
        )
    kwargs = {k: v for k, v in o.items() if k not in ("name", "schedule")}
    extra = {}
    if "schedule" in o:
        if "lr" in o:
            raise ConfigError(where, f"give {where}.lr or {where}.schedule, not both")
        extra["lr"] = _schedule(o["schedule"], f"{where}.schedule")
    keys = {"lr": f"{where}.lr"}
    if "lr" not in o and "schedule" not in o:
        raise ConfigError(f"{where}.lr", f"missing: {name} needs {where}.lr (or {where}.schedule)")
    return _call(getattr(optim, name), kwargs, where, name, keys=keys, extra=extra)


def parse_strategy_value(value: str) -> tuple[str, int | None]:
    """``"diloco:20"`` -> ``("diloco", 20)``, ``"gradients"`` -> ``("gradients", None)``.

    Example:
        >>> parse_strategy_value("local_sgd:8"), parse_strategy_value("gradients")
        (('local_sgd', 8), ('gradients', None))
    """
    name, sep, period = value.strip().partition(":")
    name = name.strip()
    if name not in STRATEGIES:
        raise ValueError(
            f"expected strategies such as gradients,local_sgd:8,diloco:20 "
            f"(known: {', '.join(STRATEGIES)}), got {value!r}"
        )
    if not sep:
        return name, None
    if name not in PERIOD_KEY:
        raise ValueError(f"{value!r}: {name} takes no number of local steps")
    try:
        steps = int(period)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ValueError(
            f"{value!r}: expected {name}:H with H local steps, an integer >= 1, got {period!r}"
        )
    return name, steps


def _server_optimizer(
    o: dict, given: bool, strategy: strategies_lib.Strategy | None, workers: int
) -> Any:
    """The [optimizer] table's optimizer, or the strategy's recommendation without one."""
    if given or strategy is None:
        return _optimizer(o)
    recommended = strategy.server_optimizer(workers)
    if recommended is None:
        raise ConfigError(
            "optimizer",
            f"missing: strategy {strategy.name!r} recommends no server optimizer; add an "
            '[optimizer] table, such as name = "sgd" and lr = 0.1',
        )
    return recommended


def strategy_from_table(
    table: Mapping[str, Any], where: str = "strategy"
) -> strategies_lib.Strategy | None:
    """The [strategy] table as a strategy (None for an absent or empty table).

    ``inner`` is an [optimizer]-like table (errors name ``strategy.inner.lr``...),
    ``schedule`` (``adaptive`` only) a table ``{ name = "comm_budget" | "adacomm" | "fixed", ... }``,
    every other key an option of the strategy's constructor in
    :mod:`stalewise.strategies`.
    """
    if not table:
        return None
    if not isinstance(table, Mapping):
        raise ConfigError(where, f"must be a table, got {table!r}")
    name = table.get("name")
    if name is None:
        raise ConfigError(f"{where}.name", f"missing: name the strategy ({', '.join(STRATEGIES)})")
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ConfigError(
            f"{where}.name", f"unknown strategy {name!r} (known: {', '.join(STRATEGIES)})"
        )
    fn = getattr(strategies_lib, name)
    table = _new_keys(fn, table, where)
    sig = _signature(fn)
    known = list(sig.parameters) if sig is not None else []
    for key in table:
        if key != "name" and key not in known:
            takes = f"known: {', '.join(known)}" if known else "it takes none"
            raise ConfigError(f"{where}.{key}", f"unknown option for {name} ({takes})")
    kwargs = {k: v for k, v in table.items() if k not in ("name", "inner", "schedule")}
    extra = {}
    if "inner" in table:
        inner = table["inner"]
        if not isinstance(inner, dict):
            raise ConfigError(
                f"{where}.inner",
                f'expected an optimizer table such as {{ name = "adamw", lr = 0.001 }}, '
                f"got {inner!r}",
            )
        extra["inner"] = _optimizer(inner, f"{where}.inner")
    if "schedule" in table:
        extra["schedule"] = _schedule(
            table["schedule"], f"{where}.schedule", strategies_lib, PERIOD_SCHEDULES
        )
    for key in extra:  # passed unchecked by _call: name them if the call fails on them
        kwargs.pop(key, None)
    return _call(fn, kwargs, where, name, extra=extra)


def _new_keys(fn: Any, table: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``table`` with the old keys of ``fn``'s renamed keywords (``fn.renamed``, see
    :func:`stalewise._renames.renames`) under their new names, each with a
    DeprecationWarning naming both keys; an old key beside its new one is an error."""
    out = dict(table)
    for old, new in getattr(fn, "renamed", {}).items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(
                f"{where}.{old}", f"is the old name of {where}.{new}; give only {new}"
            )
        warnings.warn(
            f"{where}.{old} is now {where}.{new} (the old key will be removed in the next release)",
            DeprecationWarning,
            stacklevel=4,
        )
        out[new] = out.pop(old)
    return out


def _codec(spec: Any, key: str) -> codecs.Policy:
    """A codec from ``"int8"``, ``"topk:0.01"`` or a table (:func:`stalewise.codecs.parse`)."""
    if not isinstance(spec, str | dict):
        raise ConfigError(
            key, f"expected a codec name such as 'topk:0.01' or a table, got {spec!r}"
        )
    try:
        return codecs.parse(spec)
    except (TypeError, ValueError) as e:
        raise ConfigError(key, str(e)) from None


def _pull_codec(spec: Any, key: str) -> codecs.Policy | None:
    """The pull codec: None (absent, or ``"full"``: full pulls) or a codec as for ``_codec``."""
    if spec is None or (isinstance(spec, str) and spec.strip() == "full"):
        return None
    return _codec(spec, key)


def _consistency(s: dict) -> consistency_lib.Consistency:
    name = s.get("consistency", "asp")
    if not isinstance(name, str) or name.lower() not in CONSISTENCY:
        raise ConfigError(
            "server.consistency",
            f"unknown consistency model {name!r} (known: {', '.join(CONSISTENCY)})",
        )
    options = {
        "hybrid": (consistency_lib.Hybrid, "tolerance"),
        "ssp": (consistency_lib.SSP, "bound"),
    }
    for model, (_, key) in options.items():
        if key in s and name.lower() != model:
            raise ConfigError(
                f"server.{key}", f'only for consistency = "{model}", got consistency = {name!r}'
            )
    if name.lower() not in options:
        return consistency_lib.from_name(name)
    cls, key = options[name.lower()]
    kwargs = {key: s[key]} if key in s else {}
    return _call(cls, kwargs, "server", f"consistency {name.lower()}")


def _staleness(s: dict) -> staleness_lib.Staleness:
    name = s.get("staleness", "constant")
    makers = {
        "constant": staleness_lib.constant,
        "inverse": staleness_lib.inverse,
        "exponential": staleness_lib.exponential,
        "polynomial": staleness_lib.polynomial,
    }
    if not isinstance(name, str) or name not in makers:
        raise ConfigError(
            "server.staleness", f"unknown staleness rule {name!r} (known: {', '.join(makers)})"
        )
    kwargs = {k: s[k] for k in ("max_staleness", "dc_lambda") if k in s}
    keys = {k: f"server.{k}" for k in kwargs}
    if "staleness_param" in s:
        if name not in STALENESS_PARAM:
            raise ConfigError(
                "server.staleness_param",
                f'only for staleness = "exponential" (its base) or "polynomial" (its power), '
                f"got staleness = {name!r}",
            )
        kwargs[STALENESS_PARAM[name]] = s["staleness_param"]
        keys[STALENESS_PARAM[name]] = "server.staleness_param"
    return _call(makers[name], kwargs, "server", f"staleness {name!r}", keys=keys)


# ------------------------------------------------------------------------------- [sim]

_SIM_TABLES = {"stragglers": Stragglers}


def _sim_problem(error: Exception) -> tuple[str | None, str]:
    """(field, problem) from a SimConfig error."""
    if isinstance(error, SimConfigError):
        return error.key, f"{error.need}, got {error.value!r}"
    return None, str(error).removeprefix("sim: ")


def _sim(table: dict) -> SimConfig:
    """The [sim] table as a SimConfig; an error names the key (``sim.failures[0].worker``)."""
    try:
        return SimConfig.from_dict(table)
    except (TypeError, ValueError) as e:
        error = e
    for key in table:
        if key not in _SIM_KEYS:
            raise ConfigError(
                f"sim.{key}", f"unknown option (known: {', '.join(sorted(_SIM_KEYS))})"
            )
    context = {"compute": table["compute"]} if "compute" in table else {}
    for key in sorted(table, key=lambda k: k != "compute"):  # the others need a good compute
        value = table[key]
        kind = _SIM_LISTS.get(key) or _SIM_TABLES.get(key)
        items = [value]
        if key == "speeds" and not isinstance(value, list):
            raise ConfigError(
                "sim.speeds", f"expected a list of numbers (one per worker), got {value!r}"
            )
        if key in _SIM_LISTS:
            if not isinstance(value, list):
                raise ConfigError(
                    f"sim.{key}", f"expected a list of tables ({_sim_fields(kind)}), got {value!r}"
                )
            items = value
        for i, item in enumerate(items):
            where = f"sim.{key}[{i}]" if key in _SIM_LISTS else f"sim.{key}"
            if kind is not None:
                _check_sim_table(where, item, kind)
            try:
                SimConfig.from_dict({**context, key: [item] if key in _SIM_LISTS else item})
            except (TypeError, ValueError) as e:
                name, problem = _sim_problem(e)
                sub = f".{name}" if kind is not None and name and "[" not in name else ""
                raise ConfigError(where + sub, problem) from None
    name, problem = _sim_problem(error)
    raise ConfigError(f"sim.{name}" if name else "sim", problem)


def _sim_fields(kind: type) -> str:
    return ", ".join(f.name for f in fields(kind))


def _check_sim_table(where: str, item: Any, kind: type) -> None:
    if not isinstance(item, dict):
        raise ConfigError(where, f"expected a table ({_sim_fields(kind)}), got {item!r}")
    known = {f.name for f in fields(kind)}
    for k in item:
        if k not in known:
            raise ConfigError(f"{where}.{k}", f"unknown option (known: {_sim_fields(kind)})")


def _check_sim_workers(sim: SimConfig, workers: int, key: str) -> None:
    try:
        sim.check_workers(workers)
    except (TypeError, ValueError) as e:
        name, problem = _sim_problem(e)
        raise ConfigError(
            f"sim.{name}" if name else "sim", f"{problem} (with {key} = {workers})"
        ) from None
