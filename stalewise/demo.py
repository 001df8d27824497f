"""``stalewise demo``: synchronous vs asynchronous training with a straggler.

Trains the digits MLP with local worker processes, the last ``slowdown`` times slower, under
BSP then ASP, and reports the wall time each needs to reach 95% held-out accuracy."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from stalewise import optim, report, tasks
from stalewise import staleness as st
from stalewise.api import Job
from stalewise.config import MAX_DELAY, ConfigError, max_workers
from stalewise.consistency import ASP, BSP
from stalewise.options import Emulation, Metrics

TARGET = 0.95
LR = 0.01  # LAMB's learning rate, shared by both runs


def runs() -> list[tuple[str, Any, Any]]:
    """The demo's runs: (name, consistency, staleness rule)."""
    return [
        ("BSP (synchronous)", BSP(), st.constant()),
        ("ASP + inverse staleness", ASP(), st.inverse()),
    ]


def check_args(
    workers: int = 4, slowdown: float = 4.0, delay: float = 0.008, steps: int = 1200
) -> None:
    """Checks the demo's arguments before anything starts (ConfigError names the argument)."""
    for name, value in (("workers", workers), ("steps", steps)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(name, f"expected an integer, got {value!r}")
        if value < 1:
            raise ConfigError(name, f"must be >= 1, got {value!r}")
    for name, value, low, high in (
        ("slowdown", slowdown, 1.0, 1e6),
        ("delay", delay, 0.0, MAX_DELAY),
    ):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise ConfigError(name, f"expected a finite number, got {value!r}")
        if not low <= value <= high:
            raise ConfigError(name, f"must be in [{low:g}, {high:g}], got {value!r}")
    if workers > max_workers("local"):
        raise ConfigError("workers", f"at most {max_workers('local')}, got {workers}")
    limit = tasks.get("digits").num_train  # every worker needs a training example
    if workers > limit:
        raise ConfigError("workers", f"at most {limit} for the digits demo, got {workers}")


def run(
    out: Path,
    *,
    workers: int = 4,
    slowdown: float = 4.0,
    delay: float = 0.008,
    steps: int = 1200,
    lr: float = LR,
    progress: bool = True,
) -> list[dict]:
    """Runs the demo, writes ``metrics.jsonl`` and ``demo.png`` into ``out``; returns table rows."""
    check_args(workers, slowdown, delay, steps)
    settings = {"lr": lr, "workers": workers, "slowdown": slowdown, "delay": delay, "steps": steps}
    rows = []
    records: list[dict] = []
    with report.MetricsWriter(out / "metrics.jsonl") as writer:
        for name, consistency, staleness in runs():
            row, recs = train_one(
                name, consistency, staleness, on_record=writer.write, progress=progress, **settings
            )
            rows.append(row)
            records += recs
    report.plot_runs(
        records, out / "demo.png", title=f"digits MLP, {workers} workers, one {slowdown:g}x slower"
    )
    return rows


def train_one(
    name: str,
    consistency: Any,
    staleness: Any,
    *,
    lr: float = LR,
    workers: int = 4,
    slowdown: float = 4.0,
    delay: float = 0.008,
    steps: int = 1200,
    on_record: Any = None,
    progress: bool = False,
) -> tuple[dict, list[dict]]:
    """One of the demo's runs at LAMB learning rate ``lr``: its table row and its records."""
    task = tasks.get("digits")
    job = Job(
        task.init_params(0),
        optimizer=optim.lamb(lr, max_trust_ratio=10.0),
        consistency=consistency,
        staleness=staleness,
    )
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=workers,
        steps=steps,
        evaluate=task.evaluate,
        stop_at={"accuracy": 0.97},
        metrics=Metrics(every=0.1, name=name, on_record=on_record, progress=progress),
        emulation=Emulation(
            stragglers={workers - 1: slowdown}, delays=dict.fromkeys(range(workers), delay)
        ),
    )
    row = {
        "run": name,
        "time_to_95%_s": report.time_to_target(result.records, "accuracy", TARGET),
        "final_accuracy": result.records[-1].get("accuracy"),
        "wall_s": result.time,
        "updates/s": result.stats["version"] / result.time,
        "staleness_mean": result.stats["staleness_mean"],
        "staleness_max": result.stats["staleness_max"],
    }
    return row, result.records


def summary(rows: list[dict], lr: float = LR) -> str:
    """The demo's table, plus the speed-up of the asynchronous run (at the one shared ``lr``)."""
    text = report.format_table(rows, list(rows[0]))
    sync, asyn = rows[0]["time_to_95%_s"], rows[-1]["time_to_95%_s"]
    if sync and asyn:
        text += (
            f"\n\nasynchronous reached {TARGET:.0%} in {asyn / sync:.2f}x the wall time of "
            f"synchronous, at one shared learning rate (LAMB lr {lr:g}; "
            "benchmarks/time_to_accuracy.py tunes each)"
        )
    return text
