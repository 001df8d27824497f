"""What an update costs from 1M to 100M float32 parameters, counted in copies (issue 44).

A *copy* is ``np.copyto`` of the parameters' bytes into warm memory: it reads and
writes them once. It is measured in the same run as everything else, so every
figure is a ratio that a shared machine's load moves less than a time.

* **stages**: one process, ``job.serve`` with 1, 2 or 4 shards, SGD: the time of
  ``pull()`` (fresh arrays), ``pull(into=buffers)``, a push until it returns, and
  its apply until acknowledged (``client.wait()``), each as a multiple of a copy
  (medians). Their sum is the copies an update costs; one memory bus serving them
  all bounds the rate at ``1 / (copies x copy)`` (and the workers' ideal, 162.5/s).
  ``floor ...``: the same stages' copies and step alone, in one process (:func:`floor`).
  ``shard_cpu``: the shards' CPU time per update, in copies (what they do while
  idle, an undo copy or a publish, counted too; ticks of 10 ms: coarse at 1M);
  ``sgd_push``/``sgd_idle`` (and with momentum, Adam): a ``Shard``'s push and its idle
  ``prepare()`` (the undo copy, where it makes one) in one process, in copies.
* **rates**: the own-loop client of the README (4 processes, ASP, 20 ms steps, one
  worker 4x slower, ``client.pull()`` then ``client.push(grads)``), updates/s
  after a warm-up, as a share of that bound; and ``Job.train`` with gradients and
  with DiLoCo H=20 (``--train``).
* **sim**: beside each own-loop rate, the simulator's prediction of it (``sim/s``,
  ``sim/real``), calibrated in the same run (``job.calibrate`` at n/4 and n floats: the
  stages' CPU costs, each timed alone, the memory bus, the contention; then the setting
  simulated with ``model_bytes`` of n floats). ``--no-sim`` leaves it out; ``--resim JSON [--drop KEY]`` only simulates again
  on a recorded run's tables (``sim_tables``). The bar's run (10M and 100M, quiet machine):
  ``benchmarks/scale.py --sizes 10000000 100000000 --shards 1 --json
  benchmarks/results/scale-sim-alone.json`` (its bars: ``|sim/real - 1| <= 0.15``).
* **memory**: each process's peak resident memory (``VmHWM``, the shared block
  counted in every process that touched it) as a multiple of the parameters' bytes.

    .venv/bin/python benchmarks/scale.py [--sizes 1000000 10000000] [--shards 1 2 4]
        [--seconds 4] [--train] [--no-sim] [--stages-only] [--optimizer sgd|adam]
        [--json benchmarks/results/scale.json]
"""

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import time

import _report
import numpy as np
from stragglers import emulated_step, no_data  # the same emulated job as the straggler runs

import stalewise as sw
from stalewise.protocol import PushHeader, Shard
from stalewise.runtime.sim import SimConfig
from stalewise.segments import Segments

COMPUTE, SLOWDOWN, WORKERS = 0.020, 4.0, 4
IDEAL = (WORKERS - 1) / COMPUTE + 1 / (COMPUTE * SLOWDOWN)
WARMUP = 1.0  # seconds of the own loop not counted


def hwm(pid: int | str = "self") -> int:
    """A process's peak resident memory in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux: /proc/<pid>/task/*/children)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def cpu_seconds(pids: list[int]) -> float:
    """The CPU time (user and system) the processes ``pids`` have used so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            total += sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
    return total / os.sysconf("SC_CLK_TCK")


_WARM: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n -> the copy's two buffers, faulted in


