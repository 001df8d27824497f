"""The README's GPT walkthrough timed: launched workers against one single-threaded process.

``examples/gpt/train.py`` (one process, its own AdamW) and ``stalewise run --workers
N examples/gpt/train_launched.py`` (the server's AdamW under BSP, each rank one
thread) train on the same number of batches: train.py takes 400 steps of 16
sequences, and the launched job's budget is 400 pushes of 16 sequences, so
``400 / N`` rounds of ``N`` batches. Measured for each run: the training loop's
tokens per second (from the moment the last rank printed its loss at init to the
moment the last rank printed its final validation loss, so imports, the launcher's
start and the first evaluation are left out, the last evaluation is in) and that
final validation loss. Printed as ratios against ``train.py`` on one thread, run
in the same invocation; rows run one after another (set ``--repeats`` for more).

    python benchmarks/gpt_walkthrough.py [--workers 2 4] [--repeats 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _report

from stalewise import report

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt"
TOKENS = 400 * 16 * 64  # STEPS x BATCH x block_size, in train.py and train_launched.py
INIT = re.compile(r"val loss ([0-9.]+) at init")
FINAL = re.compile(r"rank \d+: val loss ([0-9.]+)")


def once(name: str, cmd: list[str], threads: int | None, ranks: int) -> dict:
    """Runs ``cmd`` and times its loop from its ranks' printed lines."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as out:
        env["OUT_DIR"] = out
        proc = subprocess.Popen(cmd, cwd=GPT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        inits, finals, lines = [], [], []
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic()
            lines.append(line)
            if INIT.search(line):
                inits.append(now)
            elif m := FINAL.search(line):
                finals.append((now, float(m.group(1))))
        code = proc.wait(timeout=60)
    if code != 0 or len(inits) < ranks or len(finals) < ranks:
        raise SystemExit(f"{name}: exit {code}, {len(inits)} starts, {len(finals)} ends:\n"
                         + "".join(lines[-30:]))  # fmt: skip
    seconds = max(t for t, _ in finals) - max(inits)
    losses = [v for _, v in finals]
    return {"run": name, "seconds": seconds, "tokens/s": TOKENS / seconds,
            "val loss": min(losses), "val loss (ranks)": losses}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=1)
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "gpt_walkthrough")
    load = [os.getloadavg()]
    py = [sys.executable]
    runs = [("train.py, 1 thread", [*py, "train.py"], 1, 1),
            ("train.py, 2 threads", [*py, "train.py"], 2, 1)]  # fmt: skip
    for n in args.workers:
        cmd = [*py, "-m", "stalewise", "run", "--workers", str(n), "train_launched.py"]
        runs.append((f"stalewise run --workers {n}", cmd, None, n))
    rows = []
    for _ in range(args.repeats):
        for name, cmd, threads, ranks in runs:
            rows.append(once(name, cmd, threads, ranks))
            print(f"  {name}: {rows[-1]['seconds']:.1f} s, val loss {rows[-1]['val loss']:.3f}",
                  flush=True)  # fmt: skip
    load.append(os.getloadavg())
    base = [r for r in rows if r["run"] == runs[0][0]]
    base_rate = sum(r["tokens/s"] for r in base) / len(base)
    for r in rows:
        r["vs 1 thread"] = r["tokens/s"] / base_rate
    print(f"\n{TOKENS:,} tokens in every run (400 batches of 16 x 64); the loop's tokens/s "
          f"against train.py on one thread; load average (1 min) {load[0][0]:.2f} at the start, "
          f"{load[1][0]:.2f} at the end, {os.cpu_count()} cores")  # fmt: skip
    print(report.format_table(rows, ["run", "seconds", "tokens/s", "vs 1 thread", "val loss"]))
    _report.write(out, {"tokens": TOKENS, "load": load, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
