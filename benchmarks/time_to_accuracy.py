"""Time to 95% held-out accuracy in the demo's setting: asynchronous vs synchronous.

Runs the demo's two runs (BSP, then ASP with inverse staleness; LAMB on the server; the
digits MLP, 4 local workers, the last one 4x slower) several times, alternating,
and prints each pair's ratio and the median ratio.

Bar: asynchronous training reaches 95% in at most 0.6x the wall time of synchronous.

    .venv/bin/python benchmarks/time_to_accuracy.py [--repeats 3] [--check]
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from stalewise import demo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="exit 1 if the bar is missed")
    args = ap.parse_args()
    ratios = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as out:
            rows = demo.run(Path(out), progress=False)
        sync, asyn = (r["time_to_95%_s"] for r in rows)
        ratio = asyn / sync if sync and asyn else float("nan")
        ratios.append(ratio)
        print(f"repeat {i}: synchronous {sync} s, asynchronous {asyn} s, ratio {ratio:.2f}")
    med = statistics.median(ratios)
    ok = med <= 0.6
    print(
        f"\nmedian ratio async/sync time to 95%: {med:.2f} (bar <= 0.6) ->",
        "met" if ok else "MISSED",
    )
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
