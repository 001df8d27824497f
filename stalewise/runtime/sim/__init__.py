"""The simulator runtime: thousands of workers on one machine, on a virtual clock.

The local runtime's protocol objects on :mod:`.engine`'s clock; a run depends only on the
config and the seed, and its checkpoints hold its state (design notes)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.protocol import ServerConfig
from stalewise.runtime import driver
from stalewise.runtime.options import RunOptions
from stalewise.runtime.result import TrainResult
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

    ``eval_interval`` and the records' times are virtual seconds, ``timeout`` wall seconds;
    ``options.sim_seed`` seeds the compute times; restarts come ``sim.restart_delay`` virtual
    seconds later; ``worker_timeout`` does not apply. ``stats["sim"]``: events, wall time,
    mean pull, compute and push times, each shard's counters."""
    return driver.drive(_Host(config, strategy, options), config, strategy, options)


class _Host:
    """The simulator as a :class:`~stalewise.runtime.driver.Host`: its engine runs the events."""

    runtime, virtual = "sim", True

    def __init__(self, config: ServerConfig, strategy: Strategy, o: RunOptions):
        sim = SimConfig() if o.sim is None else o.sim
        if not isinstance(sim, SimConfig):
            raise TypeError(f"sim must be a SimConfig, got {type(sim).__name__}")
        self.config, self.strategy, self.o, self.sim = config, strategy, o, sim
        self.timing = WorkerTiming(sim, o.workers, factors=o.slowdowns, delays=o.extra_delays,
                                   seed=o.sim_seed)  # fmt: skip
        self.checkpoint_info = {"seed": o.sim_seed}
        self.state: Simulation | None = None
        self.starts: list[tuple[float, int]] | None = None
        self.wall0 = self.deadline = 0.0

    def start(self, run: driver.Run) -> None:
        o = self.o
        fns = (o.loss_and_grad, o.data, self.strategy)
        self.state = state = Simulation(
            self.config, fns, o.workers, o.steps, self.sim, self.timing,
            failures=run.failures, diverge_after=o.diverge_after,
        )  # fmt: skip
        if run.resume is not None:
            self.starts = state.restore(run.resume.states, run.resume.step["sim"], run.feedback)

    def go(self) -> None:
        self.wall0 = time.perf_counter()
        self.deadline = math.inf if self.o.timeout is None else self.wall0 + self.o.timeout
        self.state.begin(self.o.eval_interval, self.starts)

    def advance(self, until: float, due: Callable[[], bool] | None) -> str:
        return self.state.advance(until, self.deadline, due)

    def now(self) -> float:
        return self.state.now

    def pushes(self) -> int:
        return self.state.pushes

    def stats(self, *, settled: bool = False) -> dict:
        return self.state.stats(settled=settled)

    def losses(self) -> Any:
        return self.state.last_loss

    def params(self) -> Any:  # what an observer pull returns: every shard's current slice
        state = self.state
        flat = np.empty_like(state.params)
        for (lo, hi), shard in zip(state.ranges, state.shards, strict=True):
            shard.pull(None, flat[lo:hi])
        return tree.unflatten(flat, self.config.spec)

    def stop(self) -> bool:
        return True  # the run ends at the record's time; pushes in flight stay there

    def snapshot(self, now: float, *, failure: bool = False) -> driver.Snapshot:
        state = self.state
        sim = state.checkpoint_state()
        step = {"pushes": sim["pushes"], "time": state.now, "sim": sim}
        return driver.Snapshot([s.state_dict() for s in state.shards], step, state.residuals())

    def budget_spent(self) -> bool:
        return False  # every simulated push counts: pushes >= steps says it

    def diverged(self) -> list[int]:
        return list(self.state.diverged)

    def finish(self, stats: dict) -> np.ndarray:
        state = self.state
        wall = time.perf_counter() - self.wall0
        n, (got, count) = max(state.totals["steps"], 1), state.pulled
        shards = [dict(version=s.version, applied=s.stats.applied, rejected=dict(s.stats.rejected),
                       duplicates=s.stats.duplicates) for s in state.shards]  # fmt: skip
        stats["sim"] = {
            "events": state.events,
            "wall_time": wall,
            "events_per_s": state.events / wall if wall > 0 else math.inf,
            "pull_time_mean": state.totals["pull"] / n,
            "push_time_mean": state.totals["push"] / n,
            "compute_time_mean": state.totals["compute"] / max(state.pushes, 1),
            "comm_time_mean": (state.totals["pull"] + state.totals["push"]) / n,
            "push_bytes": sum(state.wire_bytes),  # one dense push, every shard (scaled)
            "pushed_bytes": state.pushed_bytes,  # every push sent, as sent (model_bytes scaled)
            # one pull of every shard: the mean (model_bytes scaled)
            "pull_bytes": got / count * state.S if count else float(sum(state.slice_bytes)),
            "shards": shards,
        }
        flat = state.params.copy()  # each shard's primary (replicas: maybe a promoted backup)
        for (lo, hi), shard in zip(state.ranges, state.shards, strict=True):
            flat[lo:hi] = shard.params
        return flat

    def close(self) -> None:
        pass
