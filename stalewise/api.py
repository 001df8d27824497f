"""The public entry point: a :class:`Job` is a pure configuration; runtimes run it."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stalewise import codecs as codecs_lib
from stalewise import consistency as consistency_lib
from stalewise import loggers as loggers_lib
from stalewise import optim, tree
from stalewise import options as options_lib
from stalewise import runtime as runtime_lib
from stalewise import staleness as staleness_lib
from stalewise import strategies as strategies_lib
from stalewise.backends import backend_of
from stalewise.optim import buffers as optim_buffers
from stalewise.protocol import ServerConfig
from stalewise.runtime.errors import warn_summary
from stalewise.runtime.options import RunOptions
from stalewise.runtime.result import TrainResult

log = logging.getLogger(__name__)


class Job:
    """An asynchronous training job: parameters plus the rules the servers apply.

    Args:
        params: the initial parameters: a pytree of NumPy / PyTorch / JAX / TensorFlow
            float arrays, or a model; see docs/models.md.
        optimizer: the server optimizer, e.g. ``sw.optim.lamb(1e-3)``. Default: the
            strategy's ``server_optimizer()``; required with ``gradients()``.
        consistency: ``sw.ASP()`` (default), ``sw.SSP(bound)`` or ``sw.BSP()``.
        staleness: how much a stale push counts (default ``sw.staleness.constant()``).
        strategy: what workers push (default ``sw.strategies.gradients()``).
        shards: number of parameter-server shards the parameters are split across.
        codec: how pushes travel, e.g. ``sw.codecs.int8()`` (default ``sw.codecs.none()``).
        pull_codec: delta pulls (simulator and Ray) in this codec (:mod:`.protocol.pulls`).
        replicas: copies of each shard, 1 or 2 (:mod:`stalewise.protocol.replica`).
        buffers: regexes naming the leaves that are buffers (``[r"^batch_stats\\."]``).

    Example:
        >>> import numpy as np, stalewise as sw
        >>> job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.1))
        >>> job.config.spec.size
        3
    """

    def __init__(
        self,
        params: Any,
        *,
        optimizer: Any = None,
        consistency: consistency_lib.Consistency | None = None,
        staleness: staleness_lib.Staleness | None = None,
        strategy: strategies_lib.Strategy | None = None,
        shards: int = 1,
        codec: codecs_lib.Policy | None = None,
        pull_codec: codecs_lib.Policy | None = None,
        buffers: str | Sequence[str] | None = None,
        replicas: int = 1,
    ):
        for arg, value, kind, example in (
            ("strategy", strategy, strategies_lib.Strategy, "e.g. sw.strategies.gradients()"),
            ("consistency", consistency, consistency_lib.Consistency, "e.g. sw.SSP(4)"),
            ("staleness", staleness, staleness_lib.Staleness, "e.g. sw.staleness.inverse()"),
            ("codec", codec, codecs_lib.Policy, "e.g. sw.codecs.topk(0.01)"),
            ("pull_codec", pull_codec, codecs_lib.Policy, "e.g. sw.codecs.int8()"),
        ):
            if value is not None:
                _check_arg(arg, value, kind, example)
        self.strategy = strategy or strategies_lib.gradients()
        recommended = optimizer is None
        if optimizer is None:
            optimizer = self.strategy.server_optimizer()
            if optimizer is None:
                raise TypeError(
                    f"optimizer is required: strategy {self.strategy!r} recommends no server "
                    "optimizer (pass e.g. optimizer=sw.optim.sgd(0.1))"
                )
        _check_optimizer(optimizer)
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise ValueError(f"shards must be an integer >= 1, got {shards!r}")
        if replicas not in (1, 2) or isinstance(replicas, bool):
            raise ValueError(f"replicas must be 1 or 2, got {replicas!r}")
        consistency = consistency or consistency_lib.ASP()
        self.strategy.check_consistency(consistency, recommended=recommended)
        flat, spec = tree.flatten(params, keep_integers=True)
        spec, optimizer = _with_buffers(spec, optimizer, buffers, params)
        if shards > max(spec.size, 1):
            raise ValueError(f"shards={shards} is more than the {spec.size} parameters")
        self.config = ServerConfig(
            spec=spec,
            init=flat,  # new memory: tree.flatten copies every leaf into it
            optimizer=optimizer,
            consistency=consistency,
            staleness=staleness or staleness_lib.constant(),
            shards=shards,
            codec=codecs_lib.NONE if codec is None else codec,
            pull_codec=pull_codec,
            replicas=replicas,
        )

    def train(
        self,
        loss_and_grad: Callable[[Any, Any], tuple[float, Any]],
        *,
        data: Callable[[int, int], Any] | Sequence[Any],
        workers: int | tuple[int, int] | str,
        steps: int,
        runtime: str | options_lib.Simulation = "local",
        evaluate: Callable[[Any], Mapping[str, float]] | None = None,
        stop_at: Any = None,
        metrics: options_lib.Metrics | None = None,
        checkpoints: options_lib.Checkpoints | None = None,
        failures: options_lib.Failures | None = None,
        timeouts: options_lib.Timeouts | None = None,
        emulation: options_lib.Emulation | None = None,
    ) -> TrainResult:
        """Trains with ``workers`` workers until they have pushed ``steps`` updates in all.

        Args:
            loss_and_grad: ``f(params, batch) -> (loss, grads)`` (picklable), ``params`` and
                ``grads`` in the structure and backend of the job's params.
            data: ``data(worker, workers) -> iterable of batches`` (picklable), or one
                sequence of batches per worker (cycled).
            workers: number of worker processes; on runtime "ray" also ``(min, max)`` or
                ``"auto"``, an elastic run (docs/ray.md).
            steps: total pushes across all workers (up to ``workers - 1`` in flight may
                overshoot it; under BSP, ``ceil(steps / workers)`` whole rounds).
            runtime: a name in :func:`stalewise.runtime.names`: "local", "sim" (or
                ``sw.Simulation(...)``), "ray", or one :func:`stalewise.runtime.register` added.
            evaluate: ``f(params) -> {"loss": ..., "accuracy": ...}`` on held-out data,
                called in the parent with each metrics record.
            stop_at: stop early once every target is reached, e.g. ``{"accuracy": 0.97}``.
            metrics, checkpoints, failures, timeouts, emulation: the option groups of
                :mod:`stalewise.options`; None: their defaults.

        Returns a :class:`TrainResult`: the final params, metrics records and shard stats."""
        groups = (metrics, checkpoints, failures, timeouts, emulation)
        for value, kind in zip(groups, options_lib.TRAIN_GROUPS, strict=True):
            options_lib.check_group(value, kind)
        simulation = runtime if isinstance(runtime, options_lib.Simulation) else None
        name = simulation.name if simulation is not None else runtime
        runner = runtime_lib.get(name)
        self._check_pulls(name)
        metrics = metrics or options_lib.Metrics()
        sinks = loggers_lib.Loggers(metrics.loggers, metrics.on_record)
        options = RunOptions(
            loss_and_grad=loss_and_grad,
            data=data,
            workers=workers,
            steps=steps,
            evaluate=evaluate,
            stop_at=stop_at,
            **options_lib.run_options(*groups, simulation),
            on_record=sinks.on_record,
        )
        options.check_runtime(name)
        with sinks:
            result = runner(self.config, self.strategy, options)
            warn_summary(result.failures)  # every runtime's: the first of each kind warned
            return sinks.finish(result)

    def serve(
        self,
        *,
        workers: int | tuple[int, int],
        runtime: str = "local",
        name: str | None = None,
        timeouts: options_lib.Timeouts | None = None,
        checkpoints: options_lib.Checkpoints | None = None,
    ):
        """Starts the shards for a loop you own; use as a context manager.

        ``runtime``: ``"local"`` or ``"ray"``. Hand ``server.client(w)`` to worker ``w``'s
        process, then call ``server.release(w)`` once it has started; ``server.client(w)``
        again restarts it as a new incarnation. ``workers=(min, max)``: an elastic job;
        ``name=``: others join with ``sw.attach(name)``; ``checkpoints``: docs/reliability.md.

        Example:
            >>> with job.serve(workers=2) as server:        # doctest: +SKIP
            ...     client = server.client(worker=0)        # hand it to a worker process
            ...     params = client.pull()
            ...     client.push(grads)
        """
        factory = runtime_lib.server(runtime)
        self._check_pulls(runtime)
        join = (
            options_lib.check_group(timeouts, options_lib.Timeouts) or options_lib.Timeouts()
        ).join
        named = {} if name is None else {"name": name}
        from stalewise.launch.checkpoints import served

        start = functools.partial(factory, self.config, workers, join_timeout=join, **named)
        saves = options_lib.checkpoint_fields("Job.serve", checkpoints)
        return served(self, start, runtime, *saves)

    def calibrate(self, loss_and_grad: Callable, data: Any, *, workers: int, **options: Any):
        """What the simulator needs for this job, measured here (:mod:`stalewise.calibrate`)."""
        from stalewise import calibrate as calibrate_lib

        return calibrate_lib.calibrate(self, loss_and_grad, data, workers=workers, **options)

    def _check_pulls(self, runtime: str) -> None:
        why = runtime_lib.pull_refusal(self.config.pull_codec, runtime)
        why = why or runtime_lib.replica_refusal(self.config.replicas, runtime)
        if why is not None:
            raise ValueError(why)


def _with_buffers(
    spec: tree.FlatSpec, optimizer: Any, buffers: Any, params: Any
) -> tuple[Any, Any]:
    """The spec with ``buffers`` marked, and the optimizer that keeps its buffers."""
    if buffers is None:
        buffers = [f"^{re.escape(name)}$" for name in _batchnorm_statistics(params)] or None
    if buffers is not None:
        spec = tree.mark_buffers(spec, buffers)
    if not spec.buffers:
        return spec, optimizer
    clash = set(spec.buffers) & {leaf.name for leaf in spec.leaves if not leaf.buffer}
    if clash:
        raise ValueError(f"buffers: leaves {sorted(clash)} name both a buffer and a parameter")
    log.debug("%d buffer leaves: %s", len(spec.buffers), ", ".join(spec.buffers))
    return spec, optim_buffers.with_buffers(optimizer, spec.buffers)


def _batchnorm_statistics(params: Any) -> list[str]:
    """The BatchNorm running statistics (beside ``num_batches_tracked``) of a ``state_dict``."""
    if not isinstance(params, Mapping):
        return []
    names = []
    for key, value in params.items():
        if not (isinstance(key, str) and key.endswith("num_batches_tracked")):
            continue
        backend = backend_of(value)
        tensor = backend is not None and backend.name == "torch" and backend.is_leaf(value)
        if tensor and not value.is_floating_point():
            prefix = key.removesuffix("num_batches_tracked")
            names += [prefix + s for s in ("running_mean", "running_var") if prefix + s in params]
    return names


def _check_optimizer(optimizer: Any) -> None:
    """TypeError unless a stalewise optimizer; a torch or optax one is told to go to ``inner=``."""
    if isinstance(optimizer, optim.Optimizer):
        return
    target = optimizer.func if isinstance(optimizer, functools.partial) else optimizer
    kind = target if isinstance(target, type) else type(target)
    module = getattr(kind, "__module__", "") or ""
    if module.split(".")[0] not in ("torch", "optax"):
        _check_arg("optimizer", optimizer, optim.Optimizer, "e.g. sw.optim.sgd(0.1)")
    what = f"{module}.{getattr(kind, '__qualname__', kind.__name__)}"
    raise TypeError(
        f"optimizer= is the server optimizer and must be a stalewise optimizer (e.g. "
        f"sw.optim.adam(1e-3)), got {what}; torch and optax optimizers run on the workers: pass "
        "one as inner= of a strategy, e.g. sw.strategies.diloco(inner=functools.partial("
        "torch.optim.AdamW, lr=1e-3))"
    )


def _check_arg(name: str, value: Any, kind: type, example: str) -> None:
    if isinstance(value, kind):
        return
    what = (
        f"the function {value.__name__}, not what it returns"
        if callable(value) and hasattr(value, "__name__")
        else f"{type(value).__name__} {value!r}"
    )
    raise TypeError(f"{name} must be a {kind.__name__} ({example}), got {what}")
