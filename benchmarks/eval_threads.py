"""The parent's evaluation beside the workers: capped by the library, against left as it is.

A 2-worker, 2-shard BSP DiLoCo(H=7) run of the digits MLP 2813 wide (211k parameters), 5.6 ms
of emulated compute a step, evaluated every 50 ms: updates/s with no thread variable set (the
local runtime runs the evaluation on ``cpu_count // workers`` math-library threads) against
the same run with ``OPENBLAS_NUM_THREADS`` set to the core count (a variable the user set is
left as it is: the evaluation runs as it did before the cap), interleaved A B A B ... in one run.

    .venv/bin/python benchmarks/eval_threads.py [--pairs 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics

import _report

import stalewise as sw
from stalewise import tasks
from stalewise.runtime.base import THREAD_VARS


def updates_per_second(user_threads: int | None, steps: int) -> float:
    for var in THREAD_VARS:
        os.environ.pop(var, None)
    if user_threads:
        os.environ["OPENBLAS_NUM_THREADS"] = str(user_threads)
    task = tasks.get("digits", hidden=2813)
    job = sw.Job(
        task.init_params(0), shards=2, consistency=sw.BSP(),
        strategy=sw.strategies.diloco(local_steps=7, inner=sw.optim.adamw(1e-3)),
    )  # fmt: skip
    result = job.train(
        task.loss_and_grad, data=task.batches, evaluate=task.evaluate, workers=2, steps=steps,
        emulation=sw.Emulation(delays={0: 0.0056, 1: 0.0056}), metrics=sw.Metrics(every=0.05),
    )  # fmt: skip
    return result.stats["version"] / result.records[-1]["time"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="pushes a run")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "eval_threads")
    rows: dict[str, list] = {"capped": [], "uncapped": [], "load": []}
    for _ in range(args.pairs):
        rows["uncapped"].append(updates_per_second(os.cpu_count(), args.steps))
        rows["capped"].append(updates_per_second(None, args.steps))
        rows["load"].append(os.getloadavg()[0])
        print(f"updates/s: evaluation capped {rows['capped'][-1]:.2f}, left on "
              f"{os.cpu_count()} threads {rows['uncapped'][-1]:.2f} (load {rows['load'][-1]:.2f})",
              flush=True)  # fmt: skip
    ratio = statistics.median(c / u for c, u in zip(rows["capped"], rows["uncapped"], strict=True))
    print(f"capped over uncapped, the median of {args.pairs} pairs: {ratio:.2f}x")
    _report.write(out, figures={"rows": rows, "ratio": ratio})


if __name__ == "__main__":
    main()