def copy_time(n: int, repeats: int = 7) -> float:
    """The median time of ``np.copyto`` of ``n`` float32 into warm memory (the same two
    buffers at every call: a fresh destination's page faults, or not, as the allocator
    hands it out, once moved the 1M copy between 0.14 and 2 ms from run to run)."""
    if n not in _WARM:
        _WARM.clear()  # one size at a time
        _WARM[n] = np.ones(n, np.float32), np.zeros(n, np.float32)
        np.copyto(_WARM[n][1], _WARM[n][0])
    src, dst = _WARM[n]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def shard_work(n: int, optimizer, repeats: int) -> tuple[float, float]:
    """A ``Shard``'s push and idle ``prepare()`` in this process (no pipes), in copies."""
    shard = Shard(np.zeros(n, np.float32), Segments.single(n), optimizer, workers=1)
    shard.warm_up()
    shard.join(0, 1)
    g = np.full(n, 1e-3, np.float32)
    t = {"push": [], "prepare": [], "copy": []}
    for seq in range(repeats + 1):
        t["copy"].append(copy_time(n, 1))
        t0 = time.perf_counter()
        assert shard.push(PushHeader(0, seq, shard.version, 1), g).ok
        t1 = time.perf_counter()
        shard.prepare()
        t["push"].append(t1 - t0)
        t["prepare"].append(time.perf_counter() - t1)
    med = {k: float(np.median(v[1:])) for k, v in t.items()}
    return med["push"] / med["copy"], med["prepare"] / med["copy"]


def floor(n: int, repeats: int) -> dict:
    """Each stage's data movement alone, in copies: the same NumPy copies and SGD step in
    one process, in the order and over as many buffers as :func:`stages` (a pull from a
    snapshot, into fresh memory then into a tree, a push's copy measuring its norm as the
    local client does (``tree.flatten_measured``), the shard's step, the publish), with no pipe,
    process or Python of the runtime: what is left of a stage at its floor is the runtime's
    own cost. At 1M the buffers (36 MB) exceed the
    L3 cache a warm copy stays in."""
    b = {k: np.full(n, 1e-3, np.float32) for k in ("p", "s0", "s1", "new", "into", "g", "push")}
    spec = sw.tree.flatten({"w": b["g"]})[1]
    opt = sw.optim.sgd(1e-3)
    state = opt.init(b["p"], Segments.single(n))
    t = {"pull()": [], "pull(into=buffers)": [], "push": [], "apply": [], "copy": []}

    def timed(name, f, *args, **kw):
        t0 = time.perf_counter()
        f(*args, **kw)
        t[name].append(time.perf_counter() - t0)

    for i in range(repeats + 3):
        snap, other = (b["s0"], b["s1"]) if i % 2 else (b["s1"], b["s0"])
        t["copy"].append(copy_time(n, 1))
        timed("pull()", np.copyto, b["new"], snap)
        t["copy"].append(copy_time(n, 1))
        timed("pull(into=buffers)", np.copyto, b["into"], snap)
        t["copy"].append(copy_time(n, 1))
        timed("push", sw.tree.flatten_measured, {"w": b["g"]}, [(0, n)], spec=spec, out=b["push"])
        timed("apply", opt.apply, b["push"], state, b["p"])
        np.copyto(other, b["p"])  # the publish
    copy = float(np.median(t.pop("copy")[9:]))
    return {f"floor {k}": float(np.median(v[3:])) / copy for k, v in t.items()}


OPTIMIZERS = {"sgd": lambda: sw.optim.sgd(1e-3), "adam": lambda: sw.optim.adam(1e-3)}


