"""What a shard's warm-up and a job's parent allocate, in multiples of the parameters' bytes
B (issue 44; ``docs/design-notes.md``, "Memory per process").

* **warm-up**: a new process builds a ``Shard`` of ``--size`` float32 parameters (two leaves)
  for each server optimizer, then calls ``warm_up()``; the rise of its peak resident memory
  (``VmHWM``) across that call. What is left is numba loading the kernels (from its cache
  after the first run): the same bytes at any size.
* **parent**: in this process, NumPy's allocations that ``tracemalloc`` sees: the peak
  while ``sw.Job(params)`` is made, and across ``job.train`` (2 workers, SGD, 60 pushes,
  an ``evaluate`` that keeps nothing, a record every 50 ms), counting the job's flat
  vector and, at the end, the result's ``params`` and ``flat``.

Run: ``python benchmarks/memory.py [--size N]``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tracemalloc

import numpy as np

import stalewise as sw

RULES = {
    "sgd": "optim.sgd(0.1)",
    "adamw": "optim.adamw(6e-4)",
    "lamb": "optim.chain(optim.clip_by_global_norm(1.0), optim.lamb(1e-3))",
    "delayed_nesterov": "optim.delayed_nesterov(0.7, 0.3, every=4)",
}
WARM = """
import sys, numpy as np
from stalewise import optim
from stalewise.optim import _kernels
from stalewise.protocol import Shard
from stalewise.segments import Segments
def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
n = int(sys.argv[1])
params = np.full(n, 0.01, np.float32)
shard = Shard(params, Segments.from_sizes(["a", "b"], [n // 2, n - n // 2]), {rule}, workers=4)
before = hwm()
shard.warm_up()
print((hwm() - before) / params.nbytes)
"""


def warm_up(size: int) -> dict[str, float]:
    out = {}
    for name, rule in RULES.items():
        code = WARM.format(rule=rule)
        run = subprocess.run([sys.executable, "-c", code, str(size)], capture_output=True,
                             text=True, check=True, timeout=600)  # fmt: skip
        out[name] = float(run.stdout)
    return out


def _loss_and_grad(params, batch):
    return 0.0, {"w": np.full_like(params["w"], 1e-6)}


def _data(worker, workers):
    while True:
        yield 0


def parent(size: int) -> dict[str, float]:
    params = {"w": np.zeros(size, np.float32)}
    nbytes = params["w"].nbytes
    tracemalloc.start()
    try:
        job = sw.Job(params, optimizer=sw.optim.sgd(0.1))
        made = tracemalloc.get_traced_memory()[1] / nbytes
        tracemalloc.reset_peak()
        result = job.train(_loss_and_grad, data=_data, workers=2, steps=60,
                           evaluate=lambda p: {"loss": float(p["w"][0])},
                           metrics=sw.Metrics(every=0.05))  # fmt: skip
        trained = tracemalloc.get_traced_memory()[1] / nbytes
    finally:
        tracemalloc.stop()
    return {"job": made, "train": trained, "records": len(result.records)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=16_053_760, help="float32 parameters")
    args = ap.parse_args()
    print(f"{args.size} float32 parameters, B = {4 * args.size / 2**20:.1f} MiB; "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    for name, x in warm_up(args.size).items():
        print(f"warm-up, {name}: VmHWM +{x:.2f} B")
    p = parent(args.size)
    print(f"parent: Job() peak {p['job']:.2f} B; train() peak {p['train']:.2f} B "
          f"({p['records']} records, each evaluated)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
