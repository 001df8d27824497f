"""Pull and push of 10M float32 parameters through the local runtime, against memcpy.

A pull asks the shard for a snapshot: the shard copies its parameters into the
worker's shared-memory pull buffer and answers with the version. ``pull(copy=False)``
hands the user views of that buffer (what ``Job.train`` workers use),
``pull(into=tree)`` copies it into the user's existing arrays or model, and
``pull()`` into freshly allocated arrays. A push flattens the user's update into the worker's shared-memory
push buffer and waits for the shard's ack: the shard validates the payload
(length, dtype, NaN/Inf) and applies plain SGD to it. The SGD apply alone is
also timed so the transport share can be read off. Each timed call starts with
the shard idle (30 ms untimed pause), so a push does not pay for publishing the
previous update's snapshot: this measures one operation's latency, not a
back-to-back stream.

Bar: a pull (into the user's tree) costs at most 3x a memcpy of the parameters, a push at most 3x.
``--check`` also writes the figures to ``runs/bench-transport.json`` (or ``--json PATH``).

    .venv/bin/python benchmarks/transport.py [--check] [--size 10000000] [--json PATH]
"""

import argparse
import sys
import time

import _report
import numpy as np

import stalewise as sw
from stalewise.segments import Segments


def median_time(fn, repeats: int, settle: float = 0.0) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        time.sleep(settle)  # let the shard finish publishing the last update (untimed)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "transport")
    n, reps = args.size, args.repeats
    src = np.random.default_rng(0).random(n, dtype=np.float32)
    dst = np.empty_like(src)
    grads = {"w": np.full(n, 1e-6, np.float32)}
    job = sw.Job({"w": src}, optimizer=sw.optim.sgd(1e-3))
    with job.serve(workers=1) as server:
        client = server.client(0)

        def push():
            client.push(grads)
            client.wait()

        def push_in_place():  # the update was computed straight into the shared push buffer
            client.push_buffer  # noqa: B018 - waits for the previous ack, like push()
            client.push_flat_sent()
            client.wait()

        opt = sw.optim.sgd(1e-3)
        state = opt.init(dst, Segments.single(n))
        scratch = grads["w"].copy()
        mine = {"w": np.zeros(n, np.float32)}
        # interleave the baseline with the measured calls so drift hits both alike
        rows = []
        for name, fn in [
            ("memcpy (np.copyto)", lambda: np.copyto(dst, src)),
            ("pull(copy=False)", lambda: client.pull(copy=False)),
            ("pull(into=own tree)", lambda: client.pull(into=mine)),
            ("pull() (fresh arrays)", lambda: client.pull()),
            ("push + ack", push),
            ("push of push_buffer + ack", push_in_place),
            ("  of which SGD apply", lambda: opt.apply(scratch, state, dst)),
        ]:
            base = median_time(lambda: np.copyto(dst, src), reps, settle=0.03)
            t = median_time(fn, reps, settle=0.03)
            rows.append((name, t, t / base))
        client.close()
    mb = n * 4 / 1e6
    print(f"{n:,} float32 parameters ({mb:.0f} MB)")
    print(f"{'operation':24s} {'ms':>8s} {'GB/s':>7s} {'x memcpy':>9s}")
    for name, t, ratio in rows:
        print(f"{name:24s} {t * 1e3:8.2f} {mb / 1e3 / t:7.2f} {ratio:9.2f}")
    pull_ratio = rows[2][2]
    push_ratio = rows[4][2]  # from the user's tree; the in-place row shows the flatten's share
    ok = pull_ratio <= 3 and push_ratio <= 3
    print(
        f"\nbar: pull into the user's tree <= 3x memcpy: {pull_ratio:.2f}x, push <= 3x memcpy: {push_ratio:.2f}x ->",
        "met" if ok else "MISSED",
    )
    print(
        f"(pull() into freshly allocated arrays: {rows[3][2]:.2f}x; most of the extra is first-touch page faults)"
    )
    _report.write(
        out,
        {
            "params": n,
            "rows": [{"operation": name, "ms": t * 1e3, "x_memcpy": r} for name, t, r in rows],
        },
        bars=[
            _report.bar("pull into the user's tree, x memcpy", pull_ratio, "<=", 3),
            _report.bar("push from a tree, x memcpy", push_ratio, "<=", 3),
        ],
    )
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
