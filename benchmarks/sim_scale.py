"""How fast the simulator runs: events per second, and how wall time grows with workers.

The main run: 1024 simulated workers on least squares with 10,000 parameters,
ASP with inverse staleness, 20,000 applied updates (the issue asks for < 60 s).
Then the same job with 64, 128, ..., 1024 workers and a fixed number of
updates: wall time should follow the event count (constant per update), not
the number of workers, let alone its square.

Every worker's minibatch has 2 rows, so a gradient costs the same at every
worker count and the scaling shows the simulator's own cost. Last, SSP(4) and
BSP at the largest worker count show what the gates cost (``Shard.min_clock``
and the BSP round check are O(1) amortised per gated pull or applied push).

Run: ``.venv/bin/python benchmarks/sim_scale.py [--updates 20000] [--scaling-updates 5000]
[--json PATH]``
"""

from __future__ import annotations

import argparse
import time

import _report

import stalewise as sw
from stalewise import tasks
from stalewise.runtime import sim


def run_once(task, workers: int, updates: int, consistency=None) -> dict:
    job = sw.Job(
        task.init_params(),
        optimizer=sw.optim.sgd(2e-3),
        consistency=consistency or sw.ASP(),
        staleness=sw.staleness.inverse(),
    )
    t0 = time.perf_counter()
    result = sim.train(
        job.config,
        task.loss_and_grad,
        data=task.batches,
        workers=workers,
        steps=updates,
        strategy=job.strategy,
        evaluate=task.evaluate,
        eval_interval=1.0,
    )
    wall = time.perf_counter() - t0
    s = result.stats
    return {
        "workers": workers,
        "updates": s["version"],
        "events": s["sim"]["events"],
        "wall_s": wall,
        "events_per_s": s["sim"]["events"] / wall,
        "virtual_s": result.time,
        "staleness_mean": s["staleness_mean"],
        "loss0": result.records[0]["loss"],
        "loss": result.records[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--updates", type=int, default=20_000)
    parser.add_argument("--scaling-updates", type=int, default=5_000)
    parser.add_argument("--dim", type=int, default=10_000)
    _report.add_json_arg(parser)
    args = parser.parse_args()
    out = _report.json_path(parser, args, "sim_scale")

    n = max(2048, 2 * args.workers)  # every worker needs its own rows
    task = tasks.get("least-squares", n=n, d=args.dim, batch_size=2)
    task.evaluate(task.init_params())  # generate the data outside the timings
    run_once(task, 8, 200)  # warm up the optimizer kernels

    m = run_once(task, args.workers, args.updates)
    print(f"{m['workers']} workers, {args.dim} parameters, ASP + inverse staleness:")
    print(f"  {m['updates']} updates, {m['events']} events in {m['wall_s']:.1f} s wall")
    print(f"  {m['events_per_s']:,.0f} events/s, {m['updates'] / m['wall_s']:,.0f} updates/s")
    print(f"  {m['virtual_s']:.3f} virtual s, mean staleness {m['staleness_mean']:.0f}")
    print(f"  loss {m['loss0']:.4g} -> {m['loss']:.4g}")
    print(f"  limit 60 s: {'OK' if m['wall_s'] < 60 else 'TOO SLOW'}")

    print(f"\nscaling, {args.scaling_updates} updates each (ratios against the first row):")
    rows = []
    w = 64
    while w <= args.workers:
        rows.append(run_once(task, w, args.scaling_updates))
        w *= 2
    first = rows[0]
    head = ("workers", "events", "wall s", "events/s", "x workers", "x events", "x wall")
    print("".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = (
            f"{r['workers']}",
            f"{r['events']}",
            f"{r['wall_s']:.2f}",
            f"{r['events_per_s']:,.0f}",
            f"{r['workers'] / first['workers']:.0f}",
            f"{r['events'] / first['events']:.2f}",
            f"{r['wall_s'] / first['wall_s']:.2f}",
        )
        print("".join(f"{c:>10}" for c in cells))

    print(f"\ngates at {args.workers} workers, {args.scaling_updates} pushes each:")
    gates = {}
    for cons in (sw.SSP(4), sw.BSP()):
        r = gates[str(cons)] = run_once(task, args.workers, args.scaling_updates, cons)
        print(
            f"  {cons!s:>6}: {r['wall_s']:.2f} s wall, {r['events_per_s']:,.0f} events/s "
            f"({r['wall_s'] / rows[-1]['wall_s']:.2f} x ASP), {r['updates']} updates"
        )
    _report.write(
        out,
        {"main": m, "scaling": rows, "gates": gates},
        bars=[
            _report.bar(
                f"{m['workers']} workers, {m['updates']} updates, wall s", m["wall_s"], "<=", 60
            )
        ],
    )


if __name__ == "__main__":
    main()
