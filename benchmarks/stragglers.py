"""Throughput under a straggler: ASP vs SSP(4) vs BSP on the local runtime.

4 local workers, 20 ms of emulated compute per step, the last worker 4x slower
(80 ms). The ideal asynchronous rate is the sum of the workers' rates:
3/0.020 + 1/0.080 = 162.5 pushes/s. Prints pushes applied per second and the
efficiency against that ideal.

Two modes:

* ``--mode train`` (the default): ``Job.train``'s own workers, ASP, SSP(4) and BSP
  at 1M and 10k float32 parameters. Bar: ASP at least 0.9 of ideal at every size.
* ``--mode own``: a loop you own (issue #29): ``job.serve`` and 4 processes of
  this script, each running ``pull`` / 20 ms (80 ms) of emulated compute / ``push``
  under ASP, at 1M and 10M parameters. The same processes alternate the default
  ``client.pull()`` (read-your-writes: the pull holds the worker's last push)
  with ``pull(own=False)`` (it may not) in phases of ``--seconds`` (order ABBA,
  so drift and the machine's load fall on both alike); each mode's rate is its
  pushes over its phases' time (phases are 3x longer above 2M parameters, whose
  steps are slow). ``served``: the share of pulls asked of the shard behind the
  worker's push (read-your-writes), answered by a copy into the pull buffer or
  by a snapshot that holds the push. Pulls are ``copy=False``
  (the emulated step reads nothing), so the figures are the protocol's. Bar
  (issue #29): the default pull within 5% of ``own=False`` at every size, and at
  least 0.9 of ideal at 1M. ``--quick``: 4 pairs of 1 s phases (3 s at 10M) per
  size, about a minute.
* ``--baselines`` (implies ``--mode own``; issue 44): after each size's own loop,
  PyTorch DDP and Ray's parameter-server pattern at that size, 4 s each after a
  warm-up (``benchmarks/baselines.py``), and the ratio of the default pull's
  pushes/s to the best baseline's updates/s (DDP's: 4 x its steps/s, the workers'
  gradients folded in per second). Bar: at least 2x at 10M; with ``--baselines``,
  ``--check`` exits 1 on that bar only (the own-loop bars are printed and written).

``--check`` also writes the figures to ``runs/bench-stragglers.json`` (or
``runs/bench-stragglers-own.json`` in the own mode, ``-baselines`` with baselines, or
``--json PATH``).
The load average is printed with the figures: the machine may be shared.

    .venv/bin/python benchmarks/stragglers.py [--check] [--sizes 1000000 10000] [--seconds 6]
        [--json PATH]
    .venv/bin/python benchmarks/stragglers.py --mode own [--quick] [--check]
        [--sizes 1000000 10000000] [--seconds 1.5] [--pairs 8] [--baselines]
"""

import argparse
import multiprocessing as mp
import os
import sys
import time

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
        emulation=sw.Emulation(
            stragglers={WORKERS - 1: SLOWDOWN}, delays=dict.fromkeys(range(WORKERS), COMPUTE)
        ),
        metrics=sw.Metrics(every=1.0),
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


# -- the own-loop mode ---------------------------------------------------------------------

WARMUP = 1.0  # seconds of the own-loop mode's first phase, not counted
OWN_BAR, OWN_IDEAL_BAR = 0.95, 0.9  # default pull >= 0.95 x own=False; >= 0.9 of ideal at 1M
BASELINE_BAR, BASELINE_SECONDS = {10_000_000: 2.0}, 4.0  # own loop / best of DDP and Ray PS


def phase_modes(pairs: int) -> list[bool]:
    """The ``own`` argument of each measured phase: ABBA order, ``pairs`` of each."""
    return [(i % 4) in (0, 3) for i in range(2 * pairs)]


def own_worker(client, w: int, size: int, modes: list[bool], seconds: float, start, out) -> None:
    """One process of a loop you own: pull, emulated compute, push; counts its pushes per
    phase (the phase is the one the push was committed in; a step's ``own`` is its pull's)."""
    step = COMPUTE * (SLOWDOWN if w == WORKERS - 1 else 1.0)
    grad = {"w": np.full(size, 1e-6, np.float32)}
    client.pull(copy=False)  # attached, first pull done
    out.put(("ready", w))
    t0 = start.get()
    ends = [t0 + WARMUP + seconds * (i + 1) for i in range(len(modes))]
    counts = [0] * len(modes)
    served = [0] * len(modes)  # default pulls a shard served (its snapshot lacked the push)
    phase = -1  # the warm-up
    while True:
        now = time.monotonic()
        while phase + 1 < len(modes) and now >= (ends[phase] if phase >= 0 else t0 + WARMUP):
            phase += 1
        if phase >= 0 and now >= ends[-1]:
            break
        before = getattr(client, "own_requests", 0)
        client.pull(copy=False, own=True if phase < 0 else modes[phase])
        if phase >= 0:
            served[phase] += getattr(client, "own_requests", 0) - before
        time.sleep(step)
        client.push(grad)
        if phase >= 0 and (t := time.monotonic()) < ends[-1]:
            counts[sum(t >= e for e in ends[:-1])] += 1
    out.put(("counts", w, counts, served))
    client.close()


def _take(out, procs, timeout: float):
    """The next message of a worker process; RuntimeError if one died first."""
    import queue

    end = time.monotonic() + timeout
    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"worker processes: exit codes {dead}, or no word") from None


