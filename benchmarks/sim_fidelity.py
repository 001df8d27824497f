"""How far to trust the simulator: real local runs beside their calibrated simulations.

For each setting (workers, consistency model, a straggler, a codec; the digits
MLP and the byte-level GPT of ``tasks.get("lm")``), this script

1. calibrates the simulator on this machine for that job (``stalewise.calibrate``:
   compute times of the task's real steps in as many processes as the run has
   workers, with the run's held-out evaluation every ``eval_interval`` beside them
   as the local run's parent makes it, the shard's apply time, the local runtime's
   pull and push times, and how much slower a step and an apply run with 1, 2, ...
   processes runnable: the simulator's contention model);
2. runs the job on the local runtime (real processes, wall time), ``RUNS`` times: the
   measured figures are the medians of the runs' (each run's are in the JSON);
3. runs the same job in the simulator with the calibrated ``[sim]`` table (the
   same stragglers and emulated delays), and again with two variants of it,
   whose figures count toward no bar: "wall spread" (the compute's spread from
   the wall clock, ``Calibration.wall_spread``) and "no contention" (the
   table less its contention model, the compute fitted to the wall-clock step
   times, as ``calibrate(contention=False)`` makes it), and
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

The 7 fixed settings are the regression set (the default). ``--random N --seed S``
instead draws N settings from this space (each draw uniform unless said); without
``--seed`` the seed is drawn from the clock (printed and recorded), and ``--seeds K``
runs K such seeds, each once, into one JSON (``runs``: each seed's rows):

* workers 2-8; shards 1-3;
* consistency ASP, SSP (bound 1-4), BSP or Hybrid (tolerance 2);
* stragglers 0-2 (at most workers - 1; the last workers), each slowed 1.5-4x;
* parameters 10k-1M, log-uniform: the digits MLP (64 -> hidden -> 10) with
  ``hidden = round((parameters - 10) / 75)``, 133-13333;
* codec none, fp16, int8 or topk(0.1), each 1 in 4;
* gradient pushes (SGD, lr 0.003, momentum 0.9) or DiLoCo (inner AdamW 1e-3,
  2-8 local steps a push; asynchronous under ASP/SSP, synchronous under
  BSP/Hybrid), each 1 in 2;
* emulated compute 0-20 ms a step, every worker.

Records every 50 ms, with a held-out evaluation about every 50 ms (up to 250 ms for the
widest MLPs, whose evaluation takes tens of ms; so in the calibration), and besides at the
first record whose parameters moved after a still one (:class:`Evaluations`): a DiLoCo
round's outer update, after which the loss drops at once, is placed within 50 ms in both
runtimes alike, not within a whole evaluation interval.

Each is calibrated (15 repeats), run locally ``RUNS`` times for about ``RANDOM_SECONDS`` of
wall time each (its push budget is the calibrated simulation's pushes/s times that,
at least 10 pushes a worker and at most 3000; a shorter run leaves a Hybrid
run's mode to its first rounds), and simulated on the calibrated table and on
its low and high tables (``Calibration.interval``: every measured time at its 25th and 75th
percentile over the repeats), so every prediction is ``point [low, high]``. The
target of the time to target is the loss halfway from the first evaluation's to
the first local run's lowest (a run that does not improve has no time to target: that
bar is missed). Bar: at least 8 in 10 of the settings (``ceil(0.8 N)``) meet all
three bars; ``--check`` exits 1 otherwise.

``--runtime ray`` calibrates the Ray runtime (``calibrate(runtime="ray")``) and runs
the fixed settings on it, on a new local Ray instance of this machine's cores, beside
their simulations: the rows' "local" figures are then the runs on Ray.

``--replay JSON`` re-simulates the rows of a JSON this wrote on the tables stored in it
(equal to the calibrated ones within the table's rounding) and compares them with the
local figures stored in it: a change to the simulator is judged on quiet measurements in
seconds, on any machine, at any load. (A JSON from before records every 50 ms holds real
times to target on the coarser grid: replayed, its time to target compares unlike figures.)

    .venv/bin/python benchmarks/sim_fidelity.py [--quick] [--check] [--json PATH]
    .venv/bin/python benchmarks/sim_fidelity.py --random 10 [--seed 1 | --seeds 5] [--check]
    .venv/bin/python benchmarks/sim_fidelity.py --runtime ray --only "digits 2w ASP"
    .venv/bin/python benchmarks/sim_fidelity.py --replay benchmarks/results/sim_fidelity-random1.json
    .venv/bin/python benchmarks/sim_fidelity.py --random 10 --seed 7 --only "[3] "  # one of them
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _report
import numpy as np

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


def median_figures(runs: list[dict]) -> dict:
    """Each figure's median over repeated local runs of a setting (a time to target that
    half the runs or more did not reach: None)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        xs = [r[key] for r in runs if r[key] is not None]
        out[key] = float(np.median(xs)) if 2 * len(xs) > len(runs) else None
    return out


