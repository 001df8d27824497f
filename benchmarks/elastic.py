"""Elastic membership: a job that workers join, leave and die in, against it undisturbed.

Own-loop workers train the digits MLP (ASP, server LAMB, inverse staleness
weights) on a job served under a name with room for 8 worker ids
(``job.serve(workers=(4, 8), name=...)``). Each worker is a process of its own
that joins with ``sw.attach(name)`` when told to, and trains (pull, one
gradient, push; each step also waits ``--pace`` seconds, the compute of a
bigger model) until it is told to leave (``client.close()``) or the job's
budget of pushes is spent. Spare processes wait in a pool, started through a
fork server, as a cluster manager keeps machines ready: a spare loads its data
and runs its step once before it says it is ready, and only a ready spare is
told to join (a killed one is replaced by a new process, which gets ready
while the others train). A worker's live time runs from the order to join to
the order to leave (or its kill): its ``sw.attach`` and its first pull are
charged to it; the start-up of its process is not (in earlier versions
each new process read scikit-learn's digits after its order to join, 2.5-5 s
of its live time and CPU taken from the others: the 0.83x it measured).

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
* held-out accuracy at the end, elastic minus undisturbed (bar >= -1 point);
* where a join's time goes (``sw.attach``, then the first push), and each
  worker's push rate by how many workers were live: on 2 shared cores it falls
  with more workers, whatever the events (CPU, not membership);
* where the stalls come from (:func:`stalls_by_event`): the stall each kind of
  event cost the others (a SIGKILL, a leave, a joiner's first pull), with a bar
  for the SIGKILL's (issue #29 item 3: a departure costs the survivors at most 2
  step-times), every gap over 2 step-times by what happened within it, and the
  pulls whose shards answered at different versions (under BSP, a joiner that
  two shards counted in different rounds);
* the pushes per worker-second with the joiners' ``--build`` seconds left out,
  beside the bar's figure, which counts them as live (see the design notes).

With ``--consistency bsp`` the job runs BSP rounds (issue #29 item 3) under the
same bars. A worker counts for the rounds from its first pull or push, so a
joiner that spends ``--build`` seconds after ``sw.attach`` (building its model)
should hold no round meanwhile; those seconds are its live time, charged to
the pushes-per-live-worker-second ratio (5 joins of 2 s in a quick run: about
0.1 of it).

    .venv/bin/python benchmarks/elastic.py [--quick] [--check] [--json PATH]
    .venv/bin/python benchmarks/elastic.py --consistency bsp --build 2 [--quick]
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
from multiprocessing import connection

import _report
import numpy as np

import stalewise as sw
from stalewise import report, tasks

MIN, MAX = 4, 8


def worker_main(name: str, orders, budget: int, pace: float, build: float = 0.0) -> None:
    """A spare process: joins the job when told, trains, leaves when told (or at the budget).

    It sends the times of its pushes in chunks, each tagged with its stint (one
    membership, join to leave), so the parent knows them if it is killed.
    """
    task = tasks.get("digits")
    # a ready machine: the data loaded and the step run once before it is told to join
    # (the first batch reads scikit-learn's digits, seconds on a loaded machine, which the
    # live time of the elastic run would otherwise charge to the join of every new process)
    task.loss_and_grad(task.init_params(0), next(task.batches(0, MAX)))
    orders.send("ready")
    for stint in range(1_000_000):
        order = orders.recv()
        while order != "join":
            if order == "exit":
                return
            order = orders.recv()  # a "leave" that came after the budget was spent
        client = sw.attach(name)
        orders.send((stint, "attached", time.monotonic()))
        if build:  # builds its model after attaching, before its first pull; an order
            orders.poll(build)  # to leave meanwhile is obeyed at once, freeing its worker id
        batches = task.batches(client.worker, MAX)
        times: list[float] = []
        skewed = 0  # pulls whose shards answered at different versions (see stalls_by_event)
        if not orders.poll(0):
            orders.send((stint, "pulling", time.monotonic()))
        while not orders.poll(0) and client.job_pushes < budget:
            params = client.pull()
            skewed += len(set(client._sender.bases)) > 1  # the versions it pulled, per shard
            _, grads = task.loss_and_grad(params, next(batches))
            if pace:
                time.sleep(pace)
            client.push(grads)
            times.append(time.monotonic())
            if len(times) == 50:
                orders.send((stint, times, skewed))
                times, skewed = [], 0
        client.close()
        orders.send((stint, times, skewed))


class Pool:
    """Worker processes, live or spare, started through a fork server."""

    def __init__(self, name: str, budget: int, pace: float, build: float = 0.0):
        self.ctx = mp.get_context("forkserver")
        # the fork server imports what a worker needs once, scikit-learn's loader too (2.6 s
        # on a loaded machine): a process started to replace a killed one then spends little
        # CPU getting ready, CPU the live workers on these same cores would otherwise lose
        self.ctx.set_forkserver_preload(
            ["numpy", "stalewise", "stalewise.tasks.digits", "sklearn.datasets"]
        )
        self.name, self.budget, self.pace, self.build = name, budget, pace, build
        self.spares: list = []  # (process, pipe), the one to join next last
        self.ready: set[int] = set()  # the processes that have loaded their data
        self.live: list = []  # (process, pipe)
        self.times: dict[tuple, list[float]] = {}  # per (process, stint): its push times
        self.stints: dict[int, int] = {}  # per process: the stints it was told to join
        self.ordered: dict[tuple, float] = {}  # per (process, stint): when it was told to join
        self.attached: dict[tuple, float] = {}  # per (process, stint): when sw.attach returned
        self.pulling: dict[tuple, float] = {}  # per (process, stint): its first pull began
        self.skewed: dict[tuple, int] = {}  # per (process, stint): pulls of unequal versions
        self.events: list[tuple[float, str, tuple]] = []  # (time, join/leave/kill, stint)
        self.started_at: dict[int, float] = {}  # per process: when it was started
        self.ready_at: dict[int, float] = {}  # per process: when it said it was ready (about)
        self.timeline: list[tuple[float, int]] = []  # (time, live workers from then on)

    def start(self) -> None:
        mine, theirs = self.ctx.Pipe()
        p = self.ctx.Process(
            target=worker_main, args=(self.name, theirs, self.budget, self.pace, self.build)
        )
        p.start()
        self.started_at[p.pid] = time.monotonic()
        theirs.close()
        self.spares.append((p, mine))

    def join(self) -> None:
        """Tells a spare to join: one that is ready (as a cluster manager offers a machine
        once it is up), waiting for one if none is yet."""
        while not any(p.pid in self.ready for p, _ in self.spares):
            connection.wait([conn for _, conn in self.spares], timeout=1)
            self.poll()
        i = max(i for i, (p, _) in enumerate(self.spares) if p.pid in self.ready)
        p, conn = self.spares.pop(i)
        stint = self.stints.get(p.pid, 0)
        self.stints[p.pid] = stint + 1
        self.ordered[(p.pid, stint)] = time.monotonic()
        self.events.append((time.monotonic(), "join", (p.pid, stint)))
        conn.send("join")
        self.live.append((p, conn))
        self.timeline.append((time.monotonic(), len(self.live)))

    def leave(self, rng: random.Random) -> None:
        p, conn = self.live.pop(rng.randrange(len(self.live)))
        self.events.append((time.monotonic(), "leave", (p.pid, self.stints[p.pid] - 1)))
        conn.send("leave")
        self.spares.insert(0, (p, conn))
        self.timeline.append((time.monotonic(), len(self.live)))

    def kill(self, rng: random.Random) -> None:
        p, conn = self.live.pop(rng.randrange(len(self.live)))
        self.events.append((time.monotonic(), "kill", (p.pid, self.stints[p.pid] - 1)))
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:  # it died on its own (its traceback is above): said, counted
            print(f"worker process {p.pid} had already exited", file=sys.stderr)
        self.timeline.append((time.monotonic(), len(self.live)))
        p.join(10)
        self.collect(conn, p.pid)
        conn.close()
        self.start()  # a new spare in its place

    def collect(self, conn, pid: int) -> None:
        try:
            while conn.poll(0):
                msg = conn.recv()
                if msg == "ready":
                    self.ready.add(pid)
                    self.ready_at[pid] = time.monotonic()
                    continue
                if msg[1] in ("attached", "pulling"):
                    getattr(self, msg[1])[(pid, msg[0])] = msg[2]
                    continue
                stint, times, skewed = msg
                self.times.setdefault((pid, stint), []).extend(times)
                self.skewed[(pid, stint)] = self.skewed.get((pid, stint), 0) + skewed
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


def run(
    events: int, budget: int, pace: float, seed: int, consistency: str = "asp", build: float = 0.0
) -> dict:
    """One run (``events`` = 0: undisturbed); its figures."""
    task = tasks.get("digits")
    model = (
        dict(consistency=sw.BSP())
        if consistency == "bsp"
        else dict(consistency=sw.ASP(), staleness=sw.staleness.inverse())
    )
    job = sw.Job(task.init_params(0), optimizer=sw.optim.lamb(0.01), **model)
    name = f"bench-elastic-{uuid.uuid4().hex[:8]}"
    rng = random.Random(seed)
    kinds = {"join": 0, "leave": 0, "kill": 0}
    with job.serve(workers=(MIN, MAX), name=name) as server:
        pool = Pool(name, budget, pace, build)
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
            ended = time.monotonic()
            wall = ended - started
            live_seconds += len(pool.live) * (time.monotonic() - last)
        finally:
            pool.close()
        stats = server.stats()
        applied = int(stats[0].get("stats.applied", stats[0].get("applied", 0)))
        final = task.evaluate(server.pull())
    phases = diagnose(pool, started, ended)
    stalls = []
    for t in pool.times.values():
        gaps = np.diff(sorted(t))
        if len(gaps) >= 20:
            stalls.append(float(gaps.max() / np.median(gaps)))
    building = build_seconds(pool, started, ended)
    return {
        "events": sum(kinds.values()),
        **kinds,
        "wall_s": wall,
        "applied": applied,
        "live_worker_s": live_seconds,
        "pushes_per_worker_s": applied / live_seconds,
        "build_worker_s": building,
        "pushes_per_pulling_worker_s": applied / (live_seconds - building),
        "pushes_per_s": applied / wall,
        "stall_max": max(stalls) if stalls else None,
        "stall_p90": float(np.percentile(stalls, 90)) if stalls else None,
        "accuracy": final["accuracy"],
        **phases,
    }


def build_seconds(pool: Pool, started: float, ended: float) -> float:
    """The live worker-seconds the joiners spent between ``sw.attach`` and their first
    pull (building their model), when they cannot push: until the first pull began, or
    the stint ended (a leave or a kill during the build)."""
    ends = {key: t for t, kind, key in pool.events if kind in ("leave", "kill")}
    total = 0.0
    for key, attached in pool.attached.items():
        if pool.ordered[key] <= started:
            continue
        until = pool.pulling.get(key, ends.get(key, ended))
        total += max(0.0, min(until, ends.get(key, ended), ended) - attached)
    return total


def stalls_by_event(pool: Pool, started: float) -> dict:
    """Where the stalls come from.

    * ``at``: for each event after the start (a kill, a leave order, a joiner's first
      pull), the longest gap of another worker across it, in that worker's step-times
      (its median gap): the stall that event cost the workers that stay; the median
      and the largest per kind.
    * ``causes``: every gap over 2 step-times of any worker, by what happened within it
      (its worker's push before and after): a kill, a leave, a joiner's first pull or
      its first push (the round then waited for it), a replacement process starting
      (CPU), or nothing of these (this machine's noise); their count and the largest.
    """
    pushes = {k: np.sort(np.asarray(t)) for k, t in pool.times.items() if len(t) >= 21}
    medians = {k: float(np.median(np.diff(t))) for k, t in pushes.items()}
    events = [(t, kind, key) for t, kind, key in pool.events if t > started]
    events += [(t, "first pull", k) for k, t in pool.pulling.items() if pool.ordered[k] > started]
    firsts = [(float(min(t)), "first push", k) for k, t in pool.times.items()
              if t and pool.ordered[k] > started]  # fmt: skip
    spares = [(t, pool.ready_at.get(pid)) for pid, t in pool.started_at.items() if t > started]
    at: dict[str, list[float]] = {}
    for t, kind, key in events:
        if kind == "join":
            continue  # the order to join: its stint's first pull is the event that counts
        worst = 0.0
        for k, ts in pushes.items():
            i = int(np.searchsorted(ts, t))
            if k != key and 0 < i < len(ts):
                worst = max(worst, float(ts[i] - ts[i - 1]) / medians[k])
        if worst:
            at.setdefault(kind, []).append(worst)
    causes: dict[str, list] = {}
    for k, ts in pushes.items():
        gaps = np.diff(ts) / medians[k]
        for i in np.flatnonzero(gaps > 2.0):
            a, b = ts[i], ts[i + 1]
            why = {kind for t, kind, key in events + firsts if a < t <= b and key != k}
            why.discard("join")
            if any(s < b and (r is None or r > a) for s, r in spares):
                why.add("spare starting")
            label = " + ".join(sorted(why)) or "none of these"
            got = causes.setdefault(label, [0, 0.0])
            got[0] += 1
            got[1] = max(got[1], round(float(gaps[i]), 2))
    return {
        "stall_at": {
            kind: {"n": len(v), "median": round(float(np.median(v)), 2), "max": round(max(v), 2)}
            for kind, v in sorted(at.items())
        },
        "stall_causes": dict(sorted(causes.items(), key=lambda kv: -kv[1][1])),
        "skewed_pulls": sum(pool.skewed.values()),
        "skewed_stints": sum(1 for n in pool.skewed.values() if n),
    }


def diagnose(pool: Pool, started: float, ended: float) -> dict:
    """Where the live worker time went: how long a joining worker took to attach and to
    push first (median and max over the joins after the start), and each worker's push
    rate by how many were live."""
    joins = [k for k in pool.attached if pool.ordered[k] > started]
    attach = [pool.attached[k] - pool.ordered[k] for k in joins]
    first = [min(pool.times[k]) - pool.attached[k] for k in joins if pool.times.get(k)]
    pushes = np.sort(np.concatenate([np.asarray(t) for t in pool.times.values()] or [[]]))
    by_n: dict[int, list[float]] = {}  # live workers -> [pushes, worker-seconds]
    marks = [(t, n) for t, n in pool.timeline if t > started]
    n0 = max([n for t, n in pool.timeline if t <= started] or [0])
    edges = [started] + [t for t, _ in marks] + [ended]
    counts = [n0] + [n for _, n in marks]
    for a, b, n in zip(edges[:-1], edges[1:], counts, strict=True):
        got = by_n.setdefault(n, [0.0, 0.0])
        got[0] += np.searchsorted(pushes, b) - np.searchsorted(pushes, a)
        got[1] += n * (b - a)
    med = lambda x: float(np.median(x)) if x else None  # noqa: E731
    return {
        **stalls_by_event(pool, started),
        "attach_s_median": med(attach),
        "attach_s_max": max(attach) if attach else None,
        "first_push_s_median": med(first),
        "first_push_s_max": max(first) if first else None,
        "rate_by_live": {n: round(float(c / s), 2) for n, (c, s) in sorted(by_n.items()) if s > 1},
    }


def _load(avg: tuple) -> str:
    return ", ".join(f"{x:.2f}" for x in avg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 events, a smaller budget")
    ap.add_argument("--events", type=int, default=None, help="events in the elastic run (100)")
    ap.add_argument("--pace", type=float, default=0.03, help="seconds each step waits (0.03)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--consistency", choices=("asp", "bsp"), default="asp",
                    help="the job's model (asp: inverse staleness weights)")  # fmt: skip
    ap.add_argument("--build", type=float, default=0.0,
                    help="seconds a worker waits after sw.attach before its first pull (0)")  # fmt: skip
    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "elastic")
    events = args.events if args.events is not None else (30 if args.quick else 100)
    budget = 2000 if args.quick else 5000
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the pool's processes: one thread each
    model = dict(consistency=args.consistency, build=args.build)
    load = [os.getloadavg()]
    print(f"load average (1, 5, 15 min) at the start: {_load(load[0])}", flush=True)
    base = run(0, budget, args.pace, args.seed, **model)
    print(f"  undisturbed: {base['applied']} pushes in {base['wall_s']:.1f} s", flush=True)
    el = run(events, budget, args.pace, args.seed, **model)
    print(f"  elastic: {el['applied']} pushes in {el['wall_s']:.1f} s, {el['events']} events "
          f"({el['join']} joins, {el['leave']} leaves, {el['kill']} kills)", flush=True)  # fmt: skip
    rows = [dict(run="undisturbed", **base), dict(run="elastic", **el)]
    cols = ["run", "events", "wall_s", "applied", "live_worker_s", "pushes_per_worker_s",
            "pushes_per_s", "stall_max", "stall_p90", "accuracy"]  # fmt: skip
    print(report.format_table(rows, cols))
    ratio = el["pushes_per_worker_s"] / base["pushes_per_worker_s"]
    kill = el["stall_at"].get("kill", {}).get("max")
    bars = [
        _report.bar("useful pushes per live worker-second, elastic/undisturbed", ratio, ">=", 0.9),
        _report.bar(
            "longest stall of a worker that stays (step-times)", el["stall_max"], "<=", 2.0
        ),
        _report.bar("longest stall of a survivor across a SIGKILL (step-times)", kill, "<=", 2.0),
        _report.bar(
            "accuracy, elastic - undisturbed", el["accuracy"] - base["accuracy"], ">=", -0.01
        ),
    ]
    for b in bars:
        value = "none" if b["value"] is None else f"{b['value']:.3g}"
        print(f"{b['name']}: {value} (bar {b['bar']}) {'met' if b['met'] else 'MISSED'}")
    print(f"the same per worker-second that could push (the joiners' {el['build_worker_s']:.1f} s "
          f"of building left out): "
          f"{el['pushes_per_pulling_worker_s'] / base['pushes_per_pulling_worker_s']:.3g}")  # fmt: skip
    print(f"stall across each event (the longest gap of another worker, step-times): "
          f"{el['stall_at']}")  # fmt: skip
    print(f"gaps over 2 step-times by what happened in them: {el['stall_causes']} "
          f"(undisturbed: {base['stall_causes']})")  # fmt: skip
    print(f"pulls whose shards answered at different versions: {el['skewed_pulls']} "
          f"in {el['skewed_stints']} stints")  # fmt: skip
    print(f"(undisturbed longest stall: {base['stall_max']:.3g} step-times: this machine's noise)")
    print(f"a join: attach {el['attach_s_median']:.3f} s median ({el['attach_s_max']:.3f} max), "
          f"then the first push {el['first_push_s_median']:.3f} s "
          f"({el['first_push_s_max']:.3f} max) after it")  # fmt: skip
    print(f"pushes per worker-second by live workers: undisturbed {base['rate_by_live']}, "
          f"elastic {el['rate_by_live']}")  # fmt: skip
    load.append(os.getloadavg())
    print(f"load average (1, 5, 15 min) at the end: {_load(load[1])}")
    _report.write(
        out,
        {"quick": args.quick, "pace": args.pace, **model, "rows": rows, "load": load},
        bars=bars,
    )
    return 1 if args.check and not all(b["met"] for b in bars) else 0


if __name__ == "__main__":
    sys.exit(main())
