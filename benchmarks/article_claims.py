"""Two claims of the article, tested on the digits MLP in the simulator.

The article this project grew from says, without numbers:

1. **Asynchronous training wants a 30% larger local batch.** Tested as: under
   ASP (with a 4x straggler and inverse staleness weights) and under BSP, each
   batch size in ``BATCHES`` gets a small learning-rate grid; the best virtual
   time to 95% held-out accuracy of each batch size is reported as a ratio to
   the best batch of the same consistency model. The claim holds if ASP's best
   batch is about 1.3x BSP's, or if ASP gains from 1.3x the batch where BSP
   does not.
2. **``max_trust_ratio`` between 5 and 10 is the good range for worker-side
   LAMB.** Tested as: local SGD (H = 16, ASP) with an inner LAMB at each
   ``max_trust_ratio`` in ``TRUST``; the time to 95% and the final accuracy
   are reported against the best ratio.

The simulator runs the real gradients on a virtual clock (one local step takes
``PER_SAMPLE`` seconds per example of the batch, so a larger batch costs
proportionally more time), which makes the runs deterministic: each figure is
the mean over ``SEEDS`` seeds. It prints what it measured; the claims are
judged by the reader from the ratios (and summarised on the last lines).

    .venv/bin/python benchmarks/article_claims.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import _report

import stalewise as sw
from stalewise import report, tasks
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed, Network, Stragglers

TARGET = 0.95
WORKERS = 4
PER_SAMPLE = 0.25e-3  # virtual seconds of compute per example: batch 32 -> 8 ms per step
BATCHES = (16, 24, 32, 42, 64)
TRUST = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 100.0, math.inf)
SEEDS = (0, 1, 2)
SAMPLES = 120_000  # examples processed by all workers together, per run


def sim(batch: int) -> SimConfig:
    return SimConfig(
        compute=Fixed(PER_SAMPLE * batch),
        stragglers=Stragglers(count=1, slowdown=4.0),
        network=Network(latency=1e-3, bandwidth=1.25e9),
    )


def run(job_kw: dict, batch: int, seed: int, local_steps: int = 1) -> tuple[float, float]:
    """(virtual seconds to 95% or inf, final accuracy) of one simulated run."""
    task = tasks.get("digits", batch_size=batch)
    job = sw.Job(task.init_params(seed), **job_kw)
    steps = max(SAMPLES // (batch * local_steps), 8)
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        evaluate=task.evaluate,
        workers=WORKERS,
        steps=steps,
        runtime=sw.Simulation(sim(batch), seed=seed),
        stop_at={"accuracy": 0.975},
        metrics=sw.Metrics(every=0.01),
    )
    t = report.time_to_target(result.records, "accuracy", TARGET)
    return (math.inf if t is None else t), float(result.records[-1]["accuracy"])


def mean_run(job_kw: dict, batch: int, seeds, local_steps: int = 1) -> tuple[float, float]:
    """Mean time to 95% (inf if any seed missed) and mean final accuracy over ``seeds``."""
    times, accs = zip(*(run(job_kw, batch, s, local_steps) for s in seeds), strict=True)
    return statistics.fmean(times), statistics.fmean(accs)


def batch_claim(lrs, seeds) -> dict[str, dict[int, tuple]]:
    """Per consistency model and batch size: (best lr, time to 95%, final accuracy)."""
    models = {
        "ASP": lambda lr: dict(optimizer=sw.optim.sgd(lr, momentum=0.9),
                               consistency=sw.ASP(), staleness=sw.staleness.inverse()),
        "BSP": lambda lr: dict(optimizer=sw.optim.sgd(lr, momentum=0.9), consistency=sw.BSP()),
    }  # fmt: skip
    out: dict[str, dict[int, tuple]] = {}
    for name, make in models.items():
        out[name] = {}
        for b in BATCHES:
            rows = [(lr, *mean_run(make(lr), b, seeds)) for lr in lrs]
            out[name][b] = min(rows, key=lambda r: (r[1], -r[2]))
            lr, t, acc = out[name][b]
            print(f"  {name} batch {b:3d}: best lr {lr:<5g} time to 95% {t:.3f} s, "
                  f"final {acc:.4f}", flush=True)  # fmt: skip
    return out


def trust_claim(lrs, seeds) -> dict[float, tuple]:
    """Per max_trust_ratio: (best inner lr, time to 95%, final accuracy) of local SGD H=16."""
    out = {}
    for m in TRUST:
        rows = []
        for lr in lrs:
            inner = sw.optim.lamb(lr, max_trust_ratio=m)
            kw = dict(strategy=sw.strategies.local_sgd(local_steps=16, inner=inner),
                      consistency=sw.ASP(), staleness=sw.staleness.inverse())  # fmt: skip
            rows.append((lr, *mean_run(kw, 32, seeds, local_steps=16)))
        out[m] = min(rows, key=lambda r: (r[1], -r[2]))
        lr, t, acc = out[m]
        print(f"  max_trust_ratio {m:<6g}: best lr {lr:<6g} time to 95% {t:.3f} s, "
              f"final {acc:.4f}", flush=True)  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, fewer learning rates")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "article_claims")
    seeds = SEEDS[:1] if args.quick else SEEDS
    lrs = (0.03, 0.1) if args.quick else (0.01, 0.03, 0.1)
    trust_lrs = (0.003, 0.01) if args.quick else (0.001, 0.003, 0.01, 0.03)

    print(f"claim 1: a 30% larger batch for asynchronous training ({WORKERS} simulated workers, "
          f"one 4x slower, {PER_SAMPLE * 1e3:g} ms per example, {len(seeds)} seed(s))")  # fmt: skip
    res = batch_claim(lrs, seeds)
    rows = batch_rows = []
    best = {}
    for name, by_batch in res.items():
        best[name] = min(by_batch, key=lambda b: by_batch[b][1])
        for b, (lr, t, acc) in by_batch.items():
            rows.append({"model": name, "batch": b, "lr": lr, "time_to_95%_s": t,
                         "vs_best": t / by_batch[best[name]][1], "final_accuracy": acc})  # fmt: skip
    print(report.format_table(rows, ["model", "batch", "lr", "time_to_95%_s", "vs_best",
                                     "final_accuracy"]))  # fmt: skip

    print("\nclaim 2: max_trust_ratio of worker-side LAMB (local SGD H=16, ASP)")
    trust = trust_claim(trust_lrs, seeds)
    top = min(trust, key=lambda m: trust[m][1])
    rows = [{"max_trust_ratio": m, "inner_lr": lr, "time_to_95%_s": t,
             "vs_best": t / trust[top][1], "final_accuracy": acc}
            for m, (lr, t, acc) in trust.items()]  # fmt: skip
    print(report.format_table(rows, ["max_trust_ratio", "inner_lr", "time_to_95%_s", "vs_best",
                                     "final_accuracy"]))  # fmt: skip

    a, s = best["ASP"], best["BSP"]
    print(f"\nclaim 1: best batch ASP {a}, BSP {s}: ASP's best is {a / s:.2f}x BSP's (claim: 1.3x)")
    in_range = [m for m in trust if trust[m][1] <= 1.1 * trust[top][1]]
    print(f"claim 2: fastest max_trust_ratio {top:g}; within 10% of it: "
          f"{', '.join(f'{m:g}' for m in in_range)} (claim: 5 to 10)")  # fmt: skip
    _report.write(out, {"seeds": list(seeds), "batch": batch_rows, "max_trust_ratio": rows,
                        "asp_best_batch_over_bsp": a / s, "fastest_max_trust_ratio": top,
                        "within_10pct_of_fastest": in_range})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
