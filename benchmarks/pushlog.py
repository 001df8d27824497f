"""What a shard's push log costs (docs/design-notes.md, "Push log").

Two measures, each with and without the log, alternately, medians of ``--repeats``:

- ``shard``: one :class:`~stalewise.protocol.Shard` (adam, float32) applying pushes in a loop,
  its journal written to a file and flushed after every push (the worst grouping: one push per
  turn of a local shard's loop), against no journal.
- ``train``: ``Job.train`` on the local runtime (2 workers, gradients, adam, a checkpoint every
  100 updates) with the shards' logs, against the same run with the logs switched off.

``--fsync``: the log is fsynced before each ack (``sw.Checkpoints(fsync=True)``).

Run: ``.venv/bin/python benchmarks/pushlog.py [--size 1000000] [--repeats 3] [--dir D]``
(``--dir /dev/shm``: the CPU's cost alone; on a disk the log is bound by its bandwidth, 4 MB
per push at 1M parameters). The machine may be shared: say its load beside the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import stalewise as sw
from stalewise.protocol import PushHeader, Shard
from stalewise.runtime.local import server as server_lib
from stalewise.segments import Segments


def shard_rate(size: int, pushes: int, log: bool, where: str | None, fsync: bool) -> float:
    shard = Shard(np.zeros(size, np.float32), Segments.single(size), sw.optim.adam(1e-3), workers=1)
    shard.join(0, 1)
    g = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    with tempfile.TemporaryDirectory(dir=where) as d, open(os.path.join(d, "log"), "wb") as f:
        shard.journal = f.writelines if log else None
        start = time.perf_counter()
        for seq in range(pushes):
            shard.push(PushHeader(0, seq, shard.version, 1), g)
            f.flush()
            if fsync and log:
                os.fdatasync(f.fileno())
        return pushes / (time.perf_counter() - start)


def loss_and_grad(params, batch):
    return 0.0, {"x": params["x"] * np.float32(1e-3)}


def data(worker, workers):
    return iter(range(10**9))


def train_rate(size: int, steps: int, log: bool, where: str | None, fsync: bool) -> float:
    original = server_lib.LocalServer.state_dicts
    if not log:  # the same checkpoints, no push log begun at them
        server_lib.LocalServer.state_dicts = lambda self, timeout=60.0, *a, **k: original(
            self, timeout
        )
    try:
        with tempfile.TemporaryDirectory(dir=where) as d:
            job = sw.Job({"x": np.zeros(size, np.float32)}, optimizer=sw.optim.adam(1e-3))
            result = job.train(
                loss_and_grad,
                data=data,
                workers=2,
                steps=steps,
                checkpoints=sw.Checkpoints(d, every=100, fsync=fsync),
            )
            return result.pushes / result.time
    finally:
        server_lib.LocalServer.state_dicts = original


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pushes", type=int, default=200)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--dir", help="where the logs and checkpoints go (/dev/shm: no disk)")
    p.add_argument("--fsync", action="store_true", help="the log fsynced before each ack")
    a = p.parse_args()
    print(
        f"in {a.dir or tempfile.gettempdir()}; load average {os.getloadavg()}, {os.cpu_count()} cores"
    )
    for name, measure, n in (("shard", shard_rate, a.pushes), ("train", train_rate, a.steps)):
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.repeats):
            for log in (False, True):
                rates[log].append(measure(a.size, n, log, a.dir, a.fsync))
        off, on = (statistics.median(rates[x]) for x in (False, True))
        print(
            f"{name}: {off:.0f} pushes/s without the log, {on:.0f} with it "
            f"({on / off:.2f}x); runs {[round(r) for r in rates[False]]} / "
            f"{[round(r) for r in rates[True]]}"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
