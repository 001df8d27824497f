"""A push through the local client carries each shard's sum of squares, measured as the
client writes it, and the shard's bound uses it instead of reading the payload again: the
same values, and the same refusals, as a push whose shards measure it themselves."""

import numpy as np
import pytest

import stalewise as sw
from stalewise.protocol import PushHeader, Shard, commit
from stalewise.segments import Segments

F32_MAX = float(np.finfo(np.float32).max)
# (with lr 1e20, "over" is a finite gradient whose step overflows the params)
BAD = {"nan": np.nan, "inf": np.inf, "huge": 1e20, "max": F32_MAX, "over": -1e19}


def update(a=0.5):
    g = {"a": np.full(3000, 0.25, np.float32), "b": np.full(5000, -0.5, np.float32)}
    g["a"][3] = g["b"][4000] = a  # in each shard's slice
    return g


def unmeasured(client, g):
    """The push as before: written into the push buffer, so its shards measure it."""
    buf = client.push_buffer
    buf[:3000], buf[3000:] = g["a"], g["b"]
    client.push_flat_sent()


@pytest.mark.parametrize("stream", [False, True])  # the copy's stores cached or streamed
@pytest.mark.parametrize("shards", [1, 2])
def test_bad_gradients_measured_by_the_client_are_refused_as_before(
    no_leaks, monkeypatch, shards, stream
):
    monkeypatch.setattr(sw.tree, "STREAM", 0 if stream else 1 << 40)
    monkeypatch.setattr(sw.tree, "BLOCK", 1000)  # blocks across the leaves' and shards' ends
    job = sw.Job(
        {"a": np.zeros(3000, np.float32), "b": np.zeros(5000, np.float32)},
        optimizer=sw.optim.sgd(1e20),
        shards=shards,
    )
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=10)
        client.push(update())
        assert client.wait(timeout=10).applied
        flat = np.concatenate([update()["a"], update()["b"]]).astype(np.float64)
        rec = client._record.copy()
        sums = [server.layout.sumsq(rec, k) for k in range(shards)]
        want = [float(flat[lo:hi] @ flat[lo:hi]) for lo, hi in server.config.ranges]
        assert sums == pytest.approx(want)
        unmeasured(client, update())
        assert client.wait(timeout=10).applied
        assert [server.layout.sumsq(client._record, k) for k in range(shards)] == [None] * shards
        before, versions = server.pull(), client.last_result.versions
        for name, bad in BAD.items():
            results = []
            for push in (client.push, lambda g: unmeasured(client, g)):
                push(update(bad))
                results.append(client.wait(timeout=10))
            measured, shard_measured = results
            assert measured.status == "refused", (name, measured)
            assert measured.kind == ("not_finite" if name in ("nan", "inf") else "overflow")
            assert measured[1:4] == shard_measured[1:4], name  # status, reason, kind
            assert measured.versions == shard_measured.versions == versions
            after = server.pull()
            assert all(after[k].tobytes() == before[k].tobytes() for k in before), name
        client.push(update())
        assert client.wait(timeout=10).applied
        client.close()


def test_a_shard_given_the_sum_of_squares_steps_and_refuses_as_one_that_measures_it():
    def shard():
        s = Shard(np.full(6000, 0.5, np.float32), Segments.single(6000), sw.optim.sgd(0.1),
                  workers=1)  # fmt: skip
        s.join(0, 1)
        return s

    for g in (
        np.full(6000, 0.25, np.float32),
        *(np.full(6000, v, np.float32) for v in BAD.values()),
    ):
        told, measuring = shard(), shard()
        sq = float(g.astype(np.float64) @ g.astype(np.float64))
        a = told.push(PushHeader(0, 0, 0, 1), g.copy(), sumsq=sq)
        b = measuring.push(PushHeader(0, 0, 0, 1), g.copy())
        assert a == b
        assert told.params.tobytes() == measuring.params.tobytes()


def test_one_finiteness_check_serves_payloads_and_optimizer_state():
    m = np.ones((3, 5), np.float32)  # 2-D: its dot product would be a matrix product
    assert commit.check_values(m).ok and commit.check_values(np.arange(6)).ok  # integers
    m[1, 2] = np.inf
    assert commit.check_values(m) == commit.Verdict(commit.NOT_FINITE, 7)
    m[1, 2] = 1e30  # finite: an overflowing sum of squares is not a non-finite value
    assert commit.first_non_finite(m) is None
    assert commit.check_values(m) == commit.Verdict(commit.OVERFLOW, 7)
