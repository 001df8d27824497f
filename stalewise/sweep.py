"""Parameter sweeps in the simulator: one job's virtual time to a target per value, and plots."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from stalewise import consistency as consistency_lib
from stalewise import report, targets
from stalewise.options import Simulation
from stalewise.runtime import sim as sim_runtime
from stalewise.runtime.options import DEFAULTS, RunOptions
from stalewise.runtime.sim.config import SimConfig
from stalewise.strategies import Strategy

log = logging.getLogger(__name__)

__all__ = ["COLUMNS", "parse_consistency", "sweep"]

#: Columns of a sweep's rows, in the order a table should show them.
COLUMNS = ("run", "workers", "consistency", "time_to_target", "updates_to_target", "final")
COLUMNS += ("time", "updates", "staleness_mean", "events", "wall_s")


def parse_consistency(value: Any) -> consistency_lib.Consistency:
    """A consistency model from an object or a name: "asp", "bsp", "ssp" or "ssp:4"."""
    if isinstance(value, consistency_lib.Consistency):
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"consistency value {value!r}: expected a name like 'asp', 'bsp' or 'ssp:4'"
        )
    name, _, bound = value.partition(":")
    try:
        return consistency_lib.from_name(name.strip(), float(bound) if bound else None)
    except ValueError as e:
        raise ValueError(f"consistency value {value!r}: {e}") from None


def sweep(
    job: Any,
    task: Any,
    *,
    over: Literal["workers", "consistency", "strategy"],
    values: Sequence[Any],
    steps: int,
    target: float,
    metric: str = "loss",
    mode: Literal["min", "max"] | None = None,
    workers: int = 8,
    sim: Simulation | None = None,
    eval_interval: float | None = None,
    delay: float = 0.0,
    stop_at_target: bool = True,
    out: str | os.PathLike[str] | None = None,
    on_record: Callable[[dict], None] | None = None,
    progress: bool = DEFAULTS["progress"],
) -> list[dict[str, Any]]:
    """Runs ``job`` in the simulator once per value and compares the time to a target.

    Args:
        job: a :class:`stalewise.Job`; only what ``over`` names is replaced per value.
        over: "workers" (worker counts), "consistency" (Consistency objects or names:
            "asp", "bsp", "ssp:4") or "strategy" (strategies or ``(label, strategy)`` pairs).
        steps, target, metric, mode: each run's push budget and its target.
        workers: the worker count when sweeping over consistency models or strategies.
        sim, eval_interval: every run's simulator and virtual seconds between evaluations
            (default: five mean step times).
        delay: extra virtual seconds per step, every worker.
        out: a folder for ``sweep.png`` and ``metrics.jsonl``.

    Returns a row per value, keys :data:`COLUMNS`."""
    if over not in ("workers", "consistency", "strategy"):
        raise ValueError(f"over must be 'workers', 'consistency' or 'strategy', got {over!r}")
    goal = targets.Target(metric, target, mode)
    if not values:
        raise ValueError("values is empty: nothing to sweep")
    if not (delay >= 0 and math.isfinite(delay)):
        raise ValueError(f"delay must be a finite number of seconds >= 0, got {delay!r}")
    if sim is not None and not isinstance(sim, Simulation):
        raise TypeError(f"sim must be a sw.Simulation(...) or None, got {sim!r}")
    sim = sim or Simulation()
    model = SimConfig() if sim.config is None else sim.config
    if eval_interval is None:
        eval_interval = 5 * (model.compute.mean + delay) or 1.0
    runs = []
    for v in values:
        if over == "workers":
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"workers value {v!r}: expected an integer >= 1")
            runs.append((f"P={v}", v, job.config, job.strategy))
        elif over == "consistency":
            c = parse_consistency(v)
            config = dataclasses.replace(job.config, consistency=c)
            runs.append((str(c), workers, config, job.strategy))
        else:
            label, strategy = v if isinstance(v, tuple) else (repr(v), v)
            if not isinstance(strategy, Strategy):
                raise ValueError(f"strategy value {v!r}: expected a Strategy or (label, Strategy)")
            optimizer = strategy.server_optimizer(workers) or job.config.optimizer
            config = dataclasses.replace(job.config, optimizer=optimizer)
            runs.append((label, workers, config, strategy))

    def evaluate(params: Any) -> dict[str, float]:
        m = dict(task.evaluate(params))
        if metric not in m:
            raise KeyError(f"metric {metric!r} is not among the task's metrics {sorted(m)}")
        return m

    def emit(p: int, rec: dict) -> None:
        rec["workers"] = p
        if writer is not None:
            writer.write(rec)
        if on_record is not None:
            on_record(rec)

    options = [
        RunOptions(
            loss_and_grad=task.loss_and_grad,
            data=task.batches,
            workers=p,
            steps=steps,
            evaluate=evaluate,
            eval_interval=eval_interval,
            delays=dict.fromkeys(range(p), delay) if delay else None,
            stop_at=goal if stop_at_target else None,
            run=label,
            on_record=functools.partial(emit, p),
            progress=progress,
            sim=model,
            sim_seed=sim.seed,
        )
        for label, p, _, _ in runs
    ]
    writer = report.MetricsWriter(Path(out) / "metrics.jsonl") if out is not None else None
    rows, records = [], []
    try:
        for (label, p, config, strategy), o in zip(runs, options, strict=True):
            result = sim_runtime.run(config, strategy, o)
            records.extend(result.records)
            time_to = targets.time_to_target(result.records, goal)
            updates_to = targets.time_to_target(result.records, goal, x="updates")
            rows.append(
                {
                    "run": label,
                    "workers": p,
                    "consistency": str(config.consistency),
                    "time_to_target": time_to,
                    "updates_to_target": updates_to,
                    "final": result.records[-1][metric],
                    "time": result.time,
                    "updates": result.stats["version"],
                    "staleness_mean": result.stats["staleness_mean"],
                    "events": result.stats["sim"]["events"],
                    "wall_s": result.stats["sim"]["wall_time"],
                }
            )
            log.info("sweep %s: time to %s: %s", label, goal, time_to)
    finally:
        if writer is not None:
            writer.close()
    if out is not None:
        plot(rows, records, Path(out) / "sweep.png", over=over, metric=metric, target=target)
    return rows


def plot(
    rows: Sequence[dict],
    records: Sequence[dict],
    path: str | os.PathLike[str],
    *,
    over: str,
    metric: str,
    target: float,
) -> Path:
    """Draws a sweep: ``metric`` against virtual time per run, and time to target per value.

    Example:
        >>> import tempfile, os
        >>> rows = [{"run": "P=2", "workers": 2, "time_to_target": 3.0},
        ...         {"run": "P=4", "workers": 4, "time_to_target": None}]
        >>> recs = [{"run": r, "time": t, "loss": 1.0 / (t + 1)}
        ...         for r in ("P=2", "P=4") for t in range(4)]
        >>> plot(rows, recs, os.path.join(tempfile.mkdtemp(), "s.png"), over="workers",
        ...      metric="loss", target=0.3).stat().st_size > 1000
        True
    """
    fig, (curves, bars) = report.figure(11.0, 4.0, 2)
    runs = {row["run"]: [r for r in records if r.get("run") == row["run"]] for row in rows}
    report.draw(curves, runs, "time", metric, target, "virtual time (s)", metric)
    done = [r for r in rows if r["time_to_target"] is not None]
    missed = [r["run"] for r in rows if r["time_to_target"] is None]
    if over == "workers":
        xs = [r["workers"] for r in done]
        bars.plot(xs, [r["time_to_target"] for r in done], marker="o", linewidth=1.5)
        bars.set_xscale("log", base=2)
        bars.set_xticks(xs, [str(x) for x in xs])
        bars.set_ylim(bottom=0)
        bars.set_xlabel("workers")
    else:
        names = [r["run"] for r in rows]
        heights = [r["time_to_target"] if r["time_to_target"] is not None else 0.0 for r in rows]
        bars.bar(names, heights, color="tab:blue")
        bars.set_xlabel("consistency model" if over == "consistency" else over)
    bars.set_ylabel(f"virtual time to {metric} {target:g} (s)")
    bars.grid(True, alpha=0.3)
    if missed:
        bars.set_title(f"target not reached: {', '.join(missed)}", fontsize="small")
    fig.suptitle(f"simulated time to target, over {over}")
    return report.save(fig, path)
