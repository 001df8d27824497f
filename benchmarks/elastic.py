"""Elastic membership: a job that workers join, leave and die in, against it undisturbed.

Own-loop workers train the digits MLP (ASP, server LAMB, inverse staleness
weights) on a job served under a name with room for 8 worker ids
(``job.serve(workers=(4, 8), name=...)``). Each worker is a process of its own
that joins with ``sw.attach(name)`` when told to, and trains (pull, one
gradient, push; each step also waits ``--pace`` seconds, the compute of a
bigger model) until it is told to leave (``client.close()``) or the job's
budget of pushes is spent. Spare processes wait in a pool, started through a
fork server, as a cluster manager keeps machines ready; a killed one is
replaced by a new process.

Two runs with the same budget: **undisturbed**, 4 workers throughout; and
**elastic**, 4 workers at the start and ``--events`` events at random times
(seeded): a spare joins (while fewer than 8 are live), a worker leaves, or a
worker is killed with SIGKILL (while more than 4 are live). No timeout is set.

Printed, with the bars of issue #19:

* useful pushes (applied by the shards) per second of live worker time,
  elastic / undisturbed (bar >= 0.9): joins, leaves and kills cost the
  workers that stay nothing but CPU;
* the longest stall of a worker that stays: its longest gap between two
  pushes over its median gap (bar <= 2 step-times), next to the same figure
  for the undisturbed run (this machine's noise);
* held-out accuracy at the end, elastic minus undisturbed (bar >= -1 point).

    .venv/bin/python benchmarks/elastic.py [--quick] [--check] [--json PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import uuid

import _report
import numpy as np

import stalewise as sw
from stalewise import report, tasks

MIN, MAX = 4, 8


def worker_main(name: str, orders, budget: int, pace: float) -> None:
    """A spare process: joins the job when told, trains, leaves when told (or at the budget).

    It sends the times of its pushes in chunks, each tagged with its stint (one
    membership, join to leave), so the parent knows them if it is killed.
    """
    task = tasks.get("digits")
    for stint in range(1_000_000):
        order = orders.recv()
        while order != "join":
            if order == "exit":
                return
            order = orders.recv()  # a "leave" that came after the budget was spent
        client = sw.attach(name)
        batches = task.batches(client.worker, MAX)
        times: list[float] = []
        while not orders.poll(0) and client.job_pushes < budget:
            params = client.pull()
            _, grads = task.loss_and_grad(params, next(batches))
            if pace:
                time.sleep(pace)
            client.push(grads)
            times.append(time.monotonic())
            if len(times) == 50:
                orders.send((stint, times))
                times = []
        client.close()
        orders.send((stint, times))


class Pool:
    """Worker processes, live or spare, started through a fork server."""

    def __init__(self, name: str, budget: int, pace: float):
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["numpy", "stalewise", "stalewise.tasks.digits"])
        self.name, self.budget, self.pace = name, budget, pace
        self.spares: list = []
        self.live: list = []  # (process, pipe)
        self.times: dict[tuple, list[float]] = {}  # per (process, stint): its push times

    def start(self) -> None:
        mine, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=worker_main, args=(self.name, theirs, self.budget, self.pace))
        p.start()
        theirs.close()
        self.spares.append((p, mine))

    def join(self) -> None:
        p, conn = self.spares.pop()
        conn.send("join")
        self.live.append((p, conn))

    def leave(self, rng: random.Random) -> None:
        p, conn = self.live.pop(rng.randrange(len(self.live)))
        conn.send("leave")
        self.spares.insert(0, (p, conn))

    def kill(self, rng: random.Random) -> None:
        p, conn = self.live.pop(rng.randrange(len(self.live)))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        self.collect(conn, p.pid)
        conn.close()
        self.start()  # a new spare in its place

    def collect(self, conn, pid: int) -> None:
        try:
            while conn.poll(0):
                stint, times = conn.recv()
                self.times.setdefault((pid, stint), []).extend(times)
        except (EOFError, OSError):
            pass

    def poll(self) -> None:
        for p, conn in self.live + self.spares:
            self.collect(conn, p.pid)

    def close(self) -> None:
        for _p, conn in self.live + self.spares:
            try:
                conn.send("leave")
                conn.send("exit")
            except OSError:
                pass
        deadline = time.monotonic() + 30
        for p, conn in self.live + self.spares:
            p.join(max(0.1, deadline - time.monotonic()))
            self.collect(conn, p.pid)
            if p.is_alive():
                p.kill()
                p.join()
            conn.close()


def run(events: int, budget: int, pace: float, seed: int) -> dict:
    """One run (``events`` = 0: undisturbed); its figures."""
    task = tasks.get("digits")
    job = sw.Job(task.init_params(0), optimizer=sw.optim.lamb(0.01),
                 consistency=sw.ASP(), staleness=sw.staleness.inverse())  # fmt: skip
    name = f"bench-elastic-{uuid.uuid4().hex[:8]}"
    rng = random.Random(seed)
    kinds = {"join": 0, "leave": 0, "kill": 0}
    with job.serve(workers=(MIN, MAX), name=name) as server:
        pool = Pool(name, budget, pace)
        try:
            for _ in range(MAX + 1):
                pool.start()
            for _ in range(MIN):
                pool.join()
            live_seconds = 0.0
            started = last = time.monotonic()
            # the events fire at random points of the budget (seeded), the first 5% and last
            # 10% left alone
            marks = sorted(int(rng.uniform(0.05, 0.9) * budget) for _ in range(events))
            while (done := server.observer.job_pushes) < budget:
                now = time.monotonic()
                live_seconds += len(pool.live) * (now - last)
                last = now
                while marks and done >= marks[0]:
                    marks.pop(0)
                    n = len(pool.live)
                    choice = rng.choice(
                        (["join"] if n < MAX else []) + (["leave", "kill"] if n > MIN else [])
                    )
                    kinds[choice] += 1
                    getattr(pool, choice)(*(() if choice == "join" else (rng,)))
                pool.poll()
                time.sleep(0.01)
            wall = time.monotonic() - started
            live_seconds += len(pool.live) * (time.monotonic() - last)
        finally:
            pool.close()
        stats = server.stats()
        applied = int(stats[0].get("stats.applied", stats[0].get("applied", 0)))
        final = task.evaluate(server.pull())
    stalls = []
    for t in pool.times.values():
        gaps = np.diff(sorted(t))
        if len(gaps) >= 20:
            stalls.append(float(gaps.max() / np.median(gaps)))
    return {
        "events": sum(kinds.values()),
        **kinds,
        "wall_s": wall,
        "applied": applied,
        "live_worker_s": live_seconds,
        "pushes_per_worker_s": applied / live_seconds,
        "pushes_per_s": applied / wall,
        "stall_max": max(stalls) if stalls else None,
        "stall_p90": float(np.percentile(stalls, 90)) if stalls else None,
        "accuracy": final["accuracy"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 events, a smaller budget")
    ap.add_argument("--events", type=int, default=None, help="events in the elastic run (100)")
    ap.add_argument("--pace", type=float, default=0.03, help="seconds each step waits (0.03)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "elastic")
    events = args.events if args.events is not None else (30 if args.quick else 100)
    budget = 2000 if args.quick else 5000
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the pool's processes: one thread each
    base = run(0, budget, args.pace, args.seed)
    print(f"  undisturbed: {base['applied']} pushes in {base['wall_s']:.1f} s", flush=True)
    el = run(events, budget, args.pace, args.seed)
    print(f"  elastic: {el['applied']} pushes in {el['wall_s']:.1f} s, {el['events']} events "
          f"({el['join']} joins, {el['leave']} leaves, {el['kill']} kills)", flush=True)  # fmt: skip
    rows = [dict(run="undisturbed", **base), dict(run="elastic", **el)]
    cols = ["run", "events", "wall_s", "applied", "live_worker_s", "pushes_per_worker_s",
            "pushes_per_s", "stall_max", "stall_p90", "accuracy"]  # fmt: skip
    print(report.format_table(rows, cols))
    ratio = el["pushes_per_worker_s"] / base["pushes_per_worker_s"]
    bars = [
        _report.bar("useful pushes per live worker-second, elastic/undisturbed", ratio, ">=", 0.9),
        _report.bar(
            "longest stall of a worker that stays (step-times)", el["stall_max"], "<=", 2.0
        ),
        _report.bar(
            "accuracy, elastic - undisturbed", el["accuracy"] - base["accuracy"], ">=", -0.01
        ),
    ]
    for b in bars:
        print(f"{b['name']}: {b['value']:.3g} (bar {b['bar']}) "
              f"{'met' if b['met'] else 'MISSED'}")  # fmt: skip
    print(f"(undisturbed longest stall: {base['stall_max']:.3g} step-times: this machine's noise)")
    _report.write(out, {"quick": args.quick, "pace": args.pace, "rows": rows}, bars=bars)
    return 1 if args.check and not all(b["met"] for b in bars) else 0


if __name__ == "__main__":
    sys.exit(main())