def stages(n: int, shards: int, repeats: int, optimizer: str = "sgd") -> dict:
    """Each stage's median time over ``repeats`` updates, as a multiple of a copy."""
    opt = OPTIMIZERS[optimizer]()
    job = sw.Job({"w": np.zeros(n, np.float32)}, optimizer=opt, shards=shards)
    grads = {"w": np.full(n, 1e-3, np.float32)}
    into = {"w": np.zeros(n, np.float32)}
    t = {"pull()": [], "pull(into=buffers)": [], "push": [], "apply": [], "copy": []}
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull()
        shards_pids = children(os.getpid())
        cpu = cpu_seconds(shards_pids)
        for _ in range(repeats + 1):  # a copy between stages: the load falls on both alike
            t["copy"].append(copy_time(n, 1))
            t0 = time.perf_counter()
            client.pull()
            t1 = time.perf_counter()
            t["copy"].append(copy_time(n, 1))
            t2 = time.perf_counter()
            client.pull(into=into)
            t3 = time.perf_counter()
            t["copy"].append(copy_time(n, 1))
            t4 = time.perf_counter()
            client.push(grads)
            t5 = time.perf_counter()
            client.wait()
            t6 = time.perf_counter()
            for name, d in zip(t, (t1 - t0, t3 - t2, t5 - t4, t6 - t5), strict=False):
                t[name].append(d)
        cpu = (cpu_seconds(shards_pids) - cpu) / (repeats + 1)  # the shards', per update
        peaks = {"client": hwm(), "shards": [hwm(c) for c in shards_pids]}
        client.close()
    med = {k: float(np.median(v[3 if k == "copy" else 1 :])) for k, v in t.items()}
    copy = med.pop("copy")
    row = {"params": n, "shards": shards, "copy_ms": copy * 1e3}
    row |= {k: v / copy for k, v in med.items()}
    # an update: a pull into the caller's memory, a push, its apply
    row["copies"] = row["pull(into=buffers)"] + row["push"] + row["apply"]
    row["bound/s"] = min(IDEAL, 1.0 / (row["copies"] * copy))
    # all the shards' work for an update (its apply, undo copy, publish), idle time's too
    row["shard_cpu"] = cpu / copy
    nbytes = 4 * n
    row["mem_client"] = peaks["client"] / nbytes
    row["mem_shard"] = max(peaks["shards"], default=0) / nbytes
    if shards == 1:  # the stages' data movement alone; the shard's step and idle undo copy
        row |= floor(n, repeats)
        for name, opt in (
            ("sgd", sw.optim.sgd(1e-3)),
            ("momentum", sw.optim.sgd(1e-3, 0.9)),
            ("adam", sw.optim.adam(1e-3)),
        ):
            row[f"{name}_push"], row[f"{name}_idle"] = shard_work(n, opt, repeats)
    return row


def own_worker(client, w: int, n: int, seconds: float, start, out) -> None:
    """The README's own loop: pull(), emulated compute, push; counts pushes after a warm-up."""
    step = COMPUTE * (SLOWDOWN if w == WORKERS - 1 else 1.0)
    grads = {"w": np.full(n, 1e-6, np.float32)}
    client.pull()
    out.put(("ready", w))
    t0 = start.get()
    count = 0
    while (now := time.monotonic()) < t0 + WARMUP + seconds:
        client.pull()
        time.sleep(step)
        client.push(grads)
        count += now >= t0 + WARMUP
    out.put(("done", w, count, hwm()))
    client.close()


def own_rate(n: int, shards: int, seconds: float, optimizer: str = "sgd", replicas=1) -> dict:
    opt = OPTIMIZERS[optimizer]()
    job = sw.Job({"w": np.zeros(n, np.float32)}, optimizer=opt, shards=shards, replicas=replicas)
    ctx = mp.get_context("spawn")
    start, out = ctx.Queue(), ctx.Queue()
    with job.serve(workers=WORKERS) as server:
        procs = []
        for w in range(WORKERS):
            p = ctx.Process(
                target=own_worker, args=(server.client(w), w, n, seconds, start, out), daemon=True
            )
            p.start()
            server.release(w)
            procs.append(p)
        shard_pids = [c for c in children(os.getpid()) if c not in {p.pid for p in procs}]
        for _ in range(WORKERS):
            out.get(timeout=600)
        t0 = time.monotonic() + 0.2
        for _ in range(WORKERS):
            start.put(t0)
        load = os.getloadavg()[0]
        done = [out.get(timeout=WARMUP + seconds + 600) for _ in range(WORKERS)]
        shard_peak = max(hwm(c) for c in shard_pids)
        for p in procs:
            p.join(60)
    pushes = sum(d[2] for d in done)
    return {
        "updates/s": pushes / seconds,
        "load1": max(load, os.getloadavg()[0]),
        "mem_worker": max(d[3] for d in done) / (4 * n),
        "mem_shard_4w": shard_peak / (4 * n),
    }


