"""Compression codecs: throughput, bytes against accuracy, and the article's sharding claim.

Five parts (issue #11), each a few minutes at most:

1. **throughput**: encode plus decode of a float32 vector, as a ratio to a
   memcpy of the same vector (``np.copyto``) timed in the same run, at a
   cache-resident size (4 MB) and a gradient-sized one (64 MB; 16 MB with
   ``--quick``). Bars, at the larger size: ``fp16``, ``bf16`` and ``int8`` at
   most 3x, ``topk(0.01)`` at most 6x.
2. **digits MLP, 4 workers, ASP**: bytes pushed per update and final held-out
   accuracy for each codec, mean of 3 seeds, in the simulator
   (``stalewise.runtime.sim``, with real gradients and real encoding and
   decoding) and then in the local runtime (real processes, the payloads in
   shared memory; ``--runtime`` picks one). Bars, in each runtime:
   ``topk(0.01)`` with error feedback sends at least 30x fewer bytes than
   ``none`` and ends within 1 accuracy point of it, and measurably worse
   without error feedback (at least 0.5 points below with it); ``int8``
   within 0.5 points at about 4x fewer bytes (at least 3.5x).
3. **the article's claim** ("sharding cut communication latency by 40% on a
   10-node cluster"), in the simulator: 10 workers, every push and pull the
   size of a 100M-parameter float32 model (``model_bytes``), 1 and 10 Gbit/s
   links, 0.2 s of compute per step; communication time per update (pull plus
   push) for shards {1, 2, 5, 10} x codecs {none, fp16, int8, topk(0.01)}, and
   virtual time to 95% held-out accuracy on the digits MLP. Pulls are not
   compressed here (part 5 has delta pulls), so a codec shrinks the push only.
4. **the local runtime, 10M parameters**: the ASP update rate (pushes applied
   per second) with each codec against ``none``, 2 workers pushing a fixed
   gradient back to back (no compute: the transport and the shard are the
   whole cost), 1 and 2 shards, 200 pushes a run, the best of 3 interleaved
   runs (the machine is shared: the best is the least disturbed). On one machine the memory bus, not a network,
   is the limit: a codec adds an encode on the worker and a decode on the shard
   (and, with several shards, a decode on the worker for the commit verdict) to
   save bytes that cost little to move here. The rate is reported as measured;
   no bar.
5. **delta pulls** (``pull_codec``, :mod:`stalewise.protocol.pulls`), in the
   simulator: 10 workers, 100M-parameter ``model_bytes``, 1 Gbit/s, ASP, 0.2 s
   of compute per step, 1 and 10 shards; virtual time to 95% held-out accuracy
   and the final accuracy after the whole budget, with full pulls against
   ``int8`` and ``topk(0.01)`` delta pulls, each with pushes uncompressed and
   with ``topk(0.01)``. No bar.

``--check`` (or ``--json PATH``) writes every part's table and every bar to
``runs/bench-compression.json`` (or PATH).

    .venv/bin/python benchmarks/compression.py [--part 1|2|3|4|5|all] [--quick] [--check]
        [--runtime sim|local|both] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _report
import numpy as np

import stalewise as sw
from stalewise import codecs, report, tasks
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed, Network

MB = 1 << 20
FIGURES: dict[str, list[dict]] = {}  # each part's table, for --json
BARS: list[dict] = []  # each bar checked, for --json


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# -- 1. throughput --------------------------------------------------------------------------

THROUGHPUT_BARS = {"fp16()": 3.0, "bf16()": 3.0, "int8()": 3.0, "topk(0.01)": 6.0}


def throughput(quick: bool) -> list[str]:
    sizes = (MB, 4 * MB) if quick else (MB, 16 * MB)  # elements: 4 MB and 16 or 64 MB
    rows, ratios = [], {}
    for n in sizes:
        x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        dst, out = np.empty_like(x), np.empty_like(x)
        repeats = 30 if n <= MB else 7
        memcpy = best_time(lambda: np.copyto(dst, x), repeats)  # noqa: B023
        for c in (codecs.fp16(), codecs.bf16(), codecs.int8(), codecs.topk(0.01), codecs.sign()):
            buf = bytearray(c.nbytes(n))
            c.encode_into(x, buf)  # compiles the kernels, warms the caches
            np.testing.assert_array_equal(c.decode(buf), c.decode(buf, out))
            enc = best_time(lambda: c.encode_into(x, buf), repeats)  # noqa: B023
            dec = best_time(lambda: c.decode(buf, out), repeats)  # noqa: B023
            ratio = (enc + dec) / memcpy
            ratios[repr(c), n] = ratio
            rows.append({
                "size_MB": 4 * n // MB, "codec": repr(c), "bytes_ratio": round(4 * n / len(buf), 2),
                "encode_x": round(enc / memcpy, 2), "decode_x": round(dec / memcpy, 2),
                "total_x_memcpy": round(ratio, 2), "memcpy_GB/s": round(4 * n / memcpy / 1e9, 1),
            })  # fmt: skip
    print("1. throughput: encode + decode of float32, as a multiple of memcpy's time")
    print(report.format_table(rows, list(rows[0])))
    FIGURES["1. throughput"] = rows
    missed = []
    for name, bar in THROUGHPUT_BARS.items():
        got = ratios[name, sizes[-1]]
        ok = got <= bar
        print(f"   bar {name} <= {bar:g}x memcpy at {4 * sizes[-1] // MB} MB: {got:.2f}x ->",
              "met" if ok else "MISSED")  # fmt: skip
        BARS.append(_report.bar(f"throughput {name}, x memcpy at {4 * sizes[-1] // MB} MB", got,
                                "<=", bar))  # fmt: skip
        if not ok:
            missed.append(f"throughput {name}")
    for name in THROUGHPUT_BARS:
        got = ratios[name, sizes[0]]
        if got > THROUGHPUT_BARS[name]:
            print(f"   (in cache, {4 * sizes[0] // MB} MB, memcpy runs at cache speed: {name} "
                  f"{got:.2f}x, above the bar there)")  # fmt: skip
    return missed


# -- 2. digits MLP, 4 workers, ASP --------------------------------------------------------

DIGITS_CODECS = [
    ("none", codecs.none()),
    ("fp16", codecs.fp16()),
    ("bf16", codecs.bf16()),
    ("int8", codecs.int8()),
    ("topk(0.01) EF", codecs.topk(0.01)),
    ("topk(0.01) no EF", codecs.topk(0.01, error_feedback=False)),
    ("sign EF", codecs.sign()),
    ("sign no EF", codecs.sign(error_feedback=False)),
]
DIGITS_SIM = SimConfig(network=Network(latency=1e-4, bandwidth=1.25e8))


def digits(quick: bool, runtime: str) -> list[str]:
    steps, seeds = (1000, (0,)) if quick else (3000, (0, 1, 2))
    print(f"\n2. digits MLP (64 hidden), 4 workers, ASP, server sgd(0.1), {steps} pushes, "
          f"seeds {list(seeds)}, runtime {runtime!r}")  # fmt: skip
    if runtime == "sim":
        print("   in the simulator (stalewise.runtime.sim) with real gradients and real encoding")
    else:
        print("   in the local runtime: 4 worker processes and a shard process on this machine, "
              "the payloads in shared memory")  # fmt: skip
    rows, acc, nbytes = [], {}, {}
    t0 = time.perf_counter()
    for name, codec in DIGITS_CODECS:
        accs = []
        for seed in seeds:
            task = tasks.with_seed(tasks.get("digits"), seed)
            job = sw.Job(task.init_params(seed), optimizer=sw.optim.sgd(0.1), codec=codec)
            where = sw.Simulation(DIGITS_SIM, seed=seed) if runtime == "sim" else runtime
            r = job.train(task.loss_and_grad, data=task.batches, workers=4, steps=steps,
                          runtime=where, evaluate=task.evaluate,
                          metrics=sw.Metrics(every=1e9))  # fmt: skip
            accs.append(r.records[-1]["accuracy"] * 100)
            if runtime == "sim":
                nbytes[name] = r.stats["sim"]["push_bytes"]
            else:  # what the shard took from shared memory per applied push
                nbytes[name] = r.stats["bytes_in"] / r.stats["applied"]
        acc[name] = statistics.mean(accs)
        rows.append({
            "codec": name, "bytes/update": int(nbytes[name]),
            "fewer_bytes_x": round(nbytes["none"] / nbytes[name], 1),
            "accuracy_%": round(acc[name], 2), "vs_none_pts": round(acc[name] - acc["none"], 2),
            "per_seed": " ".join(f"{a:.1f}" for a in accs),
        })  # fmt: skip
    print(report.format_table(rows, list(rows[0])))
    print(f"   ({time.perf_counter() - t0:.0f} s)")
    FIGURES[f"2. digits ({runtime})"] = rows
    ef, no_ef, i8 = "topk(0.01) EF", "topk(0.01) no EF", "int8"
    checks = [
        (f"{ef}: >= 30x fewer bytes than none", nbytes["none"] / nbytes[ef] >= 30,
         f"{nbytes['none'] / nbytes[ef]:.1f}x"),
        (f"{ef}: within 1 point of none", abs(acc[ef] - acc["none"]) <= 1.0,
         f"{acc[ef] - acc['none']:+.2f} points"),
        (f"{no_ef}: measurably worse (>= 0.5 points below EF)", acc[no_ef] <= acc[ef] - 0.5,
         f"{acc[no_ef] - acc[ef]:+.2f} points"),
        ("int8: within 0.5 points of none", abs(acc[i8] - acc["none"]) <= 0.5,
         f"{acc[i8] - acc['none']:+.2f} points"),
        ("int8: about 4x fewer bytes (>= 3.5x)", nbytes["none"] / nbytes[i8] >= 3.5,
         f"{nbytes['none'] / nbytes[i8]:.2f}x"),
    ]  # fmt: skip
    missed = []
    for text, ok, got in checks:
        print(f"   bar {text}: {got} ->", "met" if ok else "MISSED")
        BARS.append({"name": f"digits ({runtime}) {text}", "value": got, "met": bool(ok)})
        if not ok:
            missed.append(f"digits ({runtime}) {text}")
    return missed


# -- 3. the article's claim ---------------------------------------------------------------

CLAIM_CODECS = [codecs.none(), codecs.fp16(), codecs.int8(), codecs.topk(0.01)]
MODEL_BYTES = 400_000_000  # 100M float32 parameters
TARGET = 0.95


def claim(quick: bool) -> list[str]:
    shard_counts = (1, 10) if quick else (1, 2, 5, 10)
    links = ((1.25e8, "1 Gbit/s", 2.0), (1.25e9, "10 Gbit/s", 0.25))  # bytes/s, name, eval every
    steps = 3000
    task = tasks.get("digits")
    print(f"\n3. the article's claim, in the simulator: 10 workers, {MODEL_BYTES // 10**6} MB "
          f"model_bytes (100M float32 parameters), 0.2 s compute per step, ASP, sgd(0.1); "
          f"time to {TARGET:.0%} held-out accuracy on the digits MLP")  # fmt: skip
    rows, comm = [], {}
    t0 = time.perf_counter()
    for bw, link, every in links:
        for shards in shard_counts:
            for codec in CLAIM_CODECS:
                job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1), codec=codec,
                             shards=shards)  # fmt: skip
                sim = SimConfig(compute=Fixed(0.2), network=Network(latency=1e-3, bandwidth=bw),
                                model_bytes=MODEL_BYTES)  # fmt: skip
                r = job.train(
                    task.loss_and_grad,
                    data=task.batches,
                    workers=10,
                    steps=steps,
                    runtime=sw.Simulation(sim),
                    evaluate=task.evaluate,
                    stop_at={"accuracy": TARGET},
                    metrics=sw.Metrics(every=every),
                )
                s = r.stats["sim"]
                comm[link, shards, repr(codec)] = s["comm_time_mean"]
                ttt = report.time_to_target(r.records, "accuracy", TARGET)
                at = next((rec["pushes"] for rec in r.records if rec["accuracy"] >= TARGET), None)
                base = comm.get((link, 1, repr(codec)))
                rows.append({
                    "link": link, "shards": shards, "codec": repr(codec),
                    "push_MB": round(s["push_bytes"] / 1e6, 1),
                    "pull_s": round(s["pull_time_mean"], 3), "push_s": round(s["push_time_mean"], 3),
                    "comm_s/update": round(s["comm_time_mean"], 3),
                    "vs_1_shard": "" if base is None else f"{s['comm_time_mean'] / base - 1:+.0%}",
                    f"time_to_{TARGET:.0%}_s": ttt, "pushes_to_target": at,
                })  # fmt: skip
    print(report.format_table(rows, list(rows[0])))
    FIGURES["3. claim"] = rows
    print(f"   ({time.perf_counter() - t0:.0f} s)")
    print("   Does sharding cut communication latency by 40% on 10 nodes?")
    for _, link, _ in links:
        for codec in CLAIM_CODECS:
            one = comm[link, 1, repr(codec)]
            cuts = ", ".join(
                f"{s} shards {1 - comm[link, s, repr(codec)] / one:.0%}" for s in shard_counts[1:]
            )
            print(f"   {link}, {codec!r}: cut from 1 shard: {cuts}")
    first = {}
    for _, link, _ in links:
        hit = [
            s for s in shard_counts[1:] if comm[link, s, "none()"] <= 0.6 * comm[link, 1, "none()"]
        ]
        first[link] = hit[0] if hit else None
    for link, s in first.items():
        if s is None:
            print(f"   {link}: no; sharding never cut it by 40% here")
        else:
            print(f"   {link}: yes, by 40% or more with {s} shards already, the fewest tried "
                  "above 1")  # fmt: skip
    print("   Why, and where it stops: the simulator puts each shard on its own node with its "
          "own link, so a lone shard's link carries every worker's pull and push and each "
          "shard added is another link. Once each worker's own link is the bottleneck (the "
          "pull of the whole model, full here; part 5 shrinks it), more shards cut little more "
          "and a codec only shrinks the push. Shards sharing one node's link would not gain.")  # fmt: skip
    return []


# -- 4. the local runtime, 10M parameters ------------------------------------------------

RATE_CODECS = [codecs.none(), codecs.fp16(), codecs.bf16(), codecs.int8(), codecs.topk(0.01),
               codecs.sign()]  # fmt: skip
RATE_SIZE = 10_000_000
_GRAD: dict[int, dict] = {}


def fixed_gradient(params, batch):
    """A fixed random gradient (made once per worker process): no compute to speak of."""
    n = params["w"].size
    if n not in _GRAD:
        rng = np.random.default_rng(1)
        _GRAD[n] = {"b": np.full(params["b"].size, 1e-3, np.float32),
                    "w": (rng.standard_normal(n) * 1e-3).astype(np.float32)}  # fmt: skip
    return 0.0, _GRAD[n]


def no_data(worker, workers):
    while True:
        yield None


def local_rate(quick: bool) -> list[str]:
    steps, rounds = (60, 1) if quick else (200, 3)
    shard_counts = (1,) if quick else (1, 2)
    n = RATE_SIZE
    print(f"\n4. the local runtime, {n // 10**6}M float32 parameters ({4 * n // 10**6} MB), ASP, "
          f"2 workers pushing a fixed gradient back to back, sgd(1e-3); pushes applied per "
          f"second over {steps} pushes, the best of {rounds} runs")  # fmt: skip
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    dst = np.empty_like(x)
    memcpy = best_time(lambda: np.copyto(dst, x), 5)
    costs = {}
    for codec in RATE_CODECS[1:]:  # the codec's own work per push, in this process
        buf, out = bytearray(codec.nbytes(n)), np.empty_like(x)
        codec.encode_into(x, buf)
        costs[repr(codec)] = (best_time(lambda: codec.encode_into(x, buf), 3),  # noqa: B023
                              best_time(lambda: codec.decode(buf, out), 3))  # noqa: B023  # fmt: skip
    runs: dict[tuple, list[float]] = {}
    per_push = {}
    t0 = time.perf_counter()
    for _ in range(rounds):  # interleaved, so that a burst of other load hits every codec alike
        for shards in shard_counts:
            for codec in RATE_CODECS:
                params = {"b": np.zeros(64, np.float32), "w": np.zeros(n, np.float32)}
                job = sw.Job(params, optimizer=sw.optim.sgd(1e-3), codec=codec, shards=shards)
                r = job.train(
                    fixed_gradient,
                    data=no_data,
                    workers=2,
                    steps=steps,
                    metrics=sw.Metrics(every=1e9, progress=False),
                )
                key = shards, repr(codec)
                runs.setdefault(key, []).append(r.stats["applied"] / r.time)
                per_push[key] = r.stats["bytes_in"] / r.stats["applied"]
    rate = {key: max(v) for key, v in runs.items()}
    rows = []
    for (shards, name), best in rate.items():
        enc, dec = costs.get(name, (0.0, 0.0))
        rows.append({
            "shards": shards, "codec": name, "MB/push": round(per_push[shards, name] / 1e6, 2),
            "pushes/s": round(best, 1), "vs_none": f"{best / rate[shards, 'none()']:.2f}x",
            "runs": " ".join(f"{x:.1f}" for x in runs[shards, name]),
            "encode_ms": round(enc * 1e3, 1), "decode_ms": round(dec * 1e3, 1),
        })  # fmt: skip
    print(f"   memcpy of the parameters: {memcpy * 1e3:.1f} ms ({4 * n / memcpy / 1e9:.1f} GB/s); "
          "encode_ms/decode_ms: the codec alone on the whole vector, in one process")  # fmt: skip
    print(report.format_table(rows, list(rows[0])))
    FIGURES["4. local rate"] = rows
    print(f"   ({time.perf_counter() - t0:.0f} s)")
    for shards in shard_counts:
        slower = [c for (s, c), v in rate.items() if s == shards and v < rate[shards, "none()"]]
        if slower:
            print(f"   {shards} shard(s): slower than none here: {', '.join(slower)}")
    return []


# -- 5. delta pulls -------------------------------------------------------------------------

PULL_CODECS = [("full", None), ("int8", codecs.int8()), ("topk(0.01)", codecs.topk(0.01))]
PUSH_CODECS = [codecs.none(), codecs.topk(0.01)]
EVERY = {1: 8.0, 10: 2.0}  # virtual seconds between evaluations: the time to target's resolution


def delta_pulls(quick: bool) -> list[str]:
    shard_counts = (10,) if quick else (1, 10)
    steps = 1500 if quick else 3000
    task = tasks.get("digits")
    print(f"\n5. delta pulls, in the simulator: 10 workers, {MODEL_BYTES // 10**6} MB model_bytes, "
          f"1 Gbit/s, 0.2 s compute per step, ASP, sgd(0.1), {steps} pushes; time to "
          f"{TARGET:.0%} held-out accuracy (evaluated every {EVERY[1]:g} s with 1 shard, "
          f"{EVERY[10]:g} s with 10) and the final accuracy")  # fmt: skip
    rows = []
    t0 = time.perf_counter()
    for shards in shard_counts:
        for push in PUSH_CODECS:
            for name, pull in PULL_CODECS:
                job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1), codec=push,
                             pull_codec=pull, shards=shards)  # fmt: skip
                sim = SimConfig(compute=Fixed(0.2), network=Network(latency=1e-3, bandwidth=1.25e8),
                                model_bytes=MODEL_BYTES)  # fmt: skip
                r = job.train(
                    task.loss_and_grad,
                    data=task.batches,
                    workers=10,
                    steps=steps,
                    runtime=sw.Simulation(sim),
                    evaluate=task.evaluate,
                    metrics=sw.Metrics(every=EVERY[shards]),
                )
                s = r.stats["sim"]
                rows.append({
                    "shards": shards, "push": repr(push), "pull": name,
                    "pull_MB": round(s["pull_bytes"] / 1e6, 1),
                    "push_MB": round(s["push_bytes"] / 1e6, 1),
                    "pull_s": round(s["pull_time_mean"], 3), "push_s": round(s["push_time_mean"], 3),
                    f"time_to_{TARGET:.0%}_s": report.time_to_target(r.records, "accuracy", TARGET),
                    "run_s": round(r.time, 1),
                    "final_acc_%": round(r.records[-1]["accuracy"] * 100, 2),
                })  # fmt: skip
    print(report.format_table(rows, list(rows[0])))
    FIGURES["5. delta pulls"] = rows
    print(f"   ({time.perf_counter() - t0:.0f} s)")
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("1", "2", "3", "4", "5", "all"), default="all")
    ap.add_argument("--runtime", choices=("sim", "local", "both"), default="both",
                    help="where part 2 runs")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer runs")
    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "compression")
    missed = []
    if args.part in ("1", "all"):
        missed += throughput(args.quick)
    if args.part in ("2", "all"):
        for runtime in ("sim", "local") if args.runtime == "both" else (args.runtime,):
            missed += digits(args.quick, runtime)
    if args.part in ("3", "all"):
        missed += claim(args.quick)
    if args.part in ("4", "all"):
        missed += local_rate(args.quick)
    if args.part in ("5", "all"):
        missed += delta_pulls(args.quick)
    print("\nbars missed: " + ("; ".join(missed) if missed else "none"))
    _report.write(out, {"quick": args.quick, "parts": FIGURES}, bars=BARS)
    return 1 if missed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
