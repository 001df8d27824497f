"""Model averaging against gradient pushes: time to 95% held-out accuracy and bytes pushed.

Two settings, each on scikit-learn's digits MLP (real gradients):

* **local**: 4 worker processes, 8 ms of emulated compute per local step, the
  last worker 4x slower, wall time;
* **sim**: 64 simulated workers, 0.2 s per local step, 1 Gbit/s links, every
  push and pull the size of a 100M-parameter float32 model (``model_bytes``),
  virtual time.

Every strategy gets the same small grid of learning rates (the server's for
``gradients()``, the inner optimizer's otherwise) and is reported at its best
(the earliest to reach 95%); bytes pushed are the pushes times the model's
bytes. Prints a table per setting, the bars, and writes a plot of accuracy
against time and against bytes pushed (``--out``, default ``docs/averaging.png``).

Bars (issue #8):

* DiLoCo (H = 20) ends within 0.5 points of synchronous ``gradients()``'s final
  accuracy for the same number of local steps, pushing at least H times fewer bytes per
  local step (local);
* asynchronous DiLoCo reaches 95% in at most 0.6x the time of synchronous DiLoCo (local);
* ``adaptive`` reaches 95% in at most 1.1x the time of the best fixed H in {1, 4, 16, 64} (local);
* local SGD and DiLoCo reach 95% in at most 1/5 the virtual time of ``gradients()`` (sim).

    .venv/bin/python benchmarks/averaging.py [--setting local|sim|both] [--check] [--out PNG]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import stalewise as sw
from stalewise import report, tasks
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed, Network

TARGET = 0.95
WORKERS, SLOWDOWN, DELAY = 4, 4.0, 0.008
SIM_WORKERS, MODEL_BYTES = 64, 400_000_000
SIM = SimConfig(compute=Fixed(0.2), network=Network(latency=1e-3, bandwidth=1.25e8),
                model_bytes=MODEL_BYTES)  # fmt: skip
LRS = {"gradients": (0.01, 0.03, 0.1), "inner": (0.003, 0.01, 0.03)}


def lamb(lr):
    return sw.optim.lamb(lr, max_trust_ratio=10.0)


def strategies(setting: str) -> list[tuple]:
    """(name, lrs, make(lr) -> Job keywords) of each run in a setting."""
    asp, bsp, inv = sw.ASP(), sw.BSP(), sw.staleness.inverse()
    W = WORKERS if setting == "local" else SIM_WORKERS
    runs = [
        ("gradients BSP", LRS["gradients"], lambda lr: dict(optimizer=lamb(lr), consistency=bsp)),
        ("gradients ASP", LRS["gradients"],
         lambda lr: dict(optimizer=lamb(lr), consistency=asp, staleness=inv)),
        ("local_sgd H=16 ASP", LRS["inner"],
         lambda lr: dict(strategy=sw.strategies.local_sgd(steps=16, inner=lamb(lr)), consistency=asp,
                         staleness=inv)),
        ("diloco H=20 BSP", LRS["inner"],
         lambda lr: dict(strategy=sw.strategies.diloco(steps=20, inner=sw.optim.adamw(lr)),
                         consistency=bsp)),
        ("diloco H=20 async", LRS["inner"],
         lambda lr: dict(strategy=sw.strategies.diloco(steps=20, inner=sw.optim.adamw(lr),
                                                       asynchronous=True, every=W),
                         consistency=asp)),
    ]  # fmt: skip
    if setting == "local":
        runs += [
            (f"local_sgd H={h} BSP", LRS["inner"],
             lambda lr, h=h: dict(strategy=sw.strategies.local_sgd(steps=h, inner=lamb(lr)),
                                  consistency=bsp))
            for h in (1, 4, 16, 64)
        ] + [
            ("adaptive BSP", LRS["inner"],
             lambda lr: dict(strategy=sw.strategies.adaptive(lamb(lr), start=64), consistency=bsp)),
            ("easgd a=0.5 tau=8 ASP", LRS["inner"],
             lambda lr: dict(strategy=sw.strategies.easgd(0.5, every=8, inner=lamb(lr)),
                             consistency=asp)),
        ]  # fmt: skip
    return runs


def run_one(setting: str, name: str, make, lr: float, local_steps: int) -> dict:
    """One run; ``local_steps`` is the budget in local steps of all workers."""
    task = tasks.get("digits")
    kw = make(lr)
    job = sw.Job(task.init_params(0), **kw)
    h = getattr(job.strategy, "steps", 1) or 1
    if "adaptive" in name:
        h = 16  # an average period, only to size the push budget
    common = dict(data=task.batches, evaluate=task.evaluate, steps=max(local_steps // h, 4),
                  stop_at={"accuracy": 0.97}, run=f"{name} lr={lr:g}")  # fmt: skip
    if setting == "local":
        result = job.train(task.loss_and_grad, workers=WORKERS, eval_interval=0.1,
                           stragglers={WORKERS - 1: SLOWDOWN},
                           delays=dict.fromkeys(range(WORKERS), DELAY), timeout=300, **common)  # fmt: skip
    else:
        result = job.train(task.loss_and_grad, workers=SIM_WORKERS, runtime="sim", sim=SIM,
                           eval_interval=20.0, **common)  # fmt: skip
    model_bytes = MODEL_BYTES if setting == "sim" else job.config.spec.nbytes
    for rec in result.records:
        rec["bytes_pushed"] = rec["pushes"] * model_bytes
    return {
        "run": name,
        "lr": lr,
        "time_to_95%": report.time_to_target(result.records, "accuracy", TARGET),
        "final_accuracy": result.records[-1].get("accuracy"),
        "pushes": result.pushes,
        "bytes_pushed": result.pushes * model_bytes,
        "time": result.time,
        "records": result.records,
    }


def best(rows: list[dict]) -> dict:
    """The run that reached the target first (or, if none did, the most accurate)."""
    reached = [r for r in rows if r["time_to_95%"] is not None]
    if reached:
        return min(reached, key=lambda r: r["time_to_95%"])
    return max(rows, key=lambda r: r["final_accuracy"] or 0.0)


def bench(setting: str, budget: int) -> dict[str, dict]:
    results = {}
    for name, lrs, make in strategies(setting):
        rows = [run_one(setting, name, make, lr, budget) for lr in lrs]
        results[name] = b = best(rows)
        print(
            f"  {name:24s} best lr {b['lr']:<6g} time to 95% {b['time_to_95%']}, "
            f"final {b['final_accuracy']:.3f}",
            flush=True,
        )
    return results


def table(results: dict[str, dict], unit: str) -> str:
    cols = ["run", "lr", f"time_to_95%_{unit}", "final_accuracy", "pushes", "MB_pushed"]
    rows = [
        {
            "run": r["run"],
            "lr": r["lr"],
            f"time_to_95%_{unit}": r["time_to_95%"],
            "final_accuracy": r["final_accuracy"],
            "pushes": r["pushes"],
            "MB_pushed": r["bytes_pushed"] / 1e6,
        }
        for r in results.values()
    ]
    return report.format_table(rows, cols)


def ratio(a, b) -> float:
    return a / b if a is not None and b else math.inf


def same_budget_accuracy(budget: int) -> tuple[dict, dict]:
    """DiLoCo H=20 vs synchronous gradients(), both for ``budget`` local steps, no early stop."""
    task = tasks.get("digits")
    out = []
    for kw, steps in (
        (dict(optimizer=lamb(0.01), consistency=sw.BSP()), budget),
        (dict(strategy=sw.strategies.diloco(steps=20, inner=sw.optim.adamw(0.003)),
              consistency=sw.BSP()), budget // 20),
    ):  # fmt: skip
        job = sw.Job(task.init_params(0), **kw)
        r = job.train(task.loss_and_grad, data=task.batches, evaluate=task.evaluate,
                      workers=WORKERS, steps=steps, eval_interval=1.0,
                      delays=dict.fromkeys(range(WORKERS), DELAY), timeout=300)  # fmt: skip
        h = getattr(job.strategy, "steps", 1)
        out.append({"final_accuracy": r.records[-1]["accuracy"], "pushes": r.pushes,
                    "local_steps": r.pushes * h, "bytes": r.pushes * job.config.spec.nbytes})  # fmt: skip
    return out[0], out[1]


def plot(sections: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sections), 2, figsize=(12, 4.2 * len(sections)), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for row, (setting, results) in zip(axes, sections.items(), strict=True):
        unit = "virtual s" if setting == "sim" else "s"
        for i, r in enumerate(results.values()):
            recs = [x for x in r["records"] if "accuracy" in x]
            for ax, key in zip(row, ("time", "bytes_pushed"), strict=True):
                ax.plot([x[key] for x in recs], [x["accuracy"] for x in recs], label=r["run"],
                        color=colors[i % len(colors)], linewidth=1.2)  # fmt: skip
        reached = [r["time_to_95%"] for r in results.values() if r["time_to_95%"] is not None]
        if reached:  # the interesting part: up to twice the slowest time to the target
            row[0].set_xlim(0, 2 * max(reached))
        for ax, label in zip(row, (f"time ({unit})", "bytes pushed"), strict=True):
            ax.axhline(TARGET, color="0.3", linestyle="--", linewidth=1.0)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out accuracy")
            ax.set_ylim(0.5, 1.0)
            ax.set_title(f"{setting}: accuracy against {label}")
        row[1].set_xscale("log")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", choices=("local", "sim", "both"), default="both")
    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "averaging.png")
    )
    args = ap.parse_args()
    bars: list[tuple[str, bool, str]] = []
    sections = {}
    if args.setting in ("sim", "both"):
        print(f"sim: {SIM_WORKERS} workers, 1 Gbit/s links, 100M-parameter pushes", flush=True)
        res = sections["sim"] = bench("sim", budget=64 * 400)
        print(table(res, "virtual_s"))
        grad = min((res[k]["time_to_95%"] or math.inf) for k in ("gradients BSP", "gradients ASP"))
        for k in ("local_sgd H=16 ASP", "diloco H=20 BSP", "diloco H=20 async"):
            r = ratio(res[k]["time_to_95%"], grad)
            bars.append((f"sim: {k} / best gradients() time to 95%", r <= 0.2, f"{r:.3f} (<= 0.2)"))
    if args.setting in ("local", "both"):
        print(
            f"local: {WORKERS} workers, {DELAY * 1e3:g} ms steps, one {SLOWDOWN:g}x slower",
            flush=True,
        )
        res = sections["local"] = bench("local", budget=4000)
        print(table(res, "s"))
        r = ratio(res["diloco H=20 async"]["time_to_95%"], res["diloco H=20 BSP"]["time_to_95%"])
        bars.append(
            ("local: async DiLoCo / sync DiLoCo time to 95%", r <= 0.6, f"{r:.2f} (<= 0.6)")
        )
        fixed = min(
            (res[f"local_sgd H={h} BSP"]["time_to_95%"] or math.inf) for h in (1, 4, 16, 64)
        )
        r = ratio(res["adaptive BSP"]["time_to_95%"], fixed)
        bars.append(("local: adaptive / best fixed H time to 95%", r <= 1.1, f"{r:.2f} (<= 1.1)"))
        g, d = same_budget_accuracy(2000)
        gap = (g["final_accuracy"] - d["final_accuracy"]) * 100
        # per local step: the budget may overshoot by up to workers - 1 pushes
        fewer = (g["bytes"] / g["local_steps"]) / (d["bytes"] / d["local_steps"])
        bars.append((
            "local: DiLoCo H=20 vs sync gradients(), 2000 local steps each",
            gap <= 0.5 and fewer >= 20,
            f"accuracy {d['final_accuracy']:.4f} vs {g['final_accuracy']:.4f} (DiLoCo "
            f"{'behind' if gap > 0 else 'ahead'} by {abs(gap):.2f} points; bar: at most 0.5 behind), {fewer:.1f}x fewer bytes per local step (bar >= 20; "
            f"{g['pushes']} vs {d['pushes']} pushes)",
        ))  # fmt: skip
    plot(sections, Path(args.out))
    print(f"\nplot: {args.out}\n")
    for name, ok, detail in bars:
        print(f"bar: {name}: {detail} -> {'met' if ok else 'MISSED'}")
    return 0 if all(ok for _, ok, _ in bars) or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
