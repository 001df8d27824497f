"""Compressed pushes on the local runtime: real shard processes, payloads in shared memory.

Each codec trains the digits MLP with two shards (one leaf cut between them);
the bytes in shared memory are exactly the codecs' counts; the shards apply what
the payloads decode to, with the worker's error feedback; and a corrupt payload,
committed, is refused by every shard and changes nothing.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import stalewise as sw
from stalewise import codecs, tasks
from stalewise.protocol import compress
from stalewise.runtime.local import layout as L
from stalewise.runtime.local import wire
from stalewise.runtime.local.layout import Layout


def cut_job(codec, *, shards=2):
    """Two leaves, the large one cut between the two shards; plain SGD with lr 1."""
    params = {"b": np.zeros(8, np.float32), "w": np.zeros(3000, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(1.0), codec=codec, shards=shards)
    if shards == 2:
        lo, hi = job.config.ranges[1]
        assert 8 < lo < hi == 3008  # the cut falls inside leaf "w"
    return job


def update(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "b": rng.standard_normal(8).astype(np.float32),
        "w": rng.standard_normal(3000).astype(np.float32),
    }


def flat(tree):
    return np.concatenate([tree["b"], tree["w"]])


@pytest.mark.parametrize(
    "codec",
    [codecs.none(), codecs.fp16(), codecs.int8(), codecs.topk(0.01)],
    ids=repr,
)
def test_each_codec_trains_digits_with_two_shards(no_leaks, codec):
    task = tasks.get("digits")
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.1), codec=codec, shards=2)
    segments, ranges = job.config.spec.segments, job.config.ranges
    leaf = int(np.searchsorted(segments.offsets, ranges[1][0], side="right")) - 1
    assert segments.offsets[leaf] < ranges[1][0]  # a leaf (layer1.w) is cut between the shards
    r = job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=2,
        steps=300,
        evaluate=task.evaluate,
        metrics=sw.Metrics(every=1e9, progress=False),
        timeouts=sw.Timeouts(total=120),
    )
    assert r.stats["applied"] == r.pushes >= 300
    assert r.records[-1]["accuracy"] > 0.85, r.records[-1]
    comp = job.config.compressor()
    per_push = job.config.spec.nbytes if comp is None else sum(comp.nbytes(k) for k in (0, 1))
    assert r.stats["bytes_in"] == r.pushes * per_push  # what the shards took from shared memory


def push_and_check(server, client, comp, g, feedback, expected):
    """Pushes ``g`` for real and checks the worker's payloads in shared memory against a
    Compressor run here, byte for byte; returns its feedback and the params expected."""
    client.push(g, timeout=10)
    assert client.wait(timeout=10).status == "applied"
    payloads, feedback = comp.encode(flat(g), feedback)
    for k in (0, 1):
        shm = server.layout.payload(client._block, 0, k)
        assert len(shm) == len(payloads[k]) == comp.nbytes(k)
        assert shm.tobytes() == bytes(payloads[k])
    return feedback, expected - comp.decode(payloads, np.empty(3008, np.float32))  # sgd(1.0)


def test_payloads_in_shared_memory_have_the_exact_size_and_the_shards_apply_them(no_leaks):
    """Two pushes move the params exactly as the payloads decode, each shard takes exactly
    nbytes(k) per push; an update holding NaN is refused on its decoded values."""
    job = cut_job(codecs.int8(block=256))
    comp = job.config.compressor()
    sizes = tuple(comp.nbytes(k) for k in (0, 1))
    with job.serve(workers=1) as server:
        assert server.layout == Layout(3008, "float32", 1, 2, sizes)
        assert server.layout.nbytes < Layout(3008, "float32", 1, 2).nbytes  # pushes shrink
        client = server.client(0)
        client.pull(timeout=10)
        feedback, expected = None, np.zeros(3008, np.float32)
        for seed in (1, 2):
            feedback, expected = push_and_check(
                server, client, comp, update(seed), feedback, expected
            )
        assert feedback is None  # int8 keeps no error feedback by default
        np.testing.assert_array_equal(flat(server.pull(timeout=10)), expected)
        assert [s["bytes_in"] for s in server.stats()] == [2 * n for n in sizes]
        bad = update(3)
        bad["w"][2900] = np.nan  # shard 1's slice; the int8 block decodes to NaN
        client.push(bad, timeout=10)
        result = client.wait(timeout=10)
        lo = job.config.ranges[1][0]  # the sender judged the decoded values: a NaN block
        first = lo + (2900 - lo) // 256 * 256  # (blocks start where the shard's piece does)
        assert result.kind == "not_finite" and f"first at element {first}, leaf 'w'" in (
            result.reason
        )
        np.testing.assert_array_equal(flat(server.pull(timeout=10)), expected)
        client.close()


def commit_unjudged(client):
    """Commits what the worker's payloads now hold and announces it, as a worker that does
    not follow the protocol would: the record says OK without judging (layout's fields)."""
    rec, sender = client._record, client._sender
    seq = sender.seq
    rec[L.R_COMMIT] = 0
    rec[L.R_INC], rec[L.R_SEQ], rec[L.R_CODE], rec[L.R_DETAIL] = client.incarnation, seq, 0, 0
    rec[L.R_BASES : L.R_BASES + len(sender.bases)] = sender.bases
    rec[L.R_COMMIT] = seq + 1
    for conn in client._conns:
        conn.send_bytes(wire.push(seq))
    sender.seq, client._acks_due = seq + 1, [True] * len(client._conns)


def test_a_corrupt_committed_payload_is_refused_by_every_shard(no_leaks):
    """topk with error feedback: two pushes land as the payloads (and the residual) say;
    then a corrupt payload, committed, is refused by both shards and changes nothing."""
    job = cut_job(codecs.topk(0.1))
    comp = job.config.compressor()
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=10)
        feedback, expected = None, np.zeros(3008, np.float32)
        for seed in (1, 2):
            feedback, expected = push_and_check(
                server, client, comp, update(seed), feedback, expected
            )
        np.testing.assert_array_equal(flat(server.pull(timeout=10)), expected)
        np.testing.assert_array_equal(client.residual, feedback.residual)  # in shared memory
        assert np.count_nonzero(feedback.residual[8:]) > 2000  # what topk has not sent yet
        before = expected
        # an honest encoding, then each shard's payload corrupted in its own way
        client.push_buffer[:] = flat(update(4))
        comp.encode_into(client.push_buffer, client._payloads)
        p0, p1 = client._payloads
        p0[0] = 0x00  # shard 0: the first piece's magic byte
        idx = np.frombuffer(p1, np.uint16, 2, compress.codecs.HEADER.size)
        assert p1[1] == codecs.TopK.id and idx[0] < idx[1]
        p1[12:14], p1[14:16] = p1[14:16].copy(), p1[12:14].copy()  # shard 1: indices swapped
        commit_unjudged(client)
        result = client.wait(timeout=10)
        assert result.status == "refused" and result.kind == "bad_payload", result
        assert "shard 0: bad_payload: shard 0, leaf 'b' (none()): not a codec payload" in (
            result.reason
        )
        assert "shard 1: bad_payload: shard 1, leaf 'w' (topk(0.1)): indices out of order" in (
            result.reason
        )
        np.testing.assert_array_equal(flat(server.pull(timeout=10)), before)  # unchanged
        stats = server.stats()
        assert [s["rejected"] for s in stats] == [{"bad_payload": 1}] * 2
        assert [s["version"] for s in stats] == [2, 2]
        # the worker goes on: its next honest push is applied by both
        client.push(update(3), timeout=10)
        assert client.wait(timeout=10).status == "applied"
        assert [s["version"] for s in server.stats()] == [3, 3]
        client.close()