def setting_run(s: Setting, quick: bool) -> tuple[Any, sw.Job, dict]:
    """Setting ``s``'s task, job and ``job.train`` options (besides the runtime)."""
    task = make_task(s.task)
    steps = s.steps if quick else s.steps * 3 // 2
    eval_interval = 0.05 if s.task == "digits" else 0.2
    return (
        task,
        make_job(s, task),
        dict(
            data=task.batches,
            evaluate=task.evaluate,
            workers=s.workers,
            steps=steps,
            emulation=sw.Emulation(
                stragglers=s.stragglers or None,
                delays=dict.fromkeys(range(s.workers), s.delay) if s.delay else None,
            ),
            metrics=sw.Metrics(every=eval_interval),
        ),
    )


def run_setting(s: Setting, quick: bool, repeats: int, runtime: str = "local") -> dict:
    """Calibrates the runtime ``runtime`` for setting ``s``, runs it there and simulates it
    on the calibrated tables: one row (its "local" figures are the run on ``runtime``)."""
    task, job, common = setting_run(s, quick)
    metric, mode = "loss", "min"
    eval_interval = common["metrics"].every
    t0 = time.perf_counter()
    cal = job.calibrate(
        task.loss_and_grad, task.batches, workers=s.workers, repeats=repeats, delays=s.delay,
        evaluate=task.evaluate, eval_interval=eval_interval, contention=True, runtime=runtime,
    )  # fmt: skip
    t_cal = time.perf_counter() - t0
    load = os.getloadavg()[0]
    runs = [figures(job.train(task.loss_and_grad, runtime=runtime, **common), metric,
                    s.target, mode) for _ in range(RUNS)]  # fmt: skip
    measured = median_figures(runs)
    name = s.name if runtime == "local" else f"{s.name} on {runtime}"
    row: dict[str, Any] = {"setting": name, "load": round(load, 2), "runtime": runtime}
    for key in BARS:
        row[f"{key} local runs"] = [r[key] for r in runs]
    for suffix, table in tables(cal):
        sim = job.train(task.loss_and_grad, runtime=sw.Simulation(table.sim_config()), **common)
        predicted = figures(sim, metric, s.target, mode)
        row[f"table{suffix}"] = table.table()
        for key in BARS:
            row[f"{key} sim{suffix}"] = predicted[key]
            row[f"{key} local"] = measured[key]
            row[f"{key} err{suffix}"] = _error(key, predicted[key], measured[key])
        row[f"ok{suffix}"] = all(
            (e := row[f"{k} err{suffix}"]) is not None and e <= BARS[k] for k in BARS
        )
        print(
            f"  {name}{suffix}: updates/s {_f(predicted['updates/s'])}/"
            f"{_f(measured['updates/s'])}, staleness {_f(predicted['staleness'])}/"
            f"{_f(measured['staleness'])}, time to target {_f(predicted['time_to_target'])}/"
            f"{_f(measured['time_to_target'])} (sim/{runtime}; load {load:.2f}, calibration "
            f"{t_cal:.1f} s)",
            flush=True,
        )
    row["calibrate_s"] = t_cal
    return row


#: The suffixes of the figures of the tables simulated beside the calibrated one: the
#: compute's spread from the wall clock (``Calibration.wall_spread``), and without the
#: contention model (the compute fitted to the wall-clock step times).
WALL, PLAIN = " (wall spread)", " (no contention)"


def tables(cal) -> list[tuple[str, Any]]:
    """The calibration as measured (with the contention model: CPU times stretched by its
    factors), with the wall clock's spread, and without the contention model (wall-clock
    times), each with the suffix of its figures: all simulated against one local run."""
    return [("", cal), (WALL, dataclasses.replace(cal, wall_spread=True)),
            (PLAIN, dataclasses.replace(cal, contention=None))]  # fmt: skip


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


# -- settings drawn at random ---------------------------------------------------------

