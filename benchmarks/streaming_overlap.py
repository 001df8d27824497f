"""Streaming DiLoCo's overlap in wall time: the same BSP run with and without it.

2 local workers train ``streaming_diloco(local_steps=8, fragments=2, delay=2,
alpha=0.5)`` on the least-squares task under BSP, each inner step padded with
``--step`` seconds of emulated compute and each push spending ``--transport``
seconds in transit before the shards see it (``sw.Emulation(transport=)``). A
push goes out every 4 inner steps; with ``overlap=False`` the worker waits for
it (and its pull), with the overlap it takes the 2 inner steps before the merge
meanwhile, so up to ``2 * step`` seconds of each push's transit are hidden.
Printed (``--repeats`` alternating pairs, medians): each run's wall time, the time saved against the hidden communication
expected (pushes per worker x ``min(transport, 2 * step)``), the ratio of the
two wall times, whether the final parameters are identical (they must be: the
same pushes and merges), and the load average.

    .venv/bin/python benchmarks/streaming_overlap.py [--pushes 40] [--step 0.02]
                                                     [--transport 0.04] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

import _report
import numpy as np

import stalewise as sw
from stalewise import tasks

TASK = tasks.get("least-squares", n=512, d=16, batch_size=32, noise=0.1)
WORKERS, H, FRAGMENTS, TAU = 2, 8, 2, 2


def split_loss_and_grad(params, batch):  # the task's 16 values as two leaves, a and b
    loss, g = TASK.loss_and_grad({"x": np.concatenate([params["a"], params["b"]])}, batch)
    return loss, {"a": g["x"][:8], "b": g["x"][8:]}


def train(overlap: bool, pushes: int, step: float, transport: float) -> sw.TrainResult:
    strategy = sw.strategies.streaming_diloco(
        local_steps=H, inner=sw.optim.adamw(0.02), fragments=["^a", "^b"], delay=TAU,
        alpha=0.5, outer_lr=0.7, outer_momentum=0.3, overlap=overlap,
    )  # fmt: skip
    x = TASK.init_params()["x"]
    job = sw.Job({"a": x[:8].copy(), "b": x[8:].copy()}, strategy=strategy, consistency=sw.BSP())
    return job.train(
        split_loss_and_grad,
        data=TASK.batches,
        workers=WORKERS,
        steps=WORKERS * pushes,
        emulation=sw.Emulation(delays=dict.fromkeys(range(WORKERS), step), transport=transport),
        timeouts=sw.Timeouts(total=600),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pushes", type=int, default=40, help="pushes per worker")
    ap.add_argument("--step", type=float, default=0.02, help="emulated seconds per inner step")
    ap.add_argument("--transport", type=float, default=0.04, help="seconds a push is in transit")
    ap.add_argument("--repeats", type=int, default=3, help="alternating pairs; medians")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "streaming_overlap")
    load0 = os.getloadavg()
    runs = {False: [], True: []}
    for _ in range(args.repeats):  # alternating, so that a load that drifts hits both
        for overlap in (False, True):
            runs[overlap].append(train(overlap, args.pushes, args.step, args.transport))
    load1 = os.getloadavg()
    base, over = (sorted(runs[o], key=lambda r: r.time)[len(runs[o]) // 2] for o in (False, True))
    hidden = args.pushes * min(args.transport, TAU * args.step)
    saved = base.time - over.time
    same = all(np.array_equal(r.params[k], base.params[k])
               for r in runs[False] + runs[True] for k in ("a", "b"))  # fmt: skip
    print(f"streaming DiLoCo H={H}, {FRAGMENTS} fragments, tau={TAU}, BSP, {WORKERS} workers, "
          f"{args.pushes} pushes each, {args.step * 1e3:g} ms a step, {args.transport * 1e3:g} ms "
          f"in transit a push; load {load0[0]:.1f} -> {load1[0]:.1f}")  # fmt: skip
    for o, label in ((False, "without overlap"), (True, "with overlap   ")):
        times = ", ".join(f"{r.time:.2f}" for r in runs[o])
        print(f"  {label}: {times} s (median {(over if o else base).time:.2f}), "
              f"{base.pushes} pushes")  # fmt: skip
    print(f"  saved {saved:.2f} s against {hidden:.2f} s of communication to hide "
          f"({saved / hidden:.2f} of it); overlap / without = {over.time / base.time:.3f}; "
          f"final params identical: {same}")  # fmt: skip
    _report.write(
        out,
        figures=dict(
            base_s=base.time,
            overlap_s=over.time,
            saved_s=saved,
            hidden_s=hidden,
            ratio=over.time / base.time,
            identical=same,
            load=[load0, load1],
            pushes=[base.pushes, over.pushes],
            args=vars(args),
        ),
        bars=[_report.bar("saved / hidden communication", saved / hidden, ">=", 0.8)],
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
