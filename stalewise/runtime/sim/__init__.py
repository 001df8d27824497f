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

Checkpoints (``checkpoint_dir``, ``checkpoint_every`` updates,
``checkpoint_seconds`` virtual seconds, and always at the end of the run) hold
the shards' states plus the simulator's own: the virtual time, each worker's
batches drawn, its timing RNG state and the instant its loop ended, the links'
queues and the push count; and each worker's error-feedback residual. ``resume=True`` loads them and restarts the workers
as new incarnations (fresh strategy states, their data streams fast-forwarded
past the batches drawn). A run interrupted by its ``steps`` budget and resumed
with a larger one ends bit-identical to an uninterrupted run when the
checkpoint is *quiescent* (the run ended by its budget: nothing in flight,
every loop ended) and the workers carry nothing across steps that the
checkpoint lacks: a stateless strategy (``gradients()``), a deterministic data
stream per worker, no failures or joins before the cut; and the cut is a
synchronisation point: BSP with a budget that is a multiple of the live
workers (tested with random compute times and latency), or workers in
lockstep (fixed compute, free network; tested under ASP). Under ASP/SSP with
random timing, the workers that finished early would have started their next
step while the others' last pushes were still arriving; the resumed run
cannot replay that interleaving, so it is a valid continuation, not a
bit-identical one. A mid-run (periodic) checkpoint is not quiescent: the
resumed workers start at its time (a worker waiting for its restart then
restarts at once), and a push in flight at that moment is lost on the shards
that had not yet applied it. The failure policy's restart counts start afresh
in a resumed run, as in the local runtime.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from stalewise import checkpoint, tree
from stalewise.protocol import ServerConfig
from stalewise.runtime.base import (
    Failures,
    Recorder,
    TrainResult,
    WorkerError,
    end_reason,
    mean_loss,
)
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
    compute times. Failures (a scripted ``Failure`` or an error in the user's
    code) follow ``on_worker_failure`` and ``max_restarts`` as in the local
    runtime, with restarts ``sim.restart_delay`` virtual seconds later (see
    :mod:`stalewise.runtime.sim.engine`); ``worker_timeout`` does not apply
    (nothing hangs on a virtual clock). ``stats["sim"]`` adds the event count,
    wall time, the mean pull, compute and push time of a step, and ``shards``:
    each shard's version and per-push counters (``applied``, ``rejected``,
    ``duplicates``), which the commit rule keeps equal on every shard once the
    run is over.
    """
    o = options
    loss_and_grad, data, workers, steps = o.loss_and_grad, o.data, o.workers, o.steps
    factors, extra = list(o.slowdowns), list(o.extra_delays)
    eval_interval, stop_at, on_record, timeout = o.eval_interval, o.stop_at, o.on_record, o.timeout
    run_name, progress, evaluate, seed, sim = o.run, o.progress, o.evaluate, o.seed, o.sim
    sim = SimConfig() if sim is None else sim
    if not isinstance(sim, SimConfig):
        raise TypeError(f"sim must be a SimConfig, got {type(sim).__name__}")
    timing = WorkerTiming(sim, workers, factors=factors, delays=extra, seed=seed)
    hint = ""
    if o.checkpoint_dir is not None:
        hint = (
            f"\nCheckpoints are in {o.checkpoint_dir}: resume with Job.train(..., "
            "resume=True) or `stalewise train CONFIG --resume RUN_DIR`."
        )
    failures = Failures(o.on_worker_failure, o.max_restarts, hint=hint)
    state = Simulation(
        config,
        (loss_and_grad, data, strategy),
        workers,
        steps,
        sim,
        timing,
        failures=failures,
        diverge_after=o.diverge_after,
    )
    starts = None
    resumed = checkpoint.resume_point(config, o, runtime="sim")
    if resumed is not None:
        feedback = checkpoint.feedback_of(resumed, config, workers)
        starts = state.restore(resumed.states, resumed.step["sim"], feedback)
        log.info("sim: resumed from %s (version %d)", resumed.path, resumed.version)
    saver = None
    if o.checkpoint_dir is not None:
        saver = checkpoint.Saver(
            config, strategy, o, runtime="sim", version=state.shards[0].version, now=state.now,
            seed=o.seed, failures=failures,
        )  # fmt: skip

    def save(state: Simulation, final: bool = False) -> None:
        step = {"pushes": state.pushes, "time": state.now, "sim": state.checkpoint_state()}
        states = [shard.state_dict() for shard in state.shards]
        saver.save(states, step, state.residuals(), final=final)  # a failure warns, is kept

    def save_if_due(state: Simulation) -> None:
        if saver.due(state.shards[0].version, state.now):
            save(state)

    if saver is not None and saver.periodic:
        state.checkpointer = save_if_due
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
        try:
            stopped = state.run(record, eval_interval, deadline, starts)
        except WorkerError:
            if saver is not None:  # the state at the failure, to resume from
                with contextlib.suppress(Exception):
                    save(state)
            raise
        if not recorder.records or recorder.records[-1]["time"] != state.now:
            record()
        stats = state.stats(settled=not stopped)  # a stop may leave pushes in flight
        reason = end_reason(
            recorder,
            failures,
            pushes=state.pushes,
            steps=state.steps,
            budget_spent=False,  # every simulated push counts: pushes >= steps says it
            diverged=list(state.diverged),
            stats=stats,
            version=state.shards[0].version,
            run=run_name,
        )
        recorder.finish(reason)
        if saver is not None:
            save(state, final=True)
    finally:
        recorder.close()
    wall = time.perf_counter() - wall0
    n = max(state.totals["steps"], 1)
    stats["sim"] = {
        "events": state.events,
        "wall_time": wall,
        "events_per_s": state.events / wall if wall > 0 else math.inf,
        "pull_time_mean": state.totals["pull"] / n,
        "push_time_mean": state.totals["push"] / n,
        "compute_time_mean": state.totals["compute"] / max(state.pushes, 1),
        "comm_time_mean": (state.totals["pull"] + state.totals["push"]) / n,
        "push_bytes": sum(state.wire_bytes),  # one push, every shard (model_bytes scaled)
        "pull_bytes": state.pull_bytes_mean(),  # one pull, every shard: the mean (scaled)
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
        failures.events,
        reason,
    )