#: The space ``--random`` draws from (see the module docstring), as the code reads it.
SPACE = {
    "workers": (2, 8),
    "shards": (1, 3),
    "consistency": ("ASP", "SSP", "BSP", "Hybrid"),
    "ssp_bound": (1, 4),
    "stragglers": (0, 2),
    "slowdown": (1.5, 4.0),
    "parameters": (10_000, 1_000_000),
    "codec": (None, "fp16", "int8", "topk:0.1"),
    "strategy": ("gradients", "diloco"),
    "local_steps": (2, 8),
    "delay": (0.0, 0.020),
}
RANDOM_SECONDS = 4.0  # wall time of a random setting's local run, about
RANDOM_STEPS = (10, 3000)  # its push budget's bounds: pushes a worker, pushes in all
RANDOM_REPEATS = 15
RANDOM_SHARE = 0.8  # of the random settings must meet all three bars
#: Local runs of each setting: the measured figures are their medians (one run is noisy:
#: repeats of a random draw on a quiet machine moved two or three settings across a bar).
RUNS = 3


@dataclass(frozen=True)
class Drawn:
    """One setting drawn from :data:`SPACE`."""

    workers: int
    shards: int
    consistency: str
    bound: int  # SSP's staleness bound (0 for the others)
    stragglers: tuple[tuple[int, float], ...]  # (worker, slowdown)
    parameters: int
    hidden: int
    codec: str | None
    strategy: str
    local_steps: int  # DiLoCo's (1 for gradient pushes)
    delay: float  # seconds

    @property
    def eval_interval(self) -> float:
        """Seconds between held-out evaluations: 50 ms, longer for a wide MLP (whose
        evaluation is tens of ms), at most 250 ms."""
        return min(0.25, max(0.05, 0.05 * self.hidden / 1333))

    @property
    def name(self) -> str:
        cons = f"SSP({self.bound})" if self.consistency == "SSP" else self.consistency
        slow = "".join(f" w{w}x{f:g}" for w, f in self.stragglers)
        strat = f"diloco(H={self.local_steps})" if self.strategy == "diloco" else "grads"
        return (f"{self.workers}w {self.shards}s {cons}{slow} {self.parameters // 1000}k "
                f"{self.codec or 'raw'} {strat} {self.delay * 1e3:.1f}ms")  # fmt: skip


def draw(n: int, seed: int) -> list[Drawn]:
    """``n`` settings from :data:`SPACE`, the same for the same ``seed``."""
    rng = np.random.default_rng([seed, 31])
    out = []
    for _ in range(n):
        lo, hi = SPACE["workers"]
        workers = int(rng.integers(lo, hi + 1))
        shards = int(rng.integers(SPACE["shards"][0], SPACE["shards"][1] + 1))
        consistency = str(rng.choice(SPACE["consistency"]))
        bound = int(rng.integers(SPACE["ssp_bound"][0], SPACE["ssp_bound"][1] + 1))
        count = int(rng.integers(SPACE["stragglers"][0], SPACE["stragglers"][1] + 1))
        count = min(count, workers - 1)
        slow = [round(float(rng.uniform(*SPACE["slowdown"])), 2) for _ in range(count)]
        stragglers = tuple((workers - count + i, f) for i, f in enumerate(slow))
        lo, hi = SPACE["parameters"]
        target = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
        hidden = max(1, round((target - 10) / 75))
        codec = SPACE["codec"][int(rng.integers(len(SPACE["codec"])))]
        strategy = str(rng.choice(SPACE["strategy"]))
        h = int(rng.integers(SPACE["local_steps"][0], SPACE["local_steps"][1] + 1))
        delay = round(float(rng.uniform(*SPACE["delay"])), 4)
        out.append(Drawn(
            workers, shards, consistency, bound if consistency == "SSP" else 0, stragglers,
            75 * hidden + 10, hidden, codec, strategy, h if strategy == "diloco" else 1, delay,
        ))  # fmt: skip
    return out


def drawn_task(d: Drawn):
    return tasks.get("digits", hidden=d.hidden)


