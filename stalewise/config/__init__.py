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
constructor itself (``strategy.local_steps: must be an integer >= 1, got 0``).
``gradients``, the default, takes none; ``local_sgd`` needs ``inner``, ``easgd`` ``alpha``,
``local_steps`` and ``inner``.

``local_steps`` is ``H``, the local steps per push, in every strategy;
``every`` is only delayed Nesterov's ``N`` (asynchronous DiLoCo), ``period``
only seconds (``dynamic``).

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
:func:`max_workers` workers (4096 local processes, 16384 simulated workers) and
the limits of :mod:`stalewise.config.schema` (shards, steps, nesting) and
:data:`~stalewise.runtime.base.MAX_DELAY`. Times and rates are bounded so that no
run can be endless: ``eval_interval`` at least 1 ms, ``worker_timeout`` at least
0.1 s, straggler factors at most 10000, and the [sim] table's as
:mod:`stalewise.runtime.sim.models` says; a simulated run that would still record
more than :data:`~stalewise.runtime.sim.config.MAX_RECORDS` times stops with a
``sim`` (or ``run.eval_interval``) error.
"""

from __future__ import annotations

import contextlib
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalewise import runtime as runtime_lib
from stalewise import strategies as strategies_lib
from stalewise import tasks
from stalewise.api import Job
from stalewise.config import build, factory, schema
from stalewise.config.build import sim as _sim  # config._sim: the [sim] table alone
from stalewise.config.build import strategy_from_table
from stalewise.config.schema import TABLES, ConfigError, parse_strategy_value
from stalewise.config.schema import max_workers as max_workers
from stalewise.options import Emulation, Failures, Metrics, Simulation
from stalewise.runtime.base import MAX_DELAY
from stalewise.runtime.result import TrainResult
from stalewise.runtime.sim.config import SimConfig, TooLongError


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
            schema.check_runtime(runtime, "--runtime")
            if runtime != kwargs["runtime"]:
                self.check_workers(kwargs["workers"], runtime, "run.workers")
            kwargs["runtime"] = runtime
        return kwargs

    def check_workers(self, workers: int, runtime: str, key: str) -> None:
        """Checks that a run on ``runtime`` may have ``workers`` workers; errors name ``key``.

        The limit of the runtime, the [sim] table's per-worker settings (runtime
        "sim") and the task's batches for that many workers are checked.
        """
        schema.check_workers(workers, runtime, key)
        if runtime_lib.describe(runtime).simulated and self.sim is not None:
            build.check_sim_workers(self.sim, workers, key)
        factory.check_batches(self.task, workers, self.seed, key)

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
        sig = build.signature(fn)
        accepted = set(sig.parameters) if sig is not None else set()
        table = {k: v for k, v in self.strategy_table.items() if k in accepted}
        if period is not None:
            table["local_steps"] = period
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
                self._metrics = factory.metric_names(self.task, self.task.init_params(self.seed))
        return self._metrics

    @contextlib.contextmanager
    def importable(self) -> Iterator[None]:
        """Within the block, the task factory's module can be imported by name, here and in
        processes started here: its folder is put first on ``sys.path`` and on ``PYTHONPATH``
        (nothing happens if the module came from ``sys.path`` itself). Both are restored after.
        """
        with factory.on_path(self.paths, env=True):
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
        described = runtime_lib.describe(train["runtime"])
        if described.simulated:  # the task's seed also seeds the simulator
            train["runtime"] = Simulation(self.sim, seed=self.seed)
        if described.connect is not None and (address or self.address):
            try:
                described.load("connect")(address or self.address)
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


def load(path: str | os.PathLike[str], **overrides: str | None) -> RunConfig:
    """Reads and checks a TOML config file; a task factory's module may sit next to it.
    ``overrides`` are :func:`parse`'s: ``runtime``, ``codec`` and ``pull_codec``."""
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
            str(p),
            f"not a config: its arrays or tables nest more than {schema.MAX_DEPTH} levels deep",
        ) from None
    try:
        cfg = parse(raw, base=p.resolve().parent, **overrides)
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
        runtime: overrides ``run.runtime`` (``stalewise train --runtime``); the limits
            and the [sim] table are checked for it.
        codec: overrides ``server.codec`` (``stalewise train --codec``).
        pull_codec: overrides ``server.pull_codec`` (``--pull-codec``; ``"full"``: off).

    Raises:
        ConfigError: naming the bad key.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError("config", f"expected tables, got {raw!r}")
    schema.check_depth(raw)
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
    factory.check_task_table(t)
    seed = schema.get(t, "task.seed", int, 0, low=0)
    configured = schema.get(r, "run.runtime", str, "local")
    for key, name in (("run.runtime", configured), ("--runtime", runtime)):
        schema.check_runtime(name, key)
    address = r.get("address")
    if address is not None and not (isinstance(address, str) and address.strip()):
        raise ConfigError("run.address", f"expected an address such as 'auto', got {address!r}")
    if address is not None and runtime_lib.describe(configured).connect is None:
        raise ConfigError("run.address", f"is for runtime {runtime_lib.able('connect')!r}; "
                          f"run.runtime is {configured!r}")  # fmt: skip
    runtime = runtime or configured
    workers = schema.get(r, "run.workers", int, 4, low=1)
    schema.check_workers(workers, runtime, "run.workers")
    steps = schema.get(r, "run.steps", int, 1000, low=1, high=schema.MAX_STEPS)
    delay = schema.get(r, "run.delay", float, 0.0, low=0, high=MAX_DELAY)
    eval_interval = schema.run_option(r, "eval_interval")
    stragglers = schema.stragglers(r.get("stragglers"), workers)
    stop_at = schema.stop_at(r.get("stop_at"))
    failures = Failures(**{k: schema.run_option(r, name) for k, name in Failures.FIELDS.items()})
    consistency = build.consistency(s)
    staleness = build.staleness(s)
    shards = schema.get(s, "server.shards", int, 1, low=1, high=schema.MAX_SHARDS)
    codec_policy = build.codec(s.get("codec", "none"), "server.codec")
    if codec is not None:
        codec_policy = build.codec(codec, "--codec")
    pull_key = "--pull-codec" if pull_codec is not None else "server.pull_codec"
    pulls_policy = build.pull_codec(
        s.get("pull_codec") if pull_codec is None else pull_codec, pull_key
    )
    why = runtime_lib.pull_refusal(pulls_policy, runtime)
    if why is not None:
        raise ConfigError(pull_key, why)
    strategy = strategy_from_table(st)
    optimizer = build.server_optimizer(o, "optimizer" in raw, strategy, workers)
    if strategy is not None:
        try:
            strategy.check_consistency(consistency, recommended="optimizer" not in raw)
        except ValueError as e:
            raise ConfigError("server.consistency", str(e)) from None
    sim_config = _sim(sim_table)
    if runtime_lib.describe(runtime).simulated:
        build.check_sim_workers(sim_config, workers, "run.workers")

    # 2. the task (a factory runs user code), its parameters, the job
    task, paths = factory.task(t, base)
    with factory.on_path(paths):
        try:  # a built-in task refuses sizes too large for memory when it is made (above)
            params = task.init_params(seed)
            job = build.job(
                params,
                optimizer=optimizer,
                consistency=consistency,
                staleness=staleness,
                shards=shards,
                strategy=strategy,
                codec=codec_policy,
                pull_codec=pulls_policy,
            )
            factory.check_batches(task, workers, seed, "run.workers")
            metrics = factory.metric_names(task, params) if stop_at else None
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
