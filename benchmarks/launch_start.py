"""Time to the first push: ``stalewise run --workers 2 script.py`` against ``python script.py``.

The script imports torch, builds a small MLP and a :class:`stalewise.Job`, calls
``sw.init(job)`` and trains a few steps (pull, gradient, push). Unlaunched,
``sw.init`` serves the job in the script's process with one worker; launched, the
launcher serves it and starts 2 ranks. Measured: wall time from just before the
command starts to the job's first push (the earliest rank's, written by the script
to a file with ``time.time()``). Runs alternate (plain, launched, plain, ...) so load
that drifts hits both alike; printed: each run, the medians, their ratio, and the
load average before and after (the machine may be shared).

Issue #29 item 2: the launcher's shards and ranks imported the script again (torch
included) and each rank ran its top level twice; the launcher took 20-35 s to the
first step where a plain process took 4-11 s.

Measured on a shared 2-core machine at load 5.6-7.6 (one run each, noisy): plain
5.7 / 6.4 s, launched 18.2 / 17.5 s (medians of 3; ratio 3.2x / 2.8x). Against the
code before the fix, alternating launched runs (5 each, load 7.0-7.3): 14.4 s
median, before 17.5 s. What is left is the design: the launcher runs the script up
to ``sw.init`` (one plain start) before the ranks start and run it in their turn
(two more torch imports sharing the cores).

    python benchmarks/launch_start.py [--runs 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch
    import stalewise as sw

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )

    if __name__ == "__main__":
        job = sw.Job(model, optimizer=sw.optim.sgd(0.01))
        ctx = sw.init(job, steps=int(os.environ.get("STEPS", "20")))
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        first = True
        while not ctx.should_stop():
            ctx.client.pull(into=model)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            ctx.client.push({n: p.grad for n, p in model.named_parameters()})
            if first:
                first = False
                with open(os.environ["FIRST_PUSH"], "a") as f:
                    f.write(f"{time.time()!r}\\n")
        ctx.close()
    """
)


def once(cmd: list[str], folder: Path, n: int) -> float:
    """Seconds from the command's start to the job's first push."""
    mark = folder / f"first-{n}"
    env = {**os.environ, "FIRST_PUSH": str(mark)}
    start = time.time()
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return min(float(t) for t in mark.read_text().split()) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each (alternating)")
    parser.add_argument("--workers", type=int, default=2, help="the launcher's --workers")
    args = parser.parse_args()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        script = folder / "train.py"
        script.write_text(SCRIPT)
        plain_cmd = [sys.executable, str(script)]
        launched_cmd = [sys.executable, "-m", "stalewise", "run", "--workers",
                        str(args.workers), str(script)]  # fmt: skip
        plain, launched = [], []
        for i in range(args.runs):
            plain.append(once(plain_cmd, folder, 2 * i))
            print(f"run {i + 1}: python script.py          {plain[-1]:6.2f} s", flush=True)
            launched.append(once(launched_cmd, folder, 2 * i + 1))
            print(f"run {i + 1}: stalewise run --workers {args.workers} {launched[-1]:6.2f} s",
                  flush=True)  # fmt: skip
    p, q = statistics.median(plain), statistics.median(launched)
    print(f"time to the first push, median of {args.runs}: python script.py {p:.2f} s, "
          f"stalewise run --workers {args.workers} {q:.2f} s; ratio {q / p:.2f}x")  # fmt: skip
    print("load average (1, 5, 15 min): start "
          + ", ".join(f"{x:.2f}" for x in load_start) + "; end "
          + ", ".join(f"{x:.2f}" for x in os.getloadavg())
          + f"; {os.cpu_count()} cores")  # fmt: skip


if __name__ == "__main__":
    main()
