"""Job configuration files (TOML) for ``stalewise train`` and ``sim``; format: docs/config.md."""

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
        """Checks ``workers`` against the runtime, [sim] and the task's batches; names ``key``."""
        schema.check_workers(workers, runtime, key)
        if runtime_lib.describe(runtime).simulated and self.sim is not None:
            build.check_sim_workers(self.sim, workers, key)
        factory.check_batches(self.task, workers, self.seed, key)

    def sweep_strategy(self, value: str, key: str = "--values") -> strategies_lib.Strategy:
        """The strategy of one ``stalewise sim --over strategy`` value, ``NAME`` or ``NAME:H``
        (``H``: its ``local_steps``), with the [strategy] table's options it accepts."""
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
        """Within the block, the task factory's module imports by name, here and in children."""
        with factory.on_path(self.paths, env=True):
            yield

    def run(
        self, runtime: str | None = None, *, address: str | None = None, **kwargs: Any
    ) -> TrainResult:
        """``job.train`` with the config's run settings; ``runtime`` and ``address`` override
        ``run.runtime`` and ``run.address``, ``kwargs`` are more of ``Job.train``'s."""
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
                    self.task.loss_and_grad, data=self.data, evaluate=self.task.evaluate, **train
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
    """Checks a config's tables (``raw``) and builds the task and the job; ConfigError names a bad
    key. ``base``: the config file's folder; ``runtime``, ``codec``, ``pull_codec`` override
    ``run.runtime``, ``server.codec`` and ``server.pull_codec`` (``"full"``: off)."""
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
    replicas = schema.get(s, "server.replicas", int, 1)  # Job checks it
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
                replicas=replicas,
            )
            factory.check_batches(task, workers, seed, "run.workers")
            metrics = factory.metric_names(task, params) if stop_at else None
        except MemoryError as e:
            raise ConfigError(
                "task.args" if t.get("args") else "task",
                f"the task's parameters or data do not fit in memory: {e or 'MemoryError'}",
            ) from None
    why = runtime_lib.replica_refusal(replicas, runtime)
    if why is not None:
        raise ConfigError("server.replicas", why)
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
