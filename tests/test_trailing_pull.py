"""A read-your-writes pull copies the live params behind its own push's step (issue #44).

The shard names the push it applies in its table row and its optimizer step reports, piece by
piece, how far it has written; the worker copies each piece once written and returns as the
step ends, without the ack's round trip. A refused step, or another step first, voids the copy.
"""

import numpy as np
import pytest

import stalewise as sw
from stalewise import optim
from stalewise.optim import _kernels
from stalewise.runtime.local import layout as L
from stalewise.runtime.local.layout import Layout, Snapshots
from stalewise.runtime.local.shm import SharedBlock

N = 1000


@pytest.fixture
def snaps():
    layout = Layout(size=N, dtype="float32", workers=2, shards=2)
    block = SharedBlock.create(layout.nbytes)
    yield Snapshots(layout, block, [(0, 600), (600, N)])
    block.unlink()
    block.close()


def test_the_copy_follows_the_step_piece_by_piece_and_ends_with_it(snaps):
    k, lo, hi, tag = 1, 600, N, L.step_tag(1, 7)
    row, params, out = snaps.table[k], snaps.params, np.full(N, np.nan, np.float32)
    snaps.changed(k, 4)
    trail = snaps.trail(k, out, 1, tag)
    assert next(trail) is False  # its step has not begun
    assert not row[L._READING + 1]
    snaps.changing(k, L.step_tag(0, 7))  # another worker's push
    assert next(trail) is False
    snaps.changed(k, 5)
    snaps.changing(k, tag)
    params[lo:hi] = 1.0
    snaps.done(k)[0] = 100  # the first 100 written
    assert next(trail) is True  # copied them, waits for more
    assert row[L._READING + 1]  # the shard's next step waits for this copy
    np.testing.assert_array_equal(out[lo : lo + 100], 1.0)
    assert np.isnan(out[lo + 100 : hi]).all()  # nothing past the written piece
    params[lo + 100 : hi] = 2.0  # the rest, not reported yet: then the step ends
    snaps.stepped(k, True)
    snaps.changed(k, 6)
    with pytest.raises(StopIteration) as end:
        next(trail)
    assert end.value.value == 6
    np.testing.assert_array_equal(out[lo : lo + 100], 1.0)
    np.testing.assert_array_equal(out[lo + 100 : hi], 2.0)
    assert np.isnan(out[:lo]).all()  # only its shard's slice
    assert not row[L._READING + 1]


def test_a_copy_after_the_step_ended_holds_it_until_another_write(snaps):
    k, tag, out = 0, L.step_tag(0, 3), np.zeros(N, np.float32)
    snaps.changing(k, tag)
    snaps.params[:600] = 3.0
    snaps.stepped(k, True)
    snaps.changed(k, 9)
    with pytest.raises(StopIteration) as end:
        next(snaps.trail(k, out, 0, tag))
    assert end.value.value == 9 and (out[:600] == 3.0).all()
    snaps.changing(k)  # any later write ends what the trail may read
    assert next(snaps.trail(k, out, 0, tag)) is False


@pytest.mark.parametrize("how", ["refused", "overtaken"])
def test_a_refused_step_or_a_later_one_voids_the_copy(snaps, how):
    k, tag, out = 0, L.step_tag(1, 0), np.zeros(N, np.float32)
    snaps.changing(k, tag)
    snaps.done(k)[0] = 300
    trail = snaps.trail(k, out, 1, tag)
    assert next(trail) is True
    if how == "refused":  # the step is undone: the pieces copied are not the params
        snaps.stepped(k, False)
        snaps.changed(k, 0)
    else:  # it ended and the next step began before the copy was done
        snaps.stepped(k, True)
        snaps.changed(k, 1)
        snaps.changing(k, L.step_tag(0, 0))
    with pytest.raises(StopIteration) as end:
        next(trail)
    assert end.value.value is None
    assert not snaps.table[k, L._READING + 1]


@pytest.mark.parametrize(
    "rule", [optim.sgd(0.1, momentum=0.9, weight_decay=0.01), optim.adam(1e-2)]
)
def test_a_step_that_reports_its_progress_writes_the_same_bits(rule):
    rng = np.random.default_rng(0)
    n = 3 * _kernels.PIECE + 5
    p0, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    kind = rule.apply.__self__
    results = []
    for done in (None, np.zeros(1, np.int64)):
        p, state = p0.copy(), rule.init(p0)
        for _ in range(2):
            kind.run(g.copy(), state, p, 1.0, True, done=done)
        results.append(p)
        if done is not None:
            assert done[0] == n
    np.testing.assert_array_equal(*results)


def test_pulls_after_pushes_trail_each_step_without_waiting_for_the_acks(no_leaks):
    job = sw.Job({"w": np.zeros(1 << 20, np.float32)}, optimizer=optim.sgd(1.0), shards=2)
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=30)
        for step in range(1, 21):
            client.push({"w": np.ones(1 << 20, np.float32)})
            np.testing.assert_array_equal(client.pull(timeout=30)["w"], -float(step))
            assert client.pull_has_own
        assert client.trailed == 20 and client.own_requests == 0
        assert client.wait(timeout=30).versions == (20, 20)  # read after the last pull
        client.close()


def test_a_step_refused_as_it_overflows_voids_the_trail_and_the_pull_reads_the_params_kept(
    no_leaks,
):
    init = np.zeros(1 << 20, np.float32)
    init[-1] = 3e38  # on shard 1: a step of 1e38 there overflows, found in the step's pass
    job = sw.Job({"w": init}, optimizer=optim.sgd(1e19), shards=2)
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=30)
        client.push({"w": np.zeros_like(init)})
        np.testing.assert_array_equal(client.pull(timeout=30)["w"], init)
        assert client.trailed == 1
        bad = np.zeros_like(init)
        bad[-1] = -1e19
        client.push({"w": bad})
        np.testing.assert_array_equal(client.pull(timeout=30)["w"], init)
        assert client.trailed == 1  # its copy was void: read after the acks
        assert "overflow" in client.wait(timeout=30).reason
        client.close()