def drawn_job(d: Drawn, task) -> sw.Job:
    """The job of setting ``d`` (its params, consistency model, shards, codec, strategy)."""
    consistency = {"ASP": sw.ASP(), "BSP": sw.BSP(), "Hybrid": sw.Hybrid(2.0)}.get(
        d.consistency
    ) or sw.SSP(d.bound)
    kw: dict[str, Any] = {"consistency": consistency, "shards": d.shards}
    if d.codec is not None:
        kw["codec"] = (
            sw.codecs.topk(0.1) if d.codec == "topk:0.1" else getattr(sw.codecs, d.codec)()
        )
    params = task.init_params(0)
    if d.strategy == "diloco":
        asynchronous = d.consistency in ("ASP", "SSP")
        strategy = sw.strategies.diloco(
            local_steps=d.local_steps, inner=sw.optim.adamw(1e-3), asynchronous=asynchronous,
            every=d.workers if asynchronous else None,
        )  # fmt: skip
        return sw.Job(params, strategy=strategy, **kw)
    return sw.Job(params, optimizer=sw.optim.sgd(0.003, momentum=0.9), **kw)


#: Seconds between the records of a random setting, whatever its evaluation interval.
RECORD_EVERY = 0.05


class Evaluations:
    """``evaluate`` for records every :data:`RECORD_EVERY` s of a model evaluated about every
    ``interval`` s: a record whose parameters are those last evaluated repeats their figures;
    one whose parameters moved since the record before is evaluated at once unless that one's
    moved too (a change that follows a still record, as an outer update does, is placed
    within one record), in which case it waits for ``interval`` since the last evaluation
    (until then, no loss in the record); still parameters not yet evaluated are evaluated."""

    def __init__(self, evaluate, interval: float):
        self.evaluate, self.every = evaluate, max(1, round(interval / RECORD_EVERY))
        self.last: np.ndarray | None = None  # the parameters of the record before, flat
        self.figures: dict = {}
        self.since, self.moved, self.current = 0, False, False  # current: figures of `last`

    def __call__(self, params) -> dict:
        flat = sw.tree.flatten(params)[0]  # the first call has no record before it: still
        moved = self.last is not None and not np.array_equal(flat, self.last)
        self.since += 1
        if moved and self.moved and self.since < self.every:
            self.current = False
        elif moved or not self.current:
            self.figures, self.since, self.current = self.evaluate(params), 0, True
        self.last, self.moved = flat, moved
        return self.figures if self.current else {}


def drawn_run(d: Drawn, steps: int) -> dict:
    """``job.train``'s run options for setting ``d`` (besides the loss and the runtime)."""
    task = drawn_task(d)
    return dict(
        data=task.batches,
        evaluate=Evaluations(task.evaluate, d.eval_interval),
        workers=d.workers,
        steps=steps,
        emulation=sw.Emulation(
            stragglers=dict(d.stragglers) or None,
            delays=dict.fromkeys(range(d.workers), d.delay) if d.delay else None,
        ),
        metrics=sw.Metrics(every=RECORD_EVERY),
    )


def halfway_target(records: list[dict]) -> float | None:
    """The loss halfway from the first evaluation's to the lowest (None: no improvement)."""
    losses = [r["loss"] for r in records if r.get("loss") is not None and math.isfinite(r["loss"])]
    if len(losses) < 2 or min(losses) >= losses[0]:
        return None
    return losses[0] - 0.5 * (losses[0] - min(losses))


