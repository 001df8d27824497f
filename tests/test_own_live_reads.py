"""Read-your-writes from the shards' live params, raced by real shard processes (issue #29).

A worker's default pull after its push copies the shard's live params (the
shard acks before it publishes) under a seqlock the shard holds odd around
every step. Here two other worker processes push without pause while worker 0
pushes and pulls: every pull races their steps. With SGD at learning rate 1 and
pushes of ones, every slice of a consistent read is uniform at minus its
version, so a torn copy (two versions mixed) is not uniform, and one older than
worker 0's acked push is above minus the acked version.
"""

import multiprocessing as mp

import mp_helpers
import numpy as np
import pytest

import stalewise as sw
from stalewise import optim

N = 1 << 20  # a copy of a slice takes long enough to overlap a step often
HAMMER_PUSHES = 400  # each of the two other workers'
MIN_PULLS = 200  # worker 0's pulls, at least (more while the others push)


@pytest.mark.parametrize("into", [False, True])  # into the pull buffer, or a tree's arrays
def test_a_pull_racing_other_workers_steps_is_never_torn_nor_older_than_its_push(no_leaks, into):
    job = sw.Job({"x": np.zeros(N, np.float32)}, optimizer=optim.sgd(1.0), shards=2)
    ranges = job.config.ranges
    ctx = mp.get_context("spawn")
    with job.serve(workers=3) as server:
        procs = []
        client = server.client(0)
        try:
            for w in (1, 2):
                p = ctx.Process(
                    target=mp_helpers.uniform_pusher, args=(server.client(w), HAMMER_PUSHES)
                )
                p.start()
                server.release(w)
                procs.append(p)
            client.pull(timeout=60)
            ones, mine = {"x": np.ones(N, np.float32)}, {"x": np.zeros(N, np.float32)}
            pulls, raced = 0, 0
            while pulls < MIN_PULLS or any(p.is_alive() for p in procs):
                client.push(ones, timeout=60)
                x = client.pull(copy=False, into=mine if into else None, timeout=60)["x"]
                acked = client.wait(timeout=60).versions  # acks read after the pull
                for k, (lo, hi) in enumerate(ranges):
                    value = float(x[lo])
                    torn = np.flatnonzero(x[lo:hi] != value)
                    assert not torn.size, (
                        f"pull {pulls}: shard {k}'s slice is torn: {value} at {lo}, "
                        f"{float(x[lo + torn[0]])} at {lo + torn[0]}"
                    )
                    assert -value >= acked[k], (
                        f"pull {pulls}: shard {k}'s slice is at version {-value}, "
                        f"older than the acked push's {acked[k]}"
                    )
                    raced += -value > acked[k]  # another worker's step came in between
                pulls += 1
                assert pulls < 20 * MIN_PULLS, "the other workers never finished"
            for p in procs:
                p.join(60)
                assert p.exitcode == 0, p.exitcode
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            client.close()
        versions = [s["version"] for s in server.stats()]
    assert versions == [pulls + 2 * HAMMER_PUSHES] * 2, versions
    assert raced  # the other workers' steps did interleave with worker 0's pulls
    assert client.own_requests < 2 * pulls  # most reads needed no request to the shard