SIM_SECONDS = 20.0  # virtual seconds of the simulated own loop


def sim_rate(n: int, shards: int, repeats: int, optimizer: str = "sgd") -> tuple[float, dict]:
    """The calibrated simulator's updates/s of :func:`own_rate`'s setting, and its table:
    calibrated here and now at n/4 and n floats on a small job that pretends n floats."""
    job = sw.Job({"w": np.zeros(1000, np.float32)}, optimizer=OPTIMIZERS[optimizer](),
                 shards=shards)  # fmt: skip
    cal = job.calibrate(emulated_step, no_data, workers=WORKERS, repeats=max(3, repeats),
                        sizes=(n // 4, n), delays=COMPUTE)  # fmt: skip
    table = cal.table()
    return simulate(n, shards, table, optimizer), table


def simulate(n: int, shards: int, table: dict, optimizer: str = "sgd") -> float:
    """The simulator's updates/s of :func:`own_rate`'s setting on the ``[sim]`` ``table``
    (JSON's nulls read as infinite rates), as if of ``n`` floats."""
    table = {k: math.inf if v is None else v for k, v in table.items()}
    sim = dataclasses.replace(SimConfig.from_dict(table), model_bytes=4 * n)
    job = sw.Job({"w": np.zeros(1000, np.float32)}, optimizer=OPTIMIZERS[optimizer](),
                 shards=shards)  # fmt: skip
    r = job.train(
        emulated_step,
        data=no_data,
        workers=WORKERS,
        steps=int(IDEAL * SIM_SECONDS),
        runtime=sw.Simulation(sim),
        emulation=sw.Emulation(
            stragglers={WORKERS - 1: SLOWDOWN}, delays=dict.fromkeys(range(WORKERS), COMPUTE)
        ),
    )
    return r.stats["version"] / r.time


def resimulate(path: str, drop: tuple[str, ...] = ()) -> list[dict]:
    """Each own-loop row of a scale JSON beside the simulator's updates/s on the table it
    recorded (``sim_tables``) less the keys ``drop``: a change checked against recorded runs."""
    with open(path) as f:
        fig = json.load(f)["figures"]
    out = []
    for r in fig["rows"]:
        table = fig.get("sim_tables", {}).get(str(r["params"]))
        if table is not None and "updates/s" in r:
            table = {k: v for k, v in table.items() if k not in drop}
            sim = simulate(r["params"], r["shards"], table, fig.get("optimizer", "sgd"))
            out.append({"params": r["params"], "load1": r["load1"], "updates/s": r["updates/s"],
                        "sim/s": sim, "sim/real": sim / r["updates/s"]})  # fmt: skip
    return out


def train_rate(n: int, shards: int, seconds: float, strategy) -> float:
    """``Job.train``'s updates/s (emulated 20 ms steps, one worker 4x slower)."""
    job = sw.Job({"w": np.zeros(n, np.float32)}, optimizer=sw.optim.sgd(0.01), shards=shards,
                 strategy=strategy)  # fmt: skip
    local = getattr(strategy, "local_steps", 1)
    r = job.train(
        emulated_step,
        data=no_data,
        workers=WORKERS,
        steps=max(8, int(IDEAL * seconds / local)),
        emulation=sw.Emulation(
            stragglers={WORKERS - 1: SLOWDOWN}, delays=dict.fromkeys(range(WORKERS), COMPUTE)
        ),
    )
    return r.stats["version"] / r.time


def main() -> int:
    from stalewise.report import format_table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seconds", type=float, default=4.0, help="own loop: seconds counted")
    ap.add_argument("--repeats", type=int, default=9, help="stages: updates timed")
    ap.add_argument("--train", action="store_true", help="also Job.train: gradients, DiLoCo H=20")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd", help="the shards'")
    ap.add_argument("--no-sim", action="store_true", help="no simulator column")
    ap.add_argument("--stages-only", action="store_true", help="no own loop, sim or train")
    ap.add_argument("--replicas", type=int, nargs="?", const=1, default=0, metavar="PAIRS",
                    help="also the own loop at replicas=2, PAIRS times after one at 1 (the ratio: "
                         "their median)")  # fmt: skip
    ap.add_argument(
        "--resim", nargs="+", metavar="JSON", help="only re-simulate these runs' tables"
    )
    ap.add_argument("--drop", nargs="+", default=(), metavar="KEY", help="--resim: less these keys")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    if args.resim:
        for path in args.resim:
            rows = resimulate(path, tuple(args.drop))
            print(path, "\n", format_table(rows, list(rows[0]) if rows else []), sep="")
        return 0
    out = _report.json_path(ap, args, "scale")
    began, loads = time.monotonic(), [os.getloadavg()[0]]
    rows, tables = [], {}
    for n in args.sizes:
        for s in args.shards:
            row = stages(n, s, args.repeats, args.optimizer)
            if s == args.shards[0] and not args.stages_only:  # the rates: one shard count
                seconds = args.seconds * (1 if n <= 2e6 else 3)
                row |= own_rate(n, s, seconds, args.optimizer)
                row["of_bound"] = row["updates/s"] / row["bound/s"]
                pairs = []  # (replicas=1, replicas=2) in turn (a backup's peak: mem_shard_r2)
                for i in range(args.replicas):
                    r1 = row if i == 0 else own_rate(n, s, seconds, args.optimizer)
                    r2 = own_rate(n, s, seconds, args.optimizer, 2)
                    pairs.append((r1["updates/s"], r2["updates/s"]))
                    row["mem_shard_r2"] = max(row.get("mem_shard_r2", 0), r2["mem_shard_4w"])
                    row["load1"] = max(row["load1"], r2["load1"])
                if pairs:
                    row["r2/s"] = float(np.median([b for _, b in pairs]))
                    row["r2/r1"] = float(np.median([b / a for a, b in pairs]))
                    row["r2/r1 each"] = [round(b / a, 3) for a, b in pairs]
                    row["r1, r2 each"] = pairs  # updates/s
                if not args.no_sim:
                    row["sim/s"], tables[n] = sim_rate(n, s, args.repeats, args.optimizer)
                    row["sim/real"] = row["sim/s"] / row["updates/s"]
                    row["load1"] = max(row["load1"], os.getloadavg()[0])
                if args.train:
                    row["train/s"] = train_rate(n, s, args.seconds, None)
                    row["diloco20/s"] = train_rate(n, s, args.seconds * 4, sw.strategies.diloco(20))
            loads.append(os.getloadavg()[0])
            rows.append(row)
            print(format_table([row], list(row)), flush=True)
    print(
        f"\n{WORKERS} processes, ASP, {COMPUTE * 1e3:.0f} ms steps, one {SLOWDOWN:g}x slower "
        f"(ideal {IDEAL:.1f}/s); stages in copies of the parameters' bytes; memory in "
        f"multiples of them; load average (1 min) {min(loads):.2f}-{max(loads):.2f} on "
        f"{os.cpu_count()} cores ({time.monotonic() - began:.0f} s)"
    )
    cols = sorted(
        {k for r in rows for k in r}, key=lambda k: next(list(r).index(k) for r in rows if k in r)
    )
    print(format_table([{k: r.get(k, "") for k in cols} for r in rows], cols))
    _report.write(
        out,
        {
            "ideal_updates_per_s": IDEAL,
            "load1": [min(loads), max(loads)],
            "optimizer": args.optimizer,
            "rows": rows,
            "sim_tables": tables,  # by size: the [sim] table each sim/s was simulated on
        },
        bars=[  # the simulator within 15% of the own loop (issue 44: at 10M and 100M)
            _report.bar(
                f"{r['params']:,} params: |sim/real - 1|", abs(r["sim/real"] - 1), "<=", 0.15
            )
            for r in rows
            if "sim/real" in r
        ]
        + [
            _report.bar(f"{r['params']:,} params: replicas=2 / 1", r["r2/r1"], ">=", 0.7)
            for r in rows
            if "r2/r1" in r
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