def measure_own(size: int, seconds: float, pairs: int) -> list[dict]:
    """Both pulls' rates at ``size`` parameters, from one server and one set of processes."""
    modes = phase_modes(pairs)
    job = sw.Job({"w": np.zeros(size, np.float32)}, optimizer=sw.optim.sgd(0.01))
    ctx = mp.get_context("spawn")
    start, out = ctx.Queue(), ctx.Queue()
    with job.serve(workers=WORKERS) as server:
        procs = []
        for w in range(WORKERS):
            args = (server.client(w), w, size, modes, seconds, start, out)
            p = ctx.Process(target=own_worker, args=args, daemon=True)
            p.start()
            server.release(w)
            procs.append(p)
        for _ in range(WORKERS):
            _take(out, procs, 300)
        t0 = time.monotonic() + 0.2
        for _ in range(WORKERS):
            start.put(t0)
        load = os.getloadavg()[0]
        totals, served = [0] * len(modes), [0] * len(modes)
        for _ in range(WORKERS):
            _, _, counts, asked = _take(out, procs, WARMUP + seconds * len(modes) + 300)
            totals = [a + b for a, b in zip(totals, counts, strict=True)]
            served = [a + b for a, b in zip(served, asked, strict=True)]
        load = max(load, os.getloadavg()[0])
        for p in procs:
            p.join(30)
    rows = []
    for own in (True, False):
        n = sum(c for c, m in zip(totals, modes, strict=True) if m == own)
        each = [c / seconds / IDEAL for c, m in zip(totals, modes, strict=True) if m == own]
        rate = n / (seconds * pairs)
        rows.append({
            "params": size,
            "pull": "pull()" if own else "pull(own=False)",
            "pushes/s": rate,
            "efficiency": rate / IDEAL,
            "phase_range": f"{min(each):.2f}-{max(each):.2f}",
            "served": sum(c for c, m in zip(served, modes, strict=True) if m == own) / max(n, 1),
            "load1": load,
        })  # fmt: skip
    rows[0]["vs_own_false"] = rows[0]["pushes/s"] / max(rows[1]["pushes/s"], 1e-9)
    rows[1]["vs_own_false"] = 1.0
    return rows


def main_own(args, out) -> int:
    from stalewise.report import format_table

    sizes = args.sizes or [1_000_000, 10_000_000]
    seconds = args.seconds or (1.0 if args.quick else 1.5)
    pairs = args.pairs or (4 if args.quick else 8)
    began = time.monotonic()
    rows, base = [], []
    for n in sizes:  # a 10M step is slow under load: longer phases, so each holds enough pushes
        own = measure_own(n, seconds * (3 if n > 2e6 else 1), pairs)  # pull(), pull(own=False)
        rows += own
        if args.baselines:
            import baselines

            base += baselines.compare(n, own[0]["pushes/s"], BASELINE_SECONDS)
    print(
        f"ideal asynchronous rate: {IDEAL:.1f} pushes/s (3 workers at {COMPUTE * 1e3:.0f} ms, "
        f"1 at {COMPUTE * SLOWDOWN * 1e3:.0f} ms); a loop you own, ASP, {pairs} pairs of "
        f"{seconds:g} s phases per size, ABBA; load average (1 min) {os.getloadavg()[0]:.2f} "
        f"on {os.cpu_count()} cores"
    )
    print(format_table(rows, list(rows[0])))
    bars = []
    for n in sizes:
        mine = next(r for r in rows if r["params"] == n)
        bars.append(
            _report.bar(f"pull() / pull(own=False) at {n:,}", mine["vs_own_false"], ">=", OWN_BAR)
        )
        if n <= 1_000_000:
            bars.append(
                _report.bar(f"pull() efficiency at {n:,}", mine["efficiency"], ">=", OWN_IDEAL_BAR)
            )
    ok = all(b["met"] for b in bars)
    print(f"\nbar: the default pull within 5% of own=False at every size, >= {OWN_IDEAL_BAR} of ideal at 1M:",
          "met" if ok else "MISSED", "(" + ", ".join(f"{b['name']}: {b['value']:.3f}" for b in bars) + ")")  # fmt: skip
    figures = {"ideal_pushes_per_s": IDEAL, "mode": "own", "rows": rows}
    if args.baselines:
        print("\nthe default pull against DDP (updates/s: 4 x steps/s) and Ray's PS pattern:")
        print(format_table(base, list(base[0])))
        mine = [r for r in base if r["system"] == "own loop"]
        extra = [_report.bar(f"own loop / best baseline at {r['params']:,}", r["vs best"], ">=",
                             BASELINE_BAR[r["params"]]) for r in mine if r["params"] in BASELINE_BAR]  # fmt: skip
        bars, ok = bars + extra, all(b["met"] for b in extra)
        verdict = ("met" if ok else "MISSED") if extra else "no figure (10M not measured)"
        print("bar: own loop >= 2x the best baseline at 10M:", verdict,
              "(" + ", ".join(f"{r['params']:,}: {r['vs best']:.2f}x" for r in mine) + ")")  # fmt: skip
        figures["baselines"] = base
    print(f"({time.monotonic() - began:.0f} s)")
    _report.write(out, figures, bars=bars)
    return 0 if ok or not args.check else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("train", "own"), default="train")
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--seconds", type=float, default=None,
                    help="approximate length of each ASP run (train; default 6), of each phase (own; 1.5)")  # fmt: skip
    ap.add_argument("--pairs", type=int, default=None, help="own: phases of each pull (default 8)")
    ap.add_argument("--quick", action="store_true", help="own: 4 pairs of 1 s phases per size")
    ap.add_argument(
        "--baselines", action="store_true", help="own, and DDP and Ray's PS at each size"
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if the bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    args.mode = "own" if args.baselines else args.mode
    name = "baselines" if args.baselines else {"train": "", "own": "own"}[args.mode]
    out = _report.json_path(ap, args, "stragglers" + (f"-{name}" if name else ""))
    if args.mode == "own":
        return main_own(args, out)
    args.sizes = args.sizes or [1_000_000, 10_000]
    args.seconds = args.seconds or 6.0
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
