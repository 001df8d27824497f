"""A SIGKILLed shard of the local runtime is rebuilt from its push log, for real: the workers
carry on (the same processes), every push a worker counted is handled once by every shard,
the optimizer state is kept, and the logs replay past each death to the final parameters bit
for bit. Job.train stops every process
it started, even when the test fails (the ``no_leaks`` fixture checks)."""

import logging
import multiprocessing as mp
import os
import random
import signal
import time

import mp_helpers
import numpy as np
import pytest
from test_one_cut import ONES, pushes
from test_replay import paced_loss_and_grad_b

import stalewise as sw
from stalewise.checkpoint import replay, store
from stalewise.protocol import pushlog
from stalewise.runtime.local.server import LocalServer


class Kills:
    """An ``on_record`` that SIGKILLs a :meth:`victim` at random moments, ``n`` times (the
    first after ``first`` seconds, then every ``gap``: uniform ranges)."""

    first, gap = (0.3, 1.0), (0.2, 1.0)

    def __init__(self, n, seed):
        self.rng, self.left, self.pids = random.Random(seed), n, []
        self.next = self.rng.uniform(*self.first)
        self.workers = set()  # the pids of every worker process seen at a record

    def victim(self, procs):
        """A random shard process (None: none now)."""
        shards = [p for p in procs if p.name.startswith("stalewise-shard-")]
        return self.rng.choice(shards) if shards else None

    def __call__(self, rec):
        procs = mp.active_children()
        self.workers |= {p.pid for p in procs if p.name.startswith("stalewise-worker-")}
        if self.left and rec["time"] >= self.next:
            victim = self.victim(procs)
            if victim is not None:
                os.kill(victim.pid, signal.SIGKILL)
                self.pids.append(victim.pid)
                self.left -= 1
            self.next = rec["time"] + self.rng.uniform(*self.gap)