def test_one_shard_refusals_and_a_committed_payload_delivered_at_departure(no_leaks):
    """One shard, no sender decode: an update holding NaN is refused as not_finite on its
    decoded values, a payload whose header names the wrong size as bad_payload, and
    neither moves the params; a payload committed by a sender that then dies is decoded
    and applied when the shard learns it is gone."""
    job = cut_job(codecs.int8(), shards=1)
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=10)
        bad = update(1)
        bad["w"][1234] = np.nan
        client.push(bad, timeout=10)
        result = client.wait(timeout=10)
        assert result.kind == "not_finite" and "leaf 'w'" in result.reason, result
        comp = job.config.compressor()
        client.push_buffer[:] = flat(update(2))
        comp.encode_into(client.push_buffer, client._payloads)
        np.frombuffer(client._payloads[0], np.uint64, 1, 4)[0] = 7  # "n" of leaf b's piece
        seq = client._commit()
        for conn in client._conns:
            conn.send_bytes(wire.push(seq))
        client._sender.committed()
        client._acks_due = [True]
        result = client.wait(timeout=10)
        assert result.kind == "bad_payload" and "holds 7 values, expected 8" in result.reason
        np.testing.assert_array_equal(flat(server.pull(timeout=10)), np.zeros(3008))
        assert server.stats()[0]["rejected"] == {"not_finite": 1, "bad_payload": 1}
        g = flat(update(3))
        client.push_buffer[:] = g
        comp.encode_into(g, client._payloads)
        client._commit()  # committed, then the "process" dies before telling the shard
        for conn in client._conns:
            conn.close()
        deadline = time.monotonic() + 10
        while server.stats()[0]["version"] != 1:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.01)
        expected = -comp.decoder(0).decode(comp.encode(g)[0][0])  # sgd(1.0) from zeros
        np.testing.assert_array_equal(flat(server.pull(timeout=10)), expected)
        client.close()
