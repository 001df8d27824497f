"""The protocol layer's rules: incarnations, sequence gaps, the commit rule, departures."""

import numpy as np
import pytest

from stalewise import optim
from stalewise import staleness as st
from stalewise.consistency import BSP
from stalewise.protocol import PushHeader, PushResult, Shard, commit
from stalewise.segments import Segments


def shard_of(n=4, workers=2, **kw):
    shard = Shard(
        np.zeros(n, np.float32), Segments.single(n), optim.sgd(1.0), workers=workers, **kw
    )
    for w in range(workers):
        shard.join(w, 1)
    return shard


def ones(n=4):
    return np.ones(n, np.float32)


def test_a_restarted_worker_is_not_muted():
    shard = shard_of()
    for seq in range(3):
        assert shard.push(PushHeader(0, seq, shard.version, 1), ones()).status == "applied"
    shard.join(0, 2)  # the process restarted: a new incarnation, seq starts at 0 again
    for seq in range(4):
        ack = shard.push(PushHeader(0, seq, shard.version, 2), ones())
        assert ack.status == "applied", ack
    assert shard.version == 7 and shard.stats.applied == 7


def test_a_replay_from_an_old_incarnation_is_refused_not_acked():
    shard = shard_of()
    shard.push(PushHeader(0, 0, 0, 1), ones())
    shard.join(0, 2)
    before = shard.params.copy()
    ack = shard.push(PushHeader(0, 1, shard.version, 1), ones())
    assert ack.status == "refused" and ack.kind == "stale_incarnation"
    assert "incarnation 1, the current one is 2" in ack.reason
    ack = shard.push(PushHeader(0, 0, shard.version, 3), ones())
    assert ack.kind == "unknown_incarnation"
    np.testing.assert_array_equal(shard.params, before)
    assert shard.next_seq[0] == 0  # nothing of incarnation 2 was consumed


def test_a_sequence_gap_is_refused_and_nothing_is_skipped():
    shard = shard_of()
    shard.push(PushHeader(0, 0, 0, 1), ones())
    ack = shard.push(PushHeader(0, 5, shard.version, 1), ones())
    assert ack.status == "refused" and ack.kind == "seq_gap"
    assert "push 5 arrived before pushes 1..4" in ack.reason
    assert shard.version == 1 and shard.clocks[0] == 1
    # the missing push 1 is still welcome, and a replay of 0 is a duplicate
    assert shard.push(PushHeader(0, 1, shard.version, 1), ones()).status == "applied"
    assert shard.push(PushHeader(0, 0, shard.version, 1), ones()).status == "duplicate"


def test_a_worker_that_never_joined_cannot_push():
    shard = Shard(np.zeros(4, np.float32), Segments.single(4), optim.sgd(1.0), workers=2)
    ack = shard.push(PushHeader(1, 0, 0, 0), ones())
    assert ack.kind == "unknown_incarnation" and "has not joined" in ack.reason


def test_join_must_be_newer():
    shard = shard_of()
    with pytest.raises(ValueError, match="incarnation 1 is not newer than 1"):
        shard.join(0, 1)


def test_depart_delivers_a_committed_push_exactly_once():
    shard = shard_of()
    header = PushHeader(0, 0, 0, 1)
    ack = shard.depart(0, 1, (header, ones(), commit.Verdict()))
    assert ack is not None and ack.status == "applied" and shard.version == 1
    assert not shard.live[0]
    # a shard that had already handled it does not apply it again
    other = shard_of()
    other.push(header, ones())
    assert other.depart(0, 1, (header, ones(), commit.Verdict())) is None
    assert other.version == 1
    # a committed refusal is followed too: the step counts, nothing is applied
    third = shard_of()
    ack = third.depart(0, 1, (header, ones(), commit.Verdict(commit.NOT_FINITE, 2)))
    assert ack.status == "refused" and third.version == 0


def test_depart_of_a_superseded_incarnation_changes_nothing():
    shard = shard_of()
    shard.join(0, 2)
    assert shard.depart(0, 1, (PushHeader(0, 0, 0, 1), ones(), commit.Verdict())) is None
    assert shard.live[0] and shard.version == 0


def test_an_unstarted_worker_stops_blocking_bsp_when_its_lease_runs_out():
    shard = Shard(
        np.zeros(4, np.float32), Segments.single(4), optim.sgd(1.0), workers=2, consistency=BSP()
    )
    shard.join(0, 1)
    shard.push(PushHeader(0, 0, 0, 1), ones())
    assert shard.version == 0 and not shard.may_start(0)  # the round waits for worker 1
    assert shard.expire_unstarted() == [1]
    assert shard.version == 1 and shard.may_start(0)
    shard.join(1, 1)  # it may still come later
    assert shard.live[1]


def test_the_verdict_decides_for_every_shard():
    """A NaN in one shard's slice, or a push too stale by any shard's count, is refused by all."""
    seg = Segments.from_sizes(["a", "b"], [2, 2])
    flat = np.array([1, 1, np.nan, 1], np.float32)
    v = commit.judge(flat, seg, [0, 0], [0, 0], st.constant(), whole=True)
    assert v.kind == "not_finite"
    shards = [shard_of(n=2), shard_of(n=2)]
    acks = [
        s.push(PushHeader(0, 0, 0, 1), flat[2 * k : 2 * k + 2].copy(), verdict=v)
        for k, s in enumerate(shards)
    ]
    assert [a.status for a in acks] == ["refused", "refused"]
    assert all(s.version == 0 for s in shards)
    result = PushResult.of(acks)
    assert result.status == "refused" and result.kind == "not_finite"
    # too stale on shard 1 only (bases differ): judged once, refused everywhere
    rule = st.constant(max_staleness=2)
    v = commit.judge(np.ones(4, np.float32), seg, [5, 1], [5, 4], rule, whole=True)
    assert v.kind == "too_stale" and v.detail == 3
    assert "staleness 3 exceeds max_staleness 2" in v.message(max_staleness=2)
    assert commit.judge(np.ones(4, np.float32), seg, [5, 2], [5, 4], rule, whole=True).ok


def test_a_bsp_round_left_by_its_last_worker_is_still_applied():
    """Pushes merged into a round were acknowledged as applied: they must not vanish."""
    shard = shard_of(consistency=BSP())
    shard.push(PushHeader(0, 0, 0, 1), ones())
    shard.leave(0)  # worker 0 goes first: the round still waits for worker 1
    assert shard.version == 0
    shard.leave(1)  # worker 1 leaves without pushing: the round closes with worker 0's push
    assert shard.version == 1
    np.testing.assert_array_equal(shard.params, -ones())
