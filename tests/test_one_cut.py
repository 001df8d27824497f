"""A checkpoint of ``stalewise run`` is one consistent cut (issue #42 item 1): the
launcher is SIGKILLed at random moments and started again with ``--resume``, and every
data item is applied exactly once. The one-hot job: rank ``r``'s ``i``-th push adds 1 to
item ``(r, i)`` of the parameters, so an item applied twice (a resume that repeats the
pushes made after a rank's saved ``ctx.state``) or skipped shows in the final ones."""

from __future__ import annotations

import random
import signal
import subprocess
import textwrap
import time

import child_procs
import numpy as np
import pytest

import stalewise as sw
from stalewise import checkpoint
from stalewise.protocol import PushHeader, budget

STEPS, EVERY, WORKERS, KILLS = 1200, 20, 2, 3

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import stalewise as sw

    if __name__ == "__main__":
        steps, workers, bsp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "bsp"
        # BSP applies a round's mean: a learning rate of `workers` makes each item 1
        job = sw.Job({"items": np.zeros((workers, steps), np.float32)},
                     optimizer=sw.optim.sgd(float(workers) if bsp else 1.0),
                     consistency=sw.BSP() if bsp else sw.ASP())
        ctx = sw.init(job)
        while not ctx.should_stop():
            i = ctx.state.get("i", 0)
            ctx.client.pull()
            g = np.zeros((workers, steps), np.float32)
            g[ctx.rank, i] = -1.0
            ctx.client.push({"items": g})
            ctx.state["i"] = i + 1
            time.sleep(0.004)
        ctx.close()
    """
)


def test_the_cut_rule_names_a_push_on_one_shard_and_a_rank_state_off_the_cut():
    """The rule (no processes): every shard's state holds the same pushes of a worker, and
    its rank's ``ctx.state`` is after exactly those."""
    params = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(1.0), shards=2)
    shards = [job.config.build_shard(k, job.config.init[lo:hi].copy(), workers=2)
              for k, (lo, hi) in enumerate(job.config.ranges)]  # fmt: skip
    for shard in shards:
        shard.join(0, incarnation=1)
        shard.push(PushHeader(0, 0, 0, 1), np.ones(2, np.float32))
    states = [s.state_dict() for s in shards]
    assert budget.off_cut(states, 0, held=1, state=1) is None
    assert budget.off_cut(states, 1, held=0, state=None) is None  # no push, no state
    assert budget.off_cut(states, 0, held=1, state=0) == (
        "rank 0's ctx.state is after 0 of its pushes, the shards' after 1: "
        "a resume repeats 1 of them"
    )
    assert "skips 2" in budget.off_cut(states, 0, held=1, state=3)
    shards[1].push(PushHeader(0, 1, 1, 1), np.ones(2, np.float32))  # in flight to shard 0
    split = [shards[0].state_dict(), shards[1].state_dict()]
    assert budget.off_cut(split, 0, held=1, state=1) == (
        "worker 0: the shards hold different pushes of it, [(1, 1), (1, 2)]"
    )


def _launch(tmp_path, consistency: str, resume: bool):
    args = ["--workers", str(WORKERS), "--steps", str(STEPS), "--checkpoint-dir", "ckpt"]
    args += ["--checkpoint-every", str(EVERY), *(["--resume"] if resume else [])]
    args += ["job.py", str(STEPS), str(WORKERS), consistency]
    return child_procs.launched(tmp_path, *args, stdout=subprocess.DEVNULL)


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
def test_every_item_is_applied_once_across_random_kills(tmp_path, consistency):
    (tmp_path / "job.py").write_text(SCRIPT)
    rng = random.Random(42 if consistency == "asp" else 43)
    ckpts = tmp_path / "ckpt"
    kills = 0
    for attempt in range(KILLS + 1):
        with _launch(tmp_path, consistency, resume=attempt > 0) as proc:
            if attempt < KILLS:  # killed at a random moment once it has saved something new
                seen = checkpoint.load(ckpts).version if checkpoint.exists(ckpts) else -1
                deadline = time.monotonic() + 120
                while proc.poll() is None and time.monotonic() < deadline:
                    if checkpoint.exists(ckpts) and checkpoint.load(ckpts).version > seen:
                        break
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 1.0))
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)  # the launcher alone: its ranks follow
                    kills += 1
            proc.wait(timeout=180)
            err = proc.stderr.read()
        if attempt == KILLS:
            assert proc.returncode == 0, err
    assert kills >= 2, "the runs ended before they could be killed"
    final = checkpoint.load(ckpts)
    items = final.flat().reshape(WORKERS, STEPS)
    made = [int(r["i"]) for r in final.ranks]
    assert sum(made) == final.step["pushes"] >= STEPS, (made, final.step)
    for r, n in enumerate(made):
        twice = np.flatnonzero(items[r] > 1.5).tolist()
        skipped = np.flatnonzero(items[r, :n] < 0.5).tolist()
        assert not twice and not skipped, f"rank {r}: twice {twice}, skipped {skipped}"
        np.testing.assert_array_equal(items[r, :n], 1.0)
        np.testing.assert_array_equal(items[r, n:], 0.0)