def run_drawn(i: int, d: Drawn, repeats: int = RANDOM_REPEATS) -> dict:
    """Calibrates, runs locally and simulates (point, low, high) setting ``d``: one row."""
    task = drawn_task(d)
    job = drawn_job(d, task)
    t0 = time.perf_counter()
    cal = job.calibrate(
        task.loss_and_grad, task.batches, workers=d.workers, repeats=repeats,
        delays=d.delay, evaluate=task.evaluate, eval_interval=d.eval_interval,
        contention=True,
    )  # fmt: skip
    t_cal = time.perf_counter() - t0
    # the push budget: about RANDOM_SECONDS of the run at the calibrated simulation's pace
    # (pushes per second: under BSP a version is a round of pushes)
    probe = job.train(task.loss_and_grad, runtime=sw.Simulation(cal.sim_config()),
                      **drawn_run(d, 20 * d.workers))  # fmt: skip
    pace = probe.pushes / probe.time if probe.time > 0 else 100.0  # pushes (not versions)/s
    steps = int(min(max(pace * RANDOM_SECONDS, RANDOM_STEPS[0] * d.workers), RANDOM_STEPS[1]))
    load = os.getloadavg()[0]
    locals_ = [job.train(task.loss_and_grad, **drawn_run(d, steps)) for _ in range(RUNS)]
    target = halfway_target(locals_[0].records)  # the first run's, for every run
    runs = [figures(r, "loss", -math.inf if target is None else target, "min") for r in locals_]
    measured = median_figures(runs)

    def predict(sim):
        r = job.train(task.loss_and_grad, runtime=sw.Simulation(sim), **drawn_run(d, steps))
        if target is None:
            return {**figures(r, "loss", -math.inf, "min"), "time_to_target": None}
        return figures(r, "loss", target, "min")

    got = cal.interval(predict)
    row: dict[str, Any] = {"#": i, "setting": d.name, "drawn": dataclasses.asdict(d),
                           "steps": steps, "load": round(load, 2), "target": target}  # fmt: skip
    for key in BARS:
        row[f"{key} local runs"] = [r[key] for r in runs]
    met = {}
    for key, limit in BARS.items():
        m, iv = measured[key], got.get(key)
        p = None if iv is None else iv.point
        row[f"{key} sim"] = None if iv is None else str(iv)
        row[f"{key} interval"] = None if iv is None else [iv.low, iv.high]
        row[f"{key} point"] = p
        row[f"{key} local"] = m
        err = _error(key, p, m)
        row[f"{key} err"] = err
        met[key] = err is not None and err <= limit
        row[f"{key} met"] = met[key]
    row["ok"] = all(met.values())
    for suffix, table in tables(cal)[1:]:  # the other tables' points
        other = predict(table.sim_config())
        for key, limit in BARS.items():
            row[f"{key} point{suffix}"] = p = other.get(key)
            row[f"{key} err{suffix}"] = err = _error(key, p, measured[key])
            row[f"{key} met{suffix}"] = err is not None and err <= limit
        row[f"ok{suffix}"] = all(row[f"{key} met{suffix}"] for key in BARS)
    row["calibrate_s"] = round(t_cal, 1)
    row["warnings"] = cal.warnings()
    row["table"] = cal.table()  # with the contention factors (contention_step, _apply)
    row["cpu over wall while calibrated"] = round(
        float(np.mean([x for t in cal.cpu_times for x in t]))
        / float(np.mean([x for t in cal.step_times for x in t])), 3)  # fmt: skip
    print(f"  [{i}] {d.name}: " + ", ".join(
        f"{k} {row[f'{k} sim'] or '-'} / {_f(row[f'{k} local'])} "
        f"({'met' if met[k] else 'MISSED'})" for k in BARS
    ) + f" (sim [interval] / local; {steps} pushes, load {load:.2f}, calibration {t_cal:.0f} s"
      + (f"; calibrate warned: {len(row['warnings'])}" if row["warnings"] else "") + ")"
      + "".join(f";{x}: " + ", ".join(
        f"{k} {_f(row[f'{k} point{x}'])} ({'met' if row[f'{k} met{x}'] else 'MISSED'})"
        for k in BARS) for x in (WALL, PLAIN)), flush=True)  # fmt: skip
    return row


def _error(key: str, p: float | None, m: float | None) -> float | None:
    """The relative error of ``p`` against ``m``; a staleness under 1 in absolute terms,
    scaled so that ``STALENESS_ABS`` versions is the bar."""
    if m is None or p is None:
        return None
    if key == "staleness" and m < 1:
        return abs(p - m) / STALENESS_ABS * BARS[key]
    return abs(p / m - 1) if m != 0 else None


def clock_seed() -> int:
    """A seed drawn from the clock (nanoseconds, below 2**32): a setting nobody tuned on."""
    return time.time_ns() % 2**32


