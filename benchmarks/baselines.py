"""The baselines of the own-loop rate (issue 44), for ``stragglers.py --mode own --baselines``.

The setting of ``ray_runtime.py``: 4 workers, 20 ms of emulated compute per step,
the last worker 80 ms; ``size`` float32 parameters.

* **ddp**: PyTorch ``DistributedDataParallel``, gloo, CPU, 4 processes (one torch
  thread each), one flat parameter, ``gradient_as_bucket_view=True``; each rank
  sleeps its compute time, runs the backward of ``sum(w) * 1e-6`` (every parameter
  gets a gradient) and an SGD step. A step folds 4 workers' gradients into the
  model: ``updates/s`` is 4 x steps/s (the count the ratio uses), ``steps/s`` is
  printed too. Timed: a whole number of steps after 4 warm-up steps, from one
  barrier to the next.
* **ray-ps**: ``ray_runtime.plain_pattern`` (Ray's documented parameter server) on
  a local Ray instance started and stopped here, after 1 s of warm-up.
"""

import os
import shutil
import tempfile
import time
from datetime import timedelta

from ray_runtime import COMPUTE, IDEAL, SLOWDOWN, WORKERS, plain_pattern

DELAYS = [COMPUTE * (SLOWDOWN if w == WORKERS - 1 else 1.0) for w in range(WORKERS)]
WARMUP_STEPS, WARMUP_S = 4, 1.0


def _ddp_rank(rank: int, store: str, size: int, seconds: float, out) -> None:
    """One DDP rank: warm-up, then the step count rank 0 derives from it, timed on rank 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORKERS,
        timeout=timedelta(seconds=120),
    )  # fmt: skip

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(size))

        def forward(self):
            return self.w.sum() * 1e-6

    try:
        model = torch.nn.parallel.DistributedDataParallel(Flat(), gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            time.sleep(DELAYS[rank])
            opt.zero_grad()
            model().backward()
            opt.step()

        step()
        t = time.perf_counter()
        for _ in range(WARMUP_STEPS - 1):
            step()
        per = (time.perf_counter() - t) / (WARMUP_STEPS - 1)
        steps = torch.tensor([min(2000, max(5, round(seconds / per)))])
        dist.broadcast(steps, 0)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(int(steps)):
            step()
        dist.barrier()
        if rank == 0:
            out.put((int(steps), time.perf_counter() - t0))
    finally:
        dist.destroy_process_group()


def ddp(size: int, seconds: float, timeout: float = 600.0) -> dict:
    """DDP's steps/s and updates/s (4 x steps/s) at ``size`` parameters; the processes are
    killed if they have not finished within ``timeout`` seconds."""
    import multiprocessing as mp

    import torch.multiprocessing as tmp

    store = tempfile.mkdtemp(prefix="stalewise-ddp-")
    out = mp.get_context("spawn").Queue()
    ctx = tmp.start_processes(
        _ddp_rank, args=(os.path.join(store, "rendezvous"), size, seconds, out),
        nprocs=WORKERS, join=False, start_method="spawn",
    )  # fmt: skip
    try:
        end = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > end:
                raise RuntimeError(f"ddp at {size:,} params: not done within {timeout:g} s")
        steps, elapsed = out.get(timeout=10)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
        shutil.rmtree(store, ignore_errors=True)
    return {"steps/s": steps / elapsed, "updates/s": WORKERS * steps / elapsed}


def ray_ps(size: int, seconds: float) -> dict:
    """Ray's parameter-server pattern on a Ray instance of its own, stopped on return."""
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="warning")
    try:
        m = plain_pattern(ray, size, seconds, warmup=WARMUP_S)
    finally:
        ray.shutdown()
    return {"steps/s": float("nan"), "updates/s": m["updates/s"]}


def compare(size: int, own: float, seconds: float) -> list[dict]:
    """Rows for the own loop's ``own`` pushes/s and both baselines, run now, at ``size``;
    ``vs best`` is each row's updates/s over the best baseline's."""
    nan, load = float("nan"), [os.getloadavg()[0]]
    rows = [{"params": size, "system": "own loop", "steps/s": nan, "updates/s": own}]
    for name, fn in (("ddp", ddp), ("ray-ps", ray_ps)):
        rows.append({"params": size, "system": name, **fn(size, seconds)})
        load.append(os.getloadavg()[0])
        print(f"  {size:,} params, {name}: {rows[-1]['updates/s']:.1f} updates/s", flush=True)
    best = max(r["updates/s"] for r in rows[1:])
    for r, load1 in zip(rows, load, strict=True):
        r.update({"of ideal": r["updates/s"] / IDEAL, "vs best": r["updates/s"] / best})
        r["load1"] = load1
    return rows
