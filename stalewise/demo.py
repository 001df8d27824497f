"""``stalewise demo``: synchronous vs asynchronous training with a straggler.

Trains the built-in digits MLP (scikit-learn's bundled 8x8 digits) with local
worker processes, the last of them ``slowdown`` times slower, first with BSP
(every round waits for the straggler) and then with SSP and staleness-aware
LAMB (nobody waits for it), and reports the wall time each needs to reach 95%
held-out accuracy.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from stalewise import optim, report, tasks
from stalewise import staleness as st
from stalewise.api import Job
from stalewise.consistency import BSP, SSP

log = logging.getLogger(__name__)

TARGET = 0.95


def runs() -> list[tuple[str, Any, Any]]:
    """The demo's runs: (name, consistency, staleness rule)."""
    return [
        ("BSP (synchronous)", BSP(), st.constant()),
        ("SSP(4) + inverse staleness", SSP(4), st.inverse()),
    ]


def run(
    out: Path,
    *,
    workers: int = 4,
    slowdown: float = 4.0,
    delay: float = 0.004,
    steps: int = 2400,
    lr: float = 0.01,
    progress: bool = True,
) -> list[dict]:
    """Runs the demo, writes ``metrics.jsonl`` and ``demo.png`` into ``out``; returns table rows."""
    task = tasks.get("digits")
    rows = []
    records: list[dict] = []
    with report.MetricsWriter(out / "metrics.jsonl") as writer:
        for name, consistency, staleness in runs():
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
                eval_interval=0.1,
                stragglers={workers - 1: slowdown},
                delays=dict.fromkeys(range(workers), delay),
                stop_at={"accuracy": 0.97},
                run=name,
                on_record=writer.write,
                progress=progress,
            )
            records += result.records
            last = result.records[-1]
            rows.append(
                {
                    "run": name,
                    "time_to_95%_s": result.time_to("accuracy", TARGET),
                    "final_accuracy": last.get("accuracy"),
                    "wall_s": result.time,
                    "updates/s": result.stats["version"] / result.time,
                    "staleness_mean": result.stats["staleness_mean"],
                    "staleness_max": result.stats["staleness_max"],
                }
            )
    report.plot_runs(
        records, out / "demo.png", title=f"digits MLP, {workers} workers, one {slowdown:g}x slower"
    )
    return rows


def summary(rows: list[dict]) -> str:
    """The demo's table, plus the speed-up of the asynchronous run."""
    text = report.format_table(rows, list(rows[0]))
    sync, asyn = rows[0]["time_to_95%_s"], rows[-1]["time_to_95%_s"]
    if sync and asyn:
        text += f"\n\nasynchronous reached {TARGET:.0%} in {asyn / sync:.2f}x the wall time of synchronous"
    return text
