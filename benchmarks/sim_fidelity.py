"""How far to trust the simulator: real local runs beside their calibrated simulations.

For each setting (workers, consistency model, a straggler, a codec; the digits
MLP and the byte-level GPT of ``tasks.get("lm")``), this script

1. calibrates the simulator on this machine for that job (``stalewise.calibrate``:
   compute times of the task's real steps in as many processes as the run has
   workers, with the run's held-out evaluation every ``eval_interval`` beside them
   as the local run's parent makes it, the shard's apply time, the local runtime's
   pull and push times);
2. runs the job on the local runtime (real processes, wall time);
3. runs the same job in the simulator with the calibrated ``[sim]`` table (the
   same stragglers and emulated delays), and
4. prints predicted (sim) against measured (local) updates per second, mean
   staleness and time to a target held-out loss (the instant is interpolated linearly between the two evaluations around it, in
   both runtimes alike).

Bars, in every setting: updates/s and mean staleness within 15% of the measured
ones, time to target within 25%. A staleness under 1 is compared in absolute
terms (within 0.15 versions): the relative error of a near-zero mean says nothing.
``--check`` exits 1 if a bar is missed and writes the figures to
``runs/bench-sim_fidelity.json`` (or ``--json PATH``). The machine's load
average is printed with the figures: on a shared machine the local runs'
speeds are noisy.

    .venv/bin/python benchmarks/sim_fidelity.py [--quick] [--check] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import _report

import stalewise as sw
from stalewise import report, tasks

BARS = {"updates/s": 0.15, "staleness": 0.15, "time_to_target": 0.25}
STALENESS_ABS = 0.15  # versions: the bar for a mean staleness below 1


@dataclass
class Setting:
    name: str
    task: str
    workers: int
    consistency: Any
    steps: int  # pushes in all under --quick; a full run has 1.5x
    lr: float
    target: float
    stragglers: dict = field(default_factory=dict)
    codec: Any = None
    delay: float = 0.0  # emulated compute seconds per step, every worker
    optimizer: str = "sgd"


def settings() -> list[Setting]:
    """The settings; ``steps`` is the --quick budget (a full run has 1.5x)."""
    # held-out loss: reached after about 800 updates (digits) and 500 (lm, 2 s or more on 2
    # cores: the time to it is long next to the evaluation interval)
    digits, lm = 0.2, 2.6
    return [
        Setting("digits 2w ASP", "digits", 2, sw.ASP(), 1000, 0.003, digits, delay=0.004),
        Setting("digits 4w ASP straggler", "digits", 4, sw.ASP(), 1200, 0.003, digits,
                stragglers={3: 3.0}, delay=0.004),
        Setting("digits 4w SSP(2)", "digits", 4, sw.SSP(2), 1200, 0.003, digits, delay=0.004),
        Setting("digits 4w BSP", "digits", 4, sw.BSP(), 1600, 0.01, digits, delay=0.004),
        Setting("digits 8w ASP int8", "digits", 8, sw.ASP(), 1600, 0.003, digits,
                codec=sw.codecs.int8(), delay=0.004),
        Setting("lm 2w ASP", "lm", 2, sw.ASP(), 1000, 3e-3, lm, optimizer="adam"),
        Setting("lm 4w BSP", "lm", 4, sw.BSP(), 600, 6e-3, lm, optimizer="adam"),
    ]  # fmt: skip


def make_task(name: str):
    if name == "lm":
        return tasks.get("lm", size="tiny", context=64, batch_size=16)
    return tasks.get("digits")


def make_job(s: Setting, task) -> sw.Job:
    opt = sw.optim.adam(s.lr) if s.optimizer == "adam" else sw.optim.sgd(s.lr, momentum=0.9)
    kw = {} if s.codec is None else {"codec": s.codec}
    return sw.Job(task.init_params(0), optimizer=opt, consistency=s.consistency, **kw)


def time_to(records: list[dict], metric: str, target: float, mode: str) -> float | None:
    """The first time ``metric`` reaches ``target``, interpolated between evaluations."""
    prev = None
    for r in records:
        v = r.get(metric)
        if v is None or not math.isfinite(v):
            continue
        reached = v >= target if mode == "max" else v <= target
        if reached:
            if prev is None or prev[1] == v:
                return float(r["time"])
            t0, v0 = prev
            return float(t0 + (target - v0) / (v - v0) * (r["time"] - t0))
        prev = (float(r["time"]), float(v))
    return None


def figures(result, metric: str, target: float, mode: str) -> dict:
    return {
        "updates/s": result.stats["version"] / result.time,
        "staleness": result.stats["staleness_mean"],
        "time_to_target": time_to(result.records, metric, target, mode),
        "time": result.time,
    }


def run_setting(s: Setting, quick: bool, repeats: int) -> dict:
    task = make_task(s.task)
    job = make_job(s, task)
    steps = s.steps if quick else s.steps * 3 // 2
    metric, mode = "loss", "min"
    eval_interval = 0.05 if s.task == "digits" else 0.2
    common = dict(
        data=task.batches,
        evaluate=task.evaluate,
        workers=s.workers,
        steps=steps,
        stragglers=s.stragglers or None,
        delays=dict.fromkeys(range(s.workers), s.delay) if s.delay else None,
        eval_interval=eval_interval,
    )
    t0 = time.perf_counter()
    cal = job.calibrate(
        task.loss_and_grad, task.batches, workers=s.workers, repeats=repeats, delays=s.delay,
        evaluate=task.evaluate, eval_interval=eval_interval,
    )  # fmt: skip
    t_cal = time.perf_counter() - t0
    load = os.getloadavg()[0]
    local = job.train(task.loss_and_grad, **common)
    sim = job.train(task.loss_and_grad, runtime="sim", sim=cal.sim_config(), **common)
    measured = figures(local, metric, s.target, mode)
    predicted = figures(sim, metric, s.target, mode)
    row: dict[str, Any] = {"setting": s.name, "load": round(load, 2)}
    errors = {}
    for key in BARS:
        m, p = measured[key], predicted[key]
        row[f"{key} sim"] = p
        row[f"{key} local"] = m
        if m is None or p is None:
            err = None
        elif key == "staleness" and m < 1:
            err = abs(p - m) / STALENESS_ABS * BARS[key]  # scaled: <= the bar when within 0.15
        else:
            err = abs(p / m - 1)
        errors[key] = err
        row[f"{key} err"] = err
    row["ok"] = all(e is not None and e <= BARS[k] for k, e in errors.items())
    row["calibrate_s"] = t_cal
    row["table"] = cal.table()
    print(
        f"  {s.name}: updates/s {_f(predicted['updates/s'])}/{_f(measured['updates/s'])}, "
        f"staleness {_f(predicted['staleness'])}/{_f(measured['staleness'])}, "
        f"time to target {_f(predicted['time_to_target'])}/{_f(measured['time_to_target'])} "
        f"(sim/local; load {load:.2f}, calibration {t_cal:.1f} s)",
        flush=True,
    )
    return row


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="2/3 of the steps, fewer calibration repeats"
    )
    ap.add_argument("--only", help="run the settings whose name contains this text")
    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "sim_fidelity")
    chosen = [s for s in settings() if args.only is None or args.only in s.name]
    if not chosen:
        ap.error(f"--only: no setting's name contains {args.only!r}")
    repeats = 15 if args.quick else 40
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"on {os.cpu_count()} cores")  # fmt: skip
    t0 = time.perf_counter()
    rows = [run_setting(s, args.quick, repeats) for s in chosen]
    cols = ["setting", "load"] + [f"{k} {w}" for k in BARS for w in ("sim", "local", "err")]
    print(report.format_table(rows, [*cols, "ok"]))
    bars = []
    for key, limit in BARS.items():
        errs = [r[f"{key} err"] for r in rows]
        worst = None if any(e is None for e in errs) else max(errs)
        bars.append(_report.bar(f"{key}: worst relative error", worst, "<=", limit))
    print()
    for b in bars:
        worst = "none reached" if b["value"] is None else f"{b['value']:.3f}"
        print(f"bar: {b['name']} {b['bar']}: {worst} -> {'met' if b['met'] else 'MISSED'}")
    missed = [r["setting"] for r in rows if not r["ok"]]
    print("settings missing a bar: " + (", ".join(missed) if missed else "none"))
    print(f"(staleness below 1 version: within {STALENESS_ABS} versions counts as within 15%)")
    print(f"total {time.perf_counter() - t0:.0f} s; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    _report.write(out, {"quick": args.quick, "repeats": repeats, "rows": rows}, bars=bars)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
