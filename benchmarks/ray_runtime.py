"""Throughput under a straggler on Ray: stalewise vs the plain Ray parameter-server pattern.

The setting of ``benchmarks/stragglers.py``: 4 workers, 20 ms of emulated
compute per step, the last worker 4x slower (80 ms); the ideal asynchronous
rate is 3/0.020 + 1/0.080 = 162.5 updates/s. At 1M and 10M float32
parameters, in the same run and on the same Ray instance, it measures

* **plain**: the parameter-server pattern of Ray's documentation, written out
  below in about 40 lines: one actor holds the weights and applies each
  gradient, returning the new weights; each worker actor sleeps its compute
  time and returns a gradient; the driver takes the first gradient ready
  (``ray.wait``), has it applied and hands that worker the new weights;
* **ray**: stalewise's Ray runtime, ASP, with ``--shards`` shards (default 1:
  on a 2-core machine a second shard adds messages, not cores);
* **local**: stalewise's local runtime (processes and shared memory), ASP, one
  shard, as ``benchmarks/stragglers.py`` runs it;

* **ray+delta** (with ``--pull-codec CODEC``, e.g. ``int8``): the Ray runtime
  again with delta pulls (``pull_codec``), for the ratio of its update rate, and
  of the bytes of one pull, to the **ray** run's full pulls;

and prints updates applied per second, the fraction of the ideal rate, the
ratio of the Ray runtime to the plain pattern and to the local runtime, and
where a Ray worker's step goes (pull, push, waiting for acks, compute). With
``--repeats N`` the systems run N times in turn and the ratios are medians.

What is timed, the same for every system: from the moment every actor (or
process) is started and ready to the last update applied. Start-up is outside
the window: the plain pattern's actors each answer a no-op call (and the
parameter server hands out its weights) before its clock starts; stalewise's
runtimes start their clock (``TrainResult.time``) only once every shard and
worker has reported ready. Updates/s is the updates applied in that window over
its length (for stalewise, the final version over ``TrainResult.time``).

Bars: the Ray runtime reaches >= 2x the plain pattern's update rate at 1M
parameters and >= 1.5x at 10M. ``--check`` also writes the figures to
``runs/bench-ray_runtime.json`` (or ``--json PATH``).

    .venv/bin/python benchmarks/ray_runtime.py [--quick] [--check] [--seconds 6] [--shards 1]
        [--pull-codec int8] [--repeats 1] [--json PATH]
"""

import argparse
import functools
import statistics
import sys
import time

import _report
import numpy as np

import stalewise as sw

COMPUTE, SLOWDOWN, WORKERS = 0.020, 4.0, 4
IDEAL = (WORKERS - 1) / COMPUTE + 1 / (COMPUTE * SLOWDOWN)
BARS = {1_000_000: 2.0, 10_000_000: 1.5}
_GRADS: dict[int, dict] = {}


def emulated_step(params, batch):
    """A fixed small gradient at once; the compute time is emulated by the runtime's delay."""
    n = params["w"].size
    if n not in _GRADS:
        _GRADS[n] = {"w": np.full(n, 1e-6, np.float32)}
    return 0.0, _GRADS[n]


def no_data(worker, workers):
    while True:
        yield None


# -- the plain Ray parameter-server pattern ------------------------------------------------


def plain_pattern(ray, size: int, seconds: float, warmup: float = 0.0) -> dict:
    """Ray's documented asynchronous parameter server, as a user would write it; timed for
    ``seconds`` after ``warmup`` seconds of the same loop."""

    @ray.remote(num_cpus=0)
    class ParameterServer:
        def __init__(self, size):
            self.weights = np.zeros(size, np.float32)

        def apply_gradients(self, gradient):
            self.weights -= 0.01 * gradient
            return self.weights

        def get_weights(self):
            return self.weights

    @ray.remote(num_cpus=0)
    class DataWorker:
        def __init__(self, size, seconds):
            self.gradient = np.full(size, 1e-6, np.float32)
            self.seconds = seconds

        def ready(self):
            return True

        def compute_gradients(self, weights):
            time.sleep(self.seconds)  # the emulated compute, as in the other two
            return self.gradient

    ps = ParameterServer.remote(size)
    workers = [
        DataWorker.remote(size, COMPUTE * (SLOWDOWN if w == WORKERS - 1 else 1.0))
        for w in range(WORKERS)
    ]
    weights = ps.get_weights.remote()
    ray.get([weights, *(w.ready.remote() for w in workers)])  # every actor up: start-up untimed
    pending = {w.compute_gradients.remote(weights): w for w in workers}
    for window in (warmup, seconds):
        updates, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < window:
            [ready], _ = ray.wait(list(pending), num_returns=1)
            worker = pending.pop(ready)
            weights = ps.apply_gradients.remote(ready)
            pending[worker.compute_gradients.remote(weights)] = worker
            updates += 1
    ray.get(weights)  # the last update is applied
    elapsed = time.perf_counter() - t0
    for a in (ps, *workers):
        ray.kill(a)
    return {
        "updates/s": updates / elapsed,
        "staleness_mean": float("nan"),
        "pull_MB": size * 4 / 1e6,  # each step hands its worker the whole weights
        "where": "",
    }


# -- stalewise -----------------------------------------------------------------------------


