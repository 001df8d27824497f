"""Throughput under a straggler: ASP vs SSP(4) vs BSP on the local runtime.

4 local workers, 20 ms of emulated compute per step, the last worker 4x slower
(80 ms). The ideal asynchronous rate is the sum of the workers' rates:
3/0.020 + 1/0.080 = 162.5 pushes/s. Prints pushes applied per second and the
efficiency against that ideal, at 1M and 10k float32 parameters.

Bar: ASP at least 0.9 of ideal at 1M and at 10k parameters. ``--check`` also writes
the figures to ``runs/bench-stragglers.json`` (or ``--json PATH``).

    .venv/bin/python benchmarks/stragglers.py [--check] [--sizes 1000000 10000] [--seconds 6]
        [--json PATH]
"""

import argparse
import sys

import _report
import numpy as np

import stalewise as sw

COMPUTE, SLOWDOWN, WORKERS = 0.020, 4.0, 4
IDEAL = (WORKERS - 1) / COMPUTE + 1 / (COMPUTE * SLOWDOWN)
_GRADS: dict[int, dict] = {}


def emulated_step(params, batch):
    """Returns a fixed small gradient at once; the compute time is emulated by the runtime's delay."""
    n = params["w"].size
    if n not in _GRADS:
        _GRADS[n] = {"w": np.full(n, 1e-6, np.float32)}
    return 0.0, _GRADS[n]


def no_data(worker, workers):
    while True:
        yield None


def measure(size: int, consistency, seconds: float) -> dict:
    job = sw.Job(
        {"w": np.zeros(size, np.float32)}, optimizer=sw.optim.sgd(0.01), consistency=consistency
    )
    steps = int(IDEAL * seconds * (0.35 if consistency.kind == "bsp" else 1.0))
    r = job.train(
        emulated_step,
        data=no_data,
        workers=WORKERS,
        steps=steps,
        stragglers={WORKERS - 1: SLOWDOWN},
        delays=dict.fromkeys(range(WORKERS), COMPUTE),
        eval_interval=1.0,
    )
    rate = r.pushes / r.time
    return {
        "params": size,
        "consistency": str(consistency),
        "pushes/s": rate,
        "updates/s": r.stats["version"] / r.time,
        "efficiency": rate / IDEAL,
        "staleness_mean": r.stats["staleness_mean"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000])
    ap.add_argument("--seconds", type=float, default=6.0, help="approximate length of each ASP run")
    ap.add_argument("--check", action="store_true", help="exit 1 if the bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "stragglers")
    from stalewise.report import format_table

    rows = [
        measure(n, c, args.seconds) for n in args.sizes for c in (sw.ASP(), sw.SSP(4), sw.BSP())
    ]
    print(
        f"ideal asynchronous rate: {IDEAL:.1f} pushes/s (3 workers at {COMPUTE * 1e3:.0f} ms, 1 at {COMPUTE * SLOWDOWN * 1e3:.0f} ms)"
    )
    print(format_table(rows, list(rows[0])))
    asp = [r for r in rows if r["consistency"] == "ASP"]
    ok = all(r["efficiency"] >= 0.9 for r in asp)
    print(
        "\nbar: ASP efficiency >= 0.90 at every size:",
        "met" if ok else "MISSED",
        "(" + ", ".join(f"{r['params']:,}: {r['efficiency']:.3f}" for r in asp) + ")",
    )
    bars = [
        _report.bar(f"ASP efficiency at {r['params']:,}", r["efficiency"], ">=", 0.9) for r in asp
    ]
    _report.write(out, {"ideal_pushes_per_s": IDEAL, "rows": rows}, bars=bars)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
