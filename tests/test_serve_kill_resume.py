"""A SIGKILLed ``job.serve`` process loses no acknowledged push after a resume (issue #45,
bar 3): served again with ``sw.Checkpoints(resume=True)``, it replays the shards' push logs,
and each attached worker goes on from ``client.pushed`` (its pushes the shards hold), so
every data item is applied exactly once.

The job and its harness are ``benchmarks/faults.py``'s case (i) (``_serve_kills``): worker
``w``'s ``i``-th push adds exactly 1 to item ``(w, i)``, so an item applied twice or skipped
shows in the final parameters; each worker appends every count of its pushes it saw
acknowledged to a file, which a resumed run must start from or past. Every process the
harness starts is SIGKILLed (its session) at the end of its run, whatever happens."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
KILLS, STEPS, EVERY = 2, 600, 50  # STEPS: pushes of the job, half each worker's


@pytest.fixture(scope="module")
def faults():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import faults

        yield faults
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("faults", None)


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
def test_a_killed_serving_process_resumes_with_each_acknowledged_push_and_item_once(
    tmp_path, faults, consistency
):
    rng = random.Random(f"{consistency}-serve-45")
    row = faults._serve_kills(tmp_path, consistency, KILLS, STEPS, EVERY, rng, timeout=90)
    assert row["completed"] == "yes" and row["kills"] == KILLS, row
    assert (row["acked_lost"], row["twice"], row["skipped"]) == (0, 0, 0), row
    assert row["replayed"] > 0, row  # the resumes took pushes from the logs