def stalewise_run(
    size: int, seconds: float, runtime: str, shards: int, pull_codec: object = None
) -> dict:
    job = sw.Job(
        {"w": np.zeros(size, np.float32)},
        optimizer=sw.optim.sgd(0.01),
        consistency=sw.ASP(),
        shards=shards,
        pull_codec=pull_codec,
    )
    r = job.train(
        emulated_step,
        data=no_data,
        workers=WORKERS,
        steps=int(IDEAL * seconds),
        runtime=runtime,
        emulation=sw.Emulation(
            stragglers={WORKERS - 1: SLOWDOWN}, delays=dict.fromkeys(range(WORKERS), COMPUTE)
        ),
        metrics=sw.Metrics(every=1.0),
        timeouts=sw.Timeouts(total=seconds * 20 + 60),
    )
    where, pull_mb = "", float("nan")
    if "ray" in r.stats:  # per worker step, in ms
        t = r.stats["ray"]
        where = ", ".join(
            f"{k} {t[k] * 1e3:.1f}" for k in ("pull", "push", "acks", "compute", "send")
        )
        where += "; shard: push {:.1f}, publish {:.1f}".format(
            *(1e3 * sum(t[k]) / len(t[k]) for k in ("shard_push", "shard_publish"))
        )
        pull_mb = t["pull_bytes"] / 1e6
    return {
        "updates/s": r.stats["version"] / r.time,
        "staleness_mean": r.stats["staleness_mean"],
        "pull_MB": pull_mb,
        "where": where,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--seconds", type=float, default=6.0, help="approximate length of each run")
    ap.add_argument("--quick", action="store_true", help="3-second runs")
    ap.add_argument("--shards", type=int, default=1, help="shards of the Ray runtime's job")
    ap.add_argument(
        "--pull-codec",
        metavar="CODEC",
        help="also run the Ray runtime with delta pulls encoded by CODEC (e.g. int8)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs of each system, in turn")
    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {args.repeats}")
    pull_codec = None
    if args.pull_codec is not None:
        try:
            pull_codec = sw.codecs.parse(args.pull_codec)
        except ValueError as e:
            ap.error(f"--pull-codec: {e}")
    out = _report.json_path(ap, args, "ray_runtime")
    seconds = 3.0 if args.quick else args.seconds
    import ray

    from stalewise.report import format_table

    # a Ray instance of its own, even when another one runs on this machine
    ray.init(address="local", include_dashboard=False, logging_level="warning")
    rows = []
    try:
        for size in args.sizes:
            for repeat in range(args.repeats):
                runs = {
                    "plain": functools.partial(plain_pattern, ray, size, seconds),
                    "ray": functools.partial(stalewise_run, size, seconds, "ray", args.shards),
                    "local": functools.partial(stalewise_run, size, seconds, "local", 1),
                }
                if pull_codec is not None:
                    runs["ray+delta"] = functools.partial(
                        stalewise_run, size, seconds, "ray", args.shards, pull_codec
                    )
                for name, fn in runs.items():
                    m = fn()
                    print(f"  {size:,} params, {name}: {m['updates/s']:.1f} updates/s", flush=True)
                    rows.append(
                        {
                            "params": size,
                            "repeat": repeat,
                            "system": name,
                            "updates/s": m["updates/s"],
                            "of ideal": m["updates/s"] / IDEAL,
                            "staleness": m["staleness_mean"],
                            "pull_MB": m["pull_MB"],
                            "ms per step (ray)": m["where"],
                        }
                    )
    finally:
        ray.shutdown()
    print(
        f"ideal asynchronous rate: {IDEAL:.1f} updates/s (3 workers at {COMPUTE * 1e3:.0f} ms, "
        f"1 at {COMPUTE * SLOWDOWN * 1e3:.0f} ms); Ray runtime with {args.shards} shard(s)"
        + (f"; ray+delta: pull_codec={pull_codec!r}" if pull_codec is not None else "")
    )
    print(format_table(rows, list(rows[0])))
    bars, ratios = [], {}
    print()
    for size in args.sizes:

        def ratio(a: str, b: str, key: str = "updates/s", size: int = size) -> float:
            """The median over repeats of system a's ``key`` over system b's."""
            per = {(r["repeat"], r["system"]): r[key] for r in rows if r["params"] == size}
            return statistics.median(per[i, a] / per[i, b] for i in range(args.repeats))

        ratios[size] = {"ray/plain": ratio("ray", "plain"), "ray/local": ratio("ray", "local")}
        line = (
            f"{size:,} params: ray / plain = {ratios[size]['ray/plain']:.2f}x; "
            f"ray / local = {ratios[size]['ray/local']:.2f}"
        )
        if size in BARS:
            b = _report.bar(
                f"ray / plain at {size:,} params", ratios[size]["ray/plain"], ">=", BARS[size]
            )
            bars.append(b)
            line += f" (bar >= {BARS[size]:g}x: {'met' if b['met'] else 'MISSED'})"
        if pull_codec is not None:
            ratios[size]["delta/full updates/s"] = ratio("ray+delta", "ray")
            ratios[size]["full/delta pull bytes"] = ratio("ray", "ray+delta", "pull_MB")
            line += (
                f"; delta / full pulls = {ratios[size]['delta/full updates/s']:.2f}x the update "
                f"rate for {ratios[size]['full/delta pull bytes']:.1f}x fewer bytes per pull"
            )
        print(line + (f" (median of {args.repeats})" if args.repeats > 1 else ""))
    _report.write(
        out,
        {
            "ideal_updates_per_s": IDEAL,
            "shards": args.shards,
            "seconds": seconds,
            "pull_codec": repr(pull_codec) if pull_codec is not None else None,
            "rows": rows,
            "ratios": {str(k): v for k, v in ratios.items()},
        },
        bars=bars,
    )
    ok = all(b["met"] for b in bars)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
