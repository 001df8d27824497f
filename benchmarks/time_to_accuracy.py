"""Time to 95% held-out accuracy in the demo's setting: asynchronous vs synchronous.

The demo's two runs (BSP, then ASP with inverse staleness; LAMB on the server;
the digits MLP, 4 local workers, the last one 4x slower), each at every learning
rate of a small grid (``--lrs``, default 0.003 0.01 0.03), ``--repeats`` times,
the runs of a repeat in turn. For each run and learning rate it takes the median
time to 95% (a run that never gets there counts as infinite); each consistency
model is then taken at its best learning rate, and the ratio asynchronous /
synchronous is the ratio of those two medians. It also prints the ratio at the
demo's one shared learning rate (0.01, when in the grid), the figure
``stalewise demo`` shows.

Bar: asynchronous training, each model at its best learning rate, reaches 95% in
at most 0.6x the wall time of synchronous. ``--check`` exits 1 if it is missed and
writes the figures to ``runs/bench-time_to_accuracy.json`` (or ``--json PATH``).

    .venv/bin/python benchmarks/time_to_accuracy.py [--repeats 3] [--lrs 0.003 0.01 0.03]
        [--quick] [--check] [--json PATH]

``--quick``: one repeat (6 runs, about a minute on an idle 2-core machine).
"""

import argparse
import math
import statistics
import sys

import _report

from stalewise import demo

BAR = 0.6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--lrs", type=float, nargs="+", default=[0.003, 0.01, 0.03], help="LAMB learning rates"
    )
    ap.add_argument("--quick", action="store_true", help="one repeat")
    ap.add_argument("--check", action="store_true", help="exit 1 if the bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    if repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {repeats}")
    for lr in args.lrs:
        if not (math.isfinite(lr) and lr > 0):
            ap.error(f"--lrs: every learning rate must be a finite number > 0, got {lr!r}")
    out = _report.json_path(ap, args, "time_to_accuracy")
    names = [name for name, _, _ in demo.runs()]
    times: dict[tuple[str, float], list[float]] = {(n, lr): [] for n in names for lr in args.lrs}
    rows = []
    for i in range(repeats):
        for lr in args.lrs:
            for name, consistency, staleness in demo.runs():
                row, _ = demo.train_one(name, consistency, staleness, lr=lr)
                t = row["time_to_95%_s"]
                times[name, lr].append(math.inf if t is None else t)
                rows.append({"repeat": i, "lr": lr} | row)
                print(
                    f"repeat {i}, lr {lr:g}, {name}: time to 95% {t} s, "
                    f"final accuracy {row['final_accuracy']:.4f}",
                    flush=True,
                )
    median = {key: statistics.median(v) for key, v in times.items()}
    sync_name, async_name = names[0], names[-1]
    best = {n: min(args.lrs, key=lambda lr, n=n: median[n, lr]) for n in names}
    print(f"\nmedian time to 95% (s) over {repeats} repeat(s):")
    print("lr        " + "".join(f"{n:>28}" for n in names))
    for lr in args.lrs:
        cells = "".join(f"{median[n, lr]:>27.3f}{'*' if best[n] == lr else ' '}" for n in names)
        print(f"{lr:<10g}{cells}")
    print("(* each model's best learning rate)")

    def ratio(lr_async: float, lr_sync: float) -> float:
        a, s = median[async_name, lr_async], median[sync_name, lr_sync]
        return a / s if math.isfinite(a) and math.isfinite(s) else math.nan

    tuned = ratio(best[async_name], best[sync_name])
    shared = ratio(demo.LR, demo.LR) if demo.LR in args.lrs else math.nan
    b = _report.bar("async / sync time to 95%, each at its best lr", tuned, "<=", BAR)
    print(
        f"\nasync / sync time to 95%, each at its best learning rate "
        f"(sync {best[sync_name]:g}, async {best[async_name]:g}): {tuned:.2f} (bar <= {BAR}) ->",
        "met" if b["met"] else "MISSED",
    )
    if demo.LR in args.lrs:
        print(f"at the demo's one shared learning rate ({demo.LR:g}): {shared:.2f}")
    _report.write(
        out,
        {
            "repeats": repeats,
            "lrs": args.lrs,
            "best_lr": best,
            "median_time_to_95_s": [
                {"run": n, "lr": lr, "median_s": median[n, lr]} for n in names for lr in args.lrs
            ],
            "ratio_tuned": tuned,
            "ratio_shared_lr": shared,
            "shared_lr": demo.LR,
            "runs": rows,
        },
        bars=[b],
    )
    return 0 if b["met"] or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
