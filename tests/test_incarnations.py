"""The local runtime follows the protocol: incarnations, identity from the pipe, the commit rule."""

import math
import multiprocessing as mp
import os
import random
import signal
import time

import mp_helpers
import numpy as np
import pytest

import stalewise as sw
from stalewise import ServerClosed
from stalewise.protocol import PushHeader
from stalewise.runtime.local import wire


def two_shard_job(n=4, **kw):
    return sw.Job(
        {"a": np.zeros(n, np.float32), "b": np.zeros(n, np.float32)},
        optimizer=sw.optim.sgd(1.0),
        shards=2,
        **kw,
    )


def ones(n=4):
    return {"a": np.ones(n, np.float32), "b": np.ones(n, np.float32)}


def test_a_restarted_worker_is_a_new_incarnation_and_is_not_muted(no_leaks):
    with two_shard_job().serve(workers=1) as server:
        first = server.client(0)
        first.pull(timeout=10)
        for _ in range(3):
            first.push(ones())
        assert first.wait(timeout=10).status == "applied"
        again = server.client(0)  # the worker restarted: a new incarnation, seq 0 again
        assert again.incarnation == first.incarnation + 1
        again.pull(timeout=10)
        statuses = []
        for _ in range(7):
            again.push(ones())
            statuses.append(again.wait(timeout=10).status)
        assert statuses == ["applied"] * 7  # none taken for a replay of the old incarnation
        assert [s["version"] for s in server.stats()] == [10, 10]
        np.testing.assert_array_equal(server.pull()["a"], np.full(4, -10.0))
        with pytest.raises((ServerClosed, OSError)):
            first.push(ones())  # the old incarnation's pipes were cut
            first.wait(timeout=10)
        first.close()
        again.close()


def test_a_restarted_worker_is_gated_like_the_others_under_bsp(no_leaks):
    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(1.0), consistency=sw.BSP())
    ones = {"x": np.ones(4, np.float32)}
    with job.serve(workers=2) as server:
        c0, c1 = server.client(0), server.client(1)
        for c in (c0, c1):  # round 1: both push
            c.pull(timeout=10)
            c.push(ones)
        for c in (c0, c1):
            c.wait(timeout=10)
        c0.pull(timeout=10)  # round 2 starts for worker 0
        c1.close()
        c1 = server.client(1)  # worker 1 restarts: a new incarnation, clocks count from 0 again
        c1.pull(timeout=10)
        c1.push(ones)
        c1.wait(timeout=10)
        with pytest.raises(TimeoutError):  # worker 0 has not pushed in round 2: wait for it
            c1.pull(timeout=0.5)
        c0.push(ones)
        c0.wait(timeout=10)
        pulled = c1.pull(timeout=10)  # the round closed: now it may start, from round 2's mean
        np.testing.assert_array_equal(pulled["x"], np.full(4, -2.0, np.float32))


def test_identity_comes_from_the_pipe_not_the_message(no_leaks):
    """A push in another worker's name is refused and disconnects its sender; the other is unharmed.

    A push message carries only a sequence number: the shard reads the record of
    the worker whose pipe it came on. Worker 1 has committed push 0; worker 0
    announcing "push 0" on its own pipe has no record, so it is cut off, and
    worker 1's push is applied once, when worker 1 announces it.
    """
    with two_shard_job().serve(workers=2) as server:
        liar, honest = server.client(0), server.client(1)
        liar.pull(timeout=10), honest.pull(timeout=10)
        honest.push_buffer[:] = 1.0
        honest._commit()  # committed, not yet announced
        liar._conns[0].send_bytes(wire.push(0))  # worker 1's push number, on worker 0's pipe
        with pytest.raises(ServerClosed, match="push 0, which has no committed record"):
            liar._take(0, "ack", 10)
        with pytest.raises(ServerClosed, match="shard 0: disconnected worker 0"):
            liar.push(ones())  # cut off: it commits nothing more
        assert [s["version"] for s in server.stats()] == [0, 0]
        for c in honest._conns:
            c.send_bytes(wire.push(0))
        honest._sender.committed()  # push 0, announced
        honest._acks_due = [True, True]
        assert honest.wait(timeout=10).status == "applied"
        # the old pickled form, which named the worker, is not a message at all
        liar2 = server.client(0)
        liar2.pull(timeout=10)
        liar2._conns[1].send(("push", PushHeader(1, 1, 0, 1)))
        with pytest.raises(ServerClosed, match=r"disconnected worker 0 \(2\): sent an oversize"):
            liar2._take(1, "ack", 10)
        honest.push(ones())
        assert honest.wait(timeout=10).status == "applied"
        assert [s["applied"] for s in server.stats()] == [2, 2]
        assert [s["version"] for s in server.stats()] == [2, 2]
        honest.close()
        liar.close()
        liar2.close()


def test_a_push_committed_but_never_announced_is_delivered_by_every_shard(no_leaks):
    """The sender dies right after the commit word: shards that heard nothing still apply it."""
    with two_shard_job().serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=10)
        client.push(ones())
        client.wait(timeout=10)
        client.push_buffer[:] = 2.0
        client._commit()  # committed, then the "process" dies before telling any shard
        for c in client._conns:
            c.close()
        deadline = time.monotonic() + 10
        while [s["version"] for s in server.stats()] != [2, 2]:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.01)
        np.testing.assert_array_equal(server.pull()["a"], np.full(4, -3.0))
        np.testing.assert_array_equal(server.pull()["b"], np.full(4, -3.0))
        client.close()