def random_main(args: argparse.Namespace, out) -> int:
    """``--random N`` for one seed (``--seed``, else drawn from the clock) or for ``--seeds
    K`` seeds each drawn from the clock when its run begins; every seed's rows in the JSON."""
    print("the space: " + "; ".join(f"{k} {v}" for k, v in SPACE.items()))
    t0 = time.perf_counter()
    head = {"random": args.random, "space": SPACE, "seconds": RANDOM_SECONDS,
            "repeats": RANDOM_REPEATS, "seeds": []}  # fmt: skip
    bars: list[dict] = []
    for _ in range(args.seeds):
        seed = clock_seed() if args.seed is None else args.seed
        head["seeds"].append(seed)
        runs = head.setdefault("runs", [])
        runs.append({"seed": seed, "load_start": os.getloadavg(), "rows": []})
        print(f"\nseed {seed}{' (from the clock)' * (args.seed is None)}; load average at "
              f"start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} "
              "cores", flush=True)  # fmt: skip
        save = lambda: _report.write(out, head)  # noqa: E731
        bars.append(one_seed(args.random, seed, runs[-1], save, args.only))
        runs[-1]["load_end"] = os.getloadavg()
        _report.write(out, head, bars=bars)
    met = sum(b["met"] for b in bars)
    print(f"\nseeds {head['seeds']}: {met} of {len(bars)} meet the bar; total "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 1 if args.check and met < len(bars) else 0


def one_seed(n: int, seed: int, run: dict, save, only: str | None = None) -> dict:
    """Draws ``n`` settings from ``seed``, runs each (``only``: those whose ``[i] name``
    holds it) into ``run["rows"]`` (``save()`` after each); prints the table; returns the
    bar: ``ceil(RANDOM_SHARE * n)`` meet all three."""
    rows = run["rows"]
    for i, d in enumerate(draw(n, seed)):
        if only is not None and only not in f"[{i}] {d.name}":
            continue
        try:
            rows.append(run_drawn(i, d))
        except Exception as e:  # one setting's failure is reported, the others still run
            print(f"  [{i}] {d.name}: FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append({"#": i, "setting": d.name, "drawn": dataclasses.asdict(d),
                         "error": f"{type(e).__name__}: {e}", "ok": False})  # fmt: skip
        save()  # the settings so far, in case the run is cut short
    cols = ["#", "setting"] + [f"{k} {w}" for k in BARS for w in ("sim", "local", "err")]
    print(report.format_table(rows, [*cols, "ok"]))
    ok = sum(bool(r["ok"]) for r in rows)
    bar = _report.bar(f"seed {seed}: random settings meeting all three bars", ok, ">=",
                      math.ceil(RANDOM_SHARE * len(rows)))  # fmt: skip
    for suffix in ("", WALL, PLAIN):
        for key, limit in BARS.items():
            within = sum(bool(r.get(f"{key} met{suffix}")) for r in rows)
            print(f"{key}{suffix}: {within} of {len(rows)} within {limit:.0%}")
    print(f"\nbar: {bar['name']} {bar['bar']}: {ok} of {len(rows)} -> "
          f"{'met' if bar['met'] else 'MISSED'}; " + ", ".join(
          f"{x.strip(' ()')}: {sum(bool(r.get(f'ok{x}')) for r in rows)}" for x in (WALL, PLAIN)))  # fmt: skip
    missed = [f"[{r['#']}] {r['setting']}" for r in rows if not r["ok"]]
    print("settings missing a bar: " + (", ".join(missed) if missed else "none"))
    print(f"(staleness below 1 version: within {STALENESS_ABS} versions counts as within 15%)")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    return bar


