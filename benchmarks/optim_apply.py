"""Speed of the in-place optimizer step, relative to one memcpy of the parameters.

For a flat float32 vector (10M parameters in 50 leaves by default) this times
each optimizer's ``apply`` and ``np.copyto`` of the same vector, alternately,
and prints the medians, the effective bandwidth (minimum traffic of the rule
over time) and the ratio to the memcpy. With ``--check`` it exits non-zero if
a ratio misses its bar, and writes the figures to ``runs/bench-optim_apply.json``
(or ``--json PATH``).

Run: ``.venv/bin/python benchmarks/optim_apply.py [--check] [--json PATH]``. The machine may
be shared: rerun before trusting a miss.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import _report
import numpy as np

from stalewise import optim
from stalewise.segments import Segments

# name -> (factory, vectors of the minimum traffic (reads + writes), bar as a multiple of memcpy)
CASES: dict[str, tuple[Callable[[], optim.Optimizer], int, float | None]] = {
    "sgd": (lambda: optim.sgd(1e-3), 3, None),  # r g,p; w p
    "sgd momentum": (lambda: optim.sgd(1e-3, momentum=0.9), 5, 3.0),  # r g,b,p; w b,p
    "adam": (lambda: optim.adam(1e-3), 7, None),  # r g,m,v,p; w m,v,p
    "adamw": (lambda: optim.adamw(1e-3), 7, None),
    "lamb": (lambda: optim.lamb(1e-3, weight_decay=0.01), 7, 6.0),
    "lars": (lambda: optim.lars(1e-3, weight_decay=1e-4), 5, None),
    "clip + lamb": (lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.lamb(1e-3)), 8, None),
}


def leaf_table(size: int, leaves: int, rng: np.random.Generator) -> Segments:
    """``leaves`` leaves of uneven sizes (within a factor of 3) summing to ``size``."""
    weights = rng.uniform(0.5, 1.5, size=leaves)
    sizes = np.floor(weights / weights.sum() * size).astype(np.int64)
    sizes[-1] += size - sizes.sum()
    return Segments.from_sizes([f"block{i}.weight" for i in range(leaves)], sizes)


def time_case(
    opt: optim.Optimizer, seg: Segments, g0: np.ndarray, p0: np.ndarray, repeats: int
) -> tuple[float, float]:
    """Median seconds of ``apply`` and of a memcpy of the parameters, timed alternately."""
    params, grads, dst = p0.copy(), g0.copy(), np.empty_like(p0)
    state = opt.init(params, seg)
    for _ in range(2):  # warm-up: JIT compile (or cache load), page faults
        opt.apply(grads, state, params)
        np.copyto(grads, g0)
    t_apply, t_copy = [], []
    for _ in range(repeats):
        np.copyto(grads, g0)  # apply uses grads as scratch
        t = time.perf_counter()
        np.copyto(dst, params)
        t_copy.append(time.perf_counter() - t)
        t = time.perf_counter()
        opt.apply(grads, state, params)
        t_apply.append(time.perf_counter() - t)
    return statistics.median(t_apply), statistics.median(t_copy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=10_000_000, help="number of parameters")
    parser.add_argument("--leaves", type=int, default=50, help="number of leaves")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per optimizer")
    parser.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    _report.add_json_arg(parser)
    args = parser.parse_args(argv)
    out = _report.json_path(parser, args, "optim_apply")

    rng = np.random.default_rng(0)
    seg = leaf_table(args.size, args.leaves, rng)
    p0 = rng.normal(size=args.size).astype(np.float32)
    g0 = rng.normal(size=args.size).astype(np.float32)
    nbytes = p0.nbytes
    print(f"{args.size:,} float32 parameters ({nbytes / 1e6:.0f} MB) in {args.leaves} leaves")
    print(f"{'optimizer':<14}{'apply ms':>10}{'memcpy ms':>11}{'GB/s':>8}{'x memcpy':>10}  bar")
    missed, rows, bars = [], [], []
    for name, (make, vectors, bar) in CASES.items():
        t_apply, t_copy = time_case(make(), seg, g0, p0, args.repeats)
        ratio = t_apply / t_copy
        ok = bar is None or ratio <= bar
        if not ok:
            missed.append(name)
        verdict = "" if bar is None else f"<= {bar:.1f}  {'ok' if ok else 'MISSED'}"
        rows.append({"optimizer": name, "apply_ms": t_apply * 1e3, "memcpy_ms": t_copy * 1e3,
                     "x_memcpy": ratio})  # fmt: skip
        if bar is not None:
            bars.append(_report.bar(f"{name} apply, x memcpy", ratio, "<=", bar))
        print(
            f"{name:<14}{t_apply * 1e3:>10.2f}{t_copy * 1e3:>11.2f}"
            f"{vectors * nbytes / t_apply / 1e9:>8.1f}{ratio:>10.2f}  {verdict}"
        )
    print("GB/s: the rule's minimum traffic (vectors read + written) over the apply time")
    if missed:
        print(f"missed bars: {', '.join(missed)}")
    _report.write(out, {"params": args.size, "leaves": args.leaves, "rows": rows}, bars=bars)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
