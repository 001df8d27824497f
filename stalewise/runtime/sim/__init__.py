"""The simulator runtime: thousands of workers on one machine, on a virtual clock.

It hosts the same protocol objects as the local runtime (shards built by
:meth:`ServerConfig.build_shard`, their consistency gates, staleness rules and
optimizers, the commit rule, and the one worker loop
:func:`~stalewise.protocol.loop.worker_loop` running the job's
:class:`~stalewise.strategies.Strategy`); only time is simulated. Gradients
are computed for real, on the real task, in the
single-threaded discrete-event loop of :mod:`stalewise.runtime.sim.engine`;
:class:`~stalewise.runtime.sim.config.SimConfig` says how long steps,
transfers and requests take.

Determinism: the event order and the virtual times depend only on the config
and the seed (IEEE arithmetic and numpy's PCG64 streams), never on the machine.
The parameters are then as reproducible as the user's ``loss_and_grad``: NumPy
code on one machine gives bit-identical results run after run.

"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.protocol import ServerConfig
from stalewise.runtime.base import Recorder, TrainResult, mean_loss
from stalewise.runtime.options import RunOptions
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.engine import Simulation
from stalewise.runtime.sim.models import WorkerTiming
from stalewise.strategies import Strategy

__all__ = ["SimConfig", "run", "train"]

log = logging.getLogger(__name__)


def train(config: ServerConfig, loss_and_grad: Callable, *, strategy: Strategy, **options: Any):
    """Runs in the simulator with the keyword options of :class:`RunOptions` (a shorthand).

    Example:
        >>> import stalewise as sw
        >>> from stalewise import tasks
        >>> from stalewise.runtime import sim as sim_rt
        >>> task = tasks.get("least-squares", n=64, d=4)
        >>> job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
        >>> result = sim_rt.train(job.config, task.loss_and_grad, data=task.batches,
        ...                       workers=8, steps=200, strategy=job.strategy)
        >>> result.pushes, result.stats["applied"]
        (200, 200)
    """
    return run(config, strategy, RunOptions(loss_and_grad=loss_and_grad, **options))


def run(config: ServerConfig, strategy: Strategy, options: RunOptions) -> TrainResult:
    """Trains on the virtual clock (the ``"sim"`` runtime; see :meth:`stalewise.Job.train`).

    Differences from the local runtime: ``eval_interval``, the records' ``time``
    and ``TrainResult.time`` are virtual seconds; ``timeout`` is wall seconds. A
    step's virtual compute time is ``(sim.compute sample + delays[w]) *
    stragglers[w]`` per local step (and the factors of ``options.sim``, see
    :mod:`stalewise.runtime.sim.config`). ``options.seed`` drives the random
    compute times. ``stats["sim"]`` adds the event count, wall time, the mean
    pull, compute and push time of a step, and ``shards``: each shard's version
    and per-push counters (``applied``, ``rejected``, ``duplicates``), which the
    commit rule keeps equal on every shard once the run is over.
    """
    o = options
    loss_and_grad, data, workers, steps = o.loss_and_grad, o.data, o.workers, o.steps
    factors, extra = list(o.slowdowns), list(o.extra_delays)
    eval_interval, stop_at, on_record, timeout = o.eval_interval, o.stop_at, o.on_record, o.timeout
    run_name, progress, evaluate, seed, sim = o.run, o.progress, o.evaluate, o.seed, o.sim
    if not (eval_interval > 0 and math.isfinite(eval_interval)):
        raise ValueError(
            f"eval_interval must be a finite number of virtual seconds > 0, got {eval_interval!r}"
        )
    sim = SimConfig() if sim is None else sim
    if not isinstance(sim, SimConfig):
        raise TypeError(f"sim must be a SimConfig, got {type(sim).__name__}")
    timing = WorkerTiming(sim, workers, factors=factors, delays=extra, seed=seed)
    state = Simulation(config, (loss_and_grad, data, strategy), workers, steps, sim, timing)
    recorder = Recorder(run_name, steps, stop_at=stop_at, on_record=on_record, progress=progress)

    def observed() -> Any:  # what an observer pull returns: every shard's current slice
        flat = np.empty_like(state.params)
        for (lo, hi), shard in zip(state.ranges, state.shards, strict=True):
            shard.pull(None, flat[lo:hi])
        return tree.unflatten(flat, config.spec)

    def record() -> bool:
        return recorder.record(
            state.now, state.pushes, state.stats(), mean_loss(state.last_loss), evaluate, observed
        )

    wall0 = time.perf_counter()
    try:
        deadline = math.inf if timeout is None else wall0 + timeout
        stopped = state.run(record, eval_interval, deadline)
        if not recorder.records or recorder.records[-1]["time"] != state.now:
            record()
    finally:
        recorder.close()
    wall = time.perf_counter() - wall0
    if state.pushes < steps and not stopped:
        log.warning(
            "sim: the run ended after %d of %d pushes (every worker failed or left)",
            state.pushes,
            steps,
        )
    stats = state.stats(settled=not stopped)  # a stop may leave pushes in flight
    n = max(state.totals["steps"], 1)
    stats["sim"] = {
        "events": state.events,
        "wall_time": wall,
        "events_per_s": state.events / wall if wall > 0 else math.inf,
        "pull_time_mean": state.totals["pull"] / n,
        "push_time_mean": state.totals["push"] / n,
        "compute_time_mean": state.totals["compute"] / max(state.pushes, 1),
        "comm_time_mean": (state.totals["pull"] + state.totals["push"]) / n,
        "shards": [
            {
                "version": shard.version,
                "applied": shard.stats.applied,
                "rejected": dict(shard.stats.rejected),
                "duplicates": shard.stats.duplicates,
            }
            for shard in state.shards
        ],
    }
    flat = state.params.copy()
    return TrainResult(
        tree.unflatten(flat, config.spec, copy=True),
        flat,
        recorder.records,
        stats,
        state.now,
        state.pushes,
    )