def train(job, folder, on_record=None, **kw):
    return job.train(
        paced_loss_and_grad_b,
        data=mp_helpers.counting_data,
        workers=4,
        steps=400,
        checkpoints=sw.Checkpoints(folder, every=100, keep=100),
        metrics=sw.Metrics(every=0.05, on_record=on_record),
        timeouts=sw.Timeouts(total=150),
        **kw,
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_killed_shards_lose_nothing_and_the_logs_replay_past_each_death(seed, tmp_path, no_leaks):
    params = {"x": np.zeros(8, np.float32), "b": np.ones(300, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.adam(0.05), shards=2)
    kills = Kills(3, seed)
    kills.gap = (0.1, 0.4)  # a warm shard restarts in a blink: the run may end before 1-2 s gaps
    result = train(job, tmp_path, kills)
    assert len(kills.pids) == 3
    restarted = [e for e in result.failures if "shard" in e]
    assert len(restarted) == 3 and all(e["action"] == "restarted" for e in restarted)
    assert all(e["lost"] == 0 for e in restarted), restarted
    assert len(kills.workers) == 4, kills.workers  # the same worker processes throughout
    final = store.load(tmp_path)
    assert final.flat().tobytes() == result.flat.tobytes()
    # every push the workers counted (at commit) handled once by each shard, none twice
    applied = [int(s["stats.applied"]) for s in final.states]
    versions = [int(s["version"]) for s in final.states]
    assert applied == versions == [result.pushes] * 2, (applied, versions, result.pushes)
    # the first checkpoint (before any kill) and its logs replay past every death (adam:
    # the optimizer state was kept, else the restarted shard's params would differ)
    kept = [p.name for p in store._complete(tmp_path)]
    first = min(kept)
    flat, ckpt, logs = replay.replay(tmp_path, job.config, first)
    assert ckpt.step["pushes"] < 120, ckpt.step
    assert flat.tobytes() == result.flat.tobytes(), (first, logs)


def wait_for(condition, what, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def kill(server, k):
    """SIGKILLs shard ``k`` and waits until the OS reports its exit (restart_shard's premise)."""
    os.kill(server._procs[k].pid, signal.SIGKILL)
    wait_for(lambda: k in server.dead_shards(), f"shard {k} is seen dead")


def two_shards(optimizer):
    """A job of 8 floats on 2 shards (4 each)."""
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    return sw.Job(params, optimizer=optimizer, shards=2)


def test_a_restart_drops_a_torn_entry_completes_a_torn_push_and_goes_on_with_the_chain(
    tmp_path, no_leaks
):
    """Shard 1 is stopped, a push reaches shard 0 only (torn), shard 1 is killed and its log
    gets half an entry: the restart drops that, delivers the push, and appends to the log."""
    job = two_shards(sw.optim.adam(0.1))
    with LocalServer(job.config, workers=1) as server:
        client = server.client(0)
        states, step, _ = server.checkpoint_parts(timeout=30, log_dir=str(tmp_path))
        pushes(client, 3)
        os.kill(server._procs[1].pid, signal.SIGSTOP)
        client.push(ONES, timeout=10)
        wait_for(lambda: server.published_version(0) == 4, "shard 0 applies the push")
        kill(server, 1)
        client.close()
        with open(tmp_path / step["logs"][1], "ab") as f:
            f.write(pushlog.MAGIC + b"\x10\x00")  # a crash mid-write
        info = server.restart_shard(1, timeout=30)
        assert (info["source"], info["version"], info["lost"]) == ("push log", 4, 0)
        client = server.client(0)
        pushes(client, 2)
        client.close()
        final = server.state_dicts(timeout=30)
    assert [s["version"] for s in final] == [6, 6]
    for k in (0, 1):  # the chain replays across the death to the end, optimizer state too
        shard = job.config.build_shard(k, np.array(states[k]["params"]), 1)
        shard.load_state_dict(states[k])
        read, _ = replay.replay_chain(shard, tmp_path, step["logs"][k])
        assert read == [step["logs"][k]]
        for key, value in shard.state_dict().items():
            if key.startswith(("params", "opt.", "version", "next_seq", "incarnation")):
                np.testing.assert_array_equal(value, final[k][key], err_msg=f"{k}: {key}")


@pytest.mark.parametrize("logged", [False, True])
def test_a_worker_keeps_its_incarnation_and_its_unanswered_push_counts_once(
    logged, tmp_path, no_leaks
):
    """Shard 1 dies before the push reaches it (torn: applied now) or after it logged and
    applied it, its ack unread (a duplicate): the client takes the restarted shard's new
    pipe, resends, and its incarnation goes on; every shard applies the push once."""
    job = two_shards(sw.optim.adam(0.1))
    with LocalServer(job.config, workers=1) as server:
        client = server.client(0)
        server.checkpoint_parts(timeout=30, log_dir=str(tmp_path))
        pushes(client, 3)
        if not logged:
            os.kill(server._procs[1].pid, signal.SIGSTOP)
        client.push(ONES, timeout=10)
        wait_for(lambda: server.published_version(int(logged)) == 4, "the push is applied")
        kill(server, 1)
        exits = server.control[server.layout.shard_exits]
        wait_for(lambda: not np.isnan(exits[1]), "the client can see shard 1 is dead")

        def rejoin(k):
            assert server.restart_shard(k, timeout=30, keep=(0,))["source"] == "push log"
            return server.rejoin(k, 0)

        client.rejoin = rejoin
        assert client.wait(timeout=30).status == "applied"
        pushes(client, 2)
        client.close()
        final = server.state_dicts(timeout=30)
    assert [s["version"] for s in final] == [6, 6]
    assert [int(s["stats.applied"]) for s in final] == [6, 6]
    assert [int(s["stats.duplicates"]) for s in final] == [0, int(logged)]
    assert [int(s["incarnation"][0]) for s in final] == [1, 1]


def test_without_a_log_a_restart_is_as_before_and_says_so(caplog, no_leaks):
    job = two_shards(sw.optim.sgd(0.1))
    with LocalServer(job.config, workers=1) as server:
        client = server.client(0)
        pushes(client, 2)
        client.close()
        kill(server, 1)
        with caplog.at_level(logging.WARNING):
            info = server.restart_shard(1, timeout=30)
    assert info["source"] == "published snapshot"
    assert "shard 1: no push log (no checkpoint folder)" in caplog.text


def test_a_restart_from_a_broken_log_takes_the_published_snapshot_and_says_so(
    tmp_path, caplog, no_leaks
):
    """A log that is gone (as one that failed to write is removed) replays to less than the
    shard published: the restart takes the snapshot, never rolls the shard back silently."""
    job = two_shards(sw.optim.sgd(0.1))
    with LocalServer(job.config, workers=1) as server:
        client = server.client(0)
        _, step, _ = server.checkpoint_parts(timeout=30, log_dir=str(tmp_path))
        pushes(client, 5)
        client.close()
        wait_for(lambda: server.published_version(1) == 5, "shard 1 publishes the pushes")
        os.unlink(tmp_path / step["logs"][1])
        kill(server, 1)
        with caplog.at_level(logging.WARNING):
            info = server.restart_shard(1, timeout=30)
        final = server.state_dicts(timeout=30)
    assert (info["source"], info["version"]) == ("published snapshot", 5), info
    assert [s["version"] for s in final] == [5, 5]
    assert "shard 1: no push log (it broke" in caplog.text


def test_a_worker_whose_seat_left_before_the_kill_is_refused_not_left_waiting(tmp_path, no_leaks):
    """Shard 1 cut worker 0 off (a malformed message) and died before the worker read its
    error: the restarted shard has the seat departed, so the worker's new pipe is refused
    at once, in one line, instead of its pull waiting on a seat that is gone."""
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    served = sw.staleness.constant(dc_lambda=0.1)  # DC-ASGD: every pull is served
    job = sw.Job(params, optimizer=sw.optim.sgd(0.1), shards=2, staleness=served)
    with LocalServer(job.config, workers=1) as server:
        client = server.client(0)
        server.checkpoint_parts(timeout=30, log_dir=str(tmp_path))
        pushes(client, 2)
        client._conns[1].send_bytes(b"\xff" * 8)  # malformed: shard 1 disconnects worker 0
        client._conns[1].recv_bytes()  # its error reply, which the worker never saw
        wait_for(lambda: not server.state_dicts(timeout=30)[1]["live"][0], "worker 0 left")
        kill(server, 1)

        def rejoin(k):
            assert server.restart_shard(k, timeout=30, keep=(0,))["source"] == "push log"
            return server.rejoin(k, 0)

        client.rejoin = rejoin
        began = time.monotonic()
        with pytest.raises(sw.ServerClosed, match=r"worker 0 .*left the job"):
            client.pull(timeout=20)
        assert time.monotonic() - began < 10
        client.close()