def replay(path: str, only: str | None = None) -> int:
    """Re-simulates every row of a JSON this benchmark wrote on the table stored with it,
    against the local figures stored with it: no calibration, no local run, so a change
    of the simulator is judged at once on measurements taken on a quiet machine."""
    from stalewise.runtime.sim.config import SimConfig

    data = json.loads(Path(path).read_text())["figures"]
    rows = data.get("rows") or [r for run in data.get("runs", ()) for r in run["rows"]]
    rows = [r for r in rows if only is None or only in f"[{r.get('#')}] {r['setting']}"]
    ok = 0
    for r in rows:
        if "drawn" in r:
            d = Drawn(**{**r["drawn"], "stragglers": tuple(map(tuple, r["drawn"]["stragglers"]))})
            task = drawn_task(d)
            job, opts = drawn_job(d, task), drawn_run(d, r["steps"])
            target = -math.inf if r["target"] is None else r["target"]
        elif r.get("runtime", "local") == "local" and "table" in r:
            s = next(x for x in settings() if x.name == r["setting"])
            task, job, opts = setting_run(s, data["quick"])
            target = s.target
        else:
            continue  # a row of another runtime, or one that failed
        table = SimConfig.from_dict({k: v for k, v in r["table"].items() if v is not None})
        sim = job.train(task.loss_and_grad, runtime=sw.Simulation(table), **opts)
        got = figures(sim, "loss", target, "min")
        errs = {k: _error(k, got[k], r[f"{k} local"]) for k in BARS}
        met = {k: e is not None and e <= BARS[k] for k, e in errs.items()}
        ok += all(met.values())
        print(f"  {r['setting']}: " + ", ".join(
            f"{k} {_f(got[k])}/{_f(r[f'{k} local'])} ({'met' if met[k] else 'MISSED'})"
            for k in BARS) + " (sim now / local then)", flush=True)  # fmt: skip
    print(f"{ok} of {len(rows)} rows meet all three bars on the simulator as it is now")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="2/3 of the steps, fewer calibration repeats"
    )
    ap.add_argument("--only", help="run (or --replay) the settings whose name contains this "
                    "text; a drawn one's name begins with its index: --only '[3] '")  # fmt: skip
    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    ap.add_argument(
        "--random",
        type=int,
        metavar="N",
        help="N settings drawn from the stated space instead of the fixed 7",
    )
    ap.add_argument("--seed", type=int, help="the draw's seed (--random; default: the clock's)")
    ap.add_argument("--seeds", type=int, default=1, metavar="K",
                    help="--random for K seeds, each drawn from the clock, each run once")  # fmt: skip
    ap.add_argument(
        "--runtime",
        choices=("local", "ray"),
        default="local",
        help="the runtime calibrated and run beside the simulation (ray: a new local Ray "
        "instance of this machine's cores; the fixed settings only)",
    )
    ap.add_argument("--replay", metavar="JSON", help="re-simulate the rows of a JSON this wrote "
                    "on their stored tables, against their stored local figures")  # fmt: skip
    _report.add_json_arg(ap)
    args = ap.parse_args()
    if args.replay is not None:
        return replay(args.replay, args.only)
    if args.random is not None and args.random < 1:
        ap.error(f"--random: expected an integer >= 1, got {args.random}")
    if args.random is not None and args.runtime != "local":
        ap.error(f"--runtime {args.runtime}: the random settings run on the local runtime only")
    if args.seeds < 1 or (args.seeds > 1 and (args.seed is not None or args.random is None)):
        ap.error(f"--seeds {args.seeds}: expected an integer >= 1, with --random, without --seed")
    name = (
        "sim_fidelity"
        if args.random is None
        else f"sim_fidelity-random{'' if args.seed is None else args.seed}"
    )
    name += "" if args.runtime == "local" else f"-{args.runtime}"
    out = _report.json_path(ap, args, name)
    if args.random is not None:
        return random_main(args, out)
    chosen = [s for s in settings() if args.only is None or args.only in s.name]
    if not chosen:
        ap.error(f"--only: no setting's name contains {args.only!r}")
    repeats = 15 if args.quick else 40
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"on {os.cpu_count()} cores")  # fmt: skip
    t0 = time.perf_counter()
    if args.runtime == "ray":  # one instance for every calibration and run, stopped at the end
        from stalewise.runtime.ray import connect, import_ray

        connect("local", num_cpus=os.cpu_count())
        print("runtime ray: the 'local' columns are the runs on Ray")
    try:
        rows = [run_setting(s, args.quick, repeats, args.runtime) for s in chosen]
    finally:
        if args.runtime == "ray":
            import_ray().shutdown()
    bars = []
    for suffix in ("", WALL, PLAIN):
        cols = ["setting", "load"] + [
            f"{k} {w}" for k in BARS for w in (f"sim{suffix}", "local", f"err{suffix}")
        ]
        print(report.format_table(rows, [*cols, f"ok{suffix}"]))
        for key, limit in BARS.items():
            errs = [r[f"{key} err{suffix}"] for r in rows]
            worst = None if any(e is None for e in errs) else max(errs)
            b = _report.bar(f"{key}{suffix}: worst relative error", worst, "<=", limit)
            worst = "none reached" if b["value"] is None else f"{b['value']:.3f}"
            print(f"bar: {b['name']} {b['bar']}: {worst} -> {'met' if b['met'] else 'MISSED'}")
            bars += [b] if suffix == "" else []
        missed = [r["setting"] for r in rows if not r[f"ok{suffix}"]]
        print(f"settings missing a bar{suffix}: " + (", ".join(missed) if missed else "none"))
    print(f"(staleness below 1 version: within {STALENESS_ABS} versions counts as within 15%)")
    print(f"total {time.perf_counter() - t0:.0f} s; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    head = {"quick": args.quick, "repeats": repeats, "runtime": args.runtime}
    _report.write(out, {**head, "rows": rows}, bars=bars)
    return 1 if args.check and not all(b["met"] for b in bars) else 0


if __name__ == "__main__":
    sys.exit(main())