def test_a_push_announced_to_one_shard_only_is_applied_by_both(no_leaks):
    with two_shard_job().serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=10)
        client.push_buffer[:] = 1.0
        client._commit()
        client._conns[0].send_bytes(wire.push(0))  # shard 0 hears of it, then the sender dies
        for c in client._conns:
            c.close()
        deadline = time.monotonic() + 10
        while [s["version"] for s in server.stats()] != [1, 1]:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.01)
        assert [s["applied"] for s in server.stats()] == [1, 1]  # exactly once on each
        client.close()


def test_an_uncommitted_push_is_applied_by_no_shard(no_leaks):
    with two_shard_job().serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=10)
        client.push_buffer[:] = 1.0  # written, never committed: the sender died first
        for c in client._conns:
            c.close()
        # each shard has seen the pipe close and run its departure, which is where a
        # committed push of a dead sender is delivered (the test above): wait for that event
        deadline = time.monotonic() + 30  # a guard against a hang only
        while any(s["live"][0] for s in server.state_dicts()):
            assert time.monotonic() < deadline, "the shards never saw worker 0 leave"
            time.sleep(0.01)
        assert [s["version"] for s in server.stats()] == [0, 0]
        assert [s["applied"] for s in server.stats()] == [0, 0]
        client.close()


def test_sigkill_while_pushing_to_two_shards_never_tears_a_push(no_leaks):
    """Kill a pushing worker at random instants; the shards always end at the same version."""
    n = 200_000  # big enough that a push takes a while, so kills land in every phase
    job = two_shard_job(n)
    ctx = mp.get_context("spawn")
    rng = random.Random(7)
    kills = 12
    with job.serve(workers=1) as server:
        for _ in range(kills):
            ready = ctx.Event()
            p = ctx.Process(target=mp_helpers.push_forever, args=(server.client(0), ready))
            p.start()
            server.release(0)
            try:
                assert ready.wait(60), "the pusher did not start"
                time.sleep(rng.uniform(0.0, 0.05))
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
            finally:
                if p.is_alive():
                    p.kill()
                    p.join()
        server.client(0).close()  # the shards finish the last incarnation before this returns
        stats = server.stats()
        versions = [s["version"] for s in stats]
        assert versions[0] == versions[1] and versions[0] >= kills, stats
        assert stats[0]["applied"] == stats[1]["applied"]
        params = server.pull()
        assert params["a"][0] == params["b"][0] == -versions[0]


def test_an_expected_worker_that_never_starts_stops_blocking_bsp(no_leaks, capfd):
    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(1.0), consistency=sw.BSP())
    with job.serve(workers=2, timeouts=sw.Timeouts(join=1.0)) as server:
        c0 = server.client(0)
        c0.pull(timeout=10)
        c0.push({"x": np.ones(4, np.float32)})
        t0 = time.monotonic()
        c0.pull(timeout=20)  # waits for worker 1's lease to run out, then the round closes
        assert 0.5 < time.monotonic() - t0 < 15
        np.testing.assert_array_equal(server.pull()["x"], -np.ones(4))
        c0.close()
    assert "worker(s) 1 did not start within 1 s" in capfd.readouterr().err


def test_stop_at_a_loss_stops_when_the_loss_is_low_not_at_once(no_leaks):
    job = sw.Job({"x": np.zeros(8, np.float32)}, optimizer=sw.optim.sgd(0.01))
    result = job.train(
        mp_helpers.quadratic_loss_and_grad,
        data=mp_helpers.quadratic_data,
        workers=2,
        steps=20_000,
        stop_at={"loss": 1e-3},
        metrics=sw.Metrics(every=0.05),
        emulation=sw.Emulation(delays={0: 0.002, 1: 0.002}),  # about 0.6 s of pushes to get there
    )
    losses = [r["loss"] for r in result.records]
    reached = [i for i, loss in enumerate(losses) if loss <= 1e-3]
    # the first record is taken at once, before any push: no train loss yet (NaN)
    measured = [loss for loss in losses if math.isfinite(loss)]
    assert measured[0] > 1e-3 and reached, losses
    # it stopped at the first record that reached the target; the run's last record
    # (the workers' noisy train loss once they stopped) may follow it
    assert reached[0] >= len(losses) - 2, losses
    assert 100 < result.pushes < 20_000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": sw.optim.sgd}, r"optimizer must be a Optimizer .*the function sgd"),
        (
            {"optimizer": sw.optim.sgd(0.1), "consistency": sw.SSP},
            r"consistency must be a Consistency .*the function SSP",
        ),
        (
            {"optimizer": sw.optim.sgd(0.1), "staleness": "inverse"},
            r"staleness must be a Staleness .*got str 'inverse'",
        ),
        ({"optimizer": sw.optim.sgd(0.1), "strategy": "gradients"}, r"strategy must be a Strategy"),
        ({"optimizer": sw.optim.sgd(0.1), "shards": 0}, r"shards must be an integer >= 1"),
    ],
)
def test_job_checks_its_arguments_when_it_is_made(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        sw.Job({"x": np.zeros(4, np.float32)}, **kwargs)
