"""The protocol's sending side (protocol/sender.py) and budget rule (protocol/budget.py),
with no runtime: encode with error feedback, judge once, the residual rule, acks."""

import random

import numpy as np
import pytest

from stalewise import codecs, staleness
from stalewise.protocol import Ack, budget
from stalewise.protocol.compress import Compressor
from stalewise.protocol.sender import Sender
from stalewise.segments import Segments

SEG = Segments.from_sizes(["b", "w"], [4, 1000])
RANGES = [(0, 502), (502, 1004)]


def sender(codec=None, shards=2, rule=None, **kw):
    ranges = RANGES if shards == 2 else [(0, SEG.total)]
    comp = None if codec is None else Compressor(codec, SEG, ranges)
    return Sender(SEG, rule or staleness.constant(), shards, comp, **kw), comp


def payloads(comp):
    return [bytearray(comp.nbytes(k)) for k in range(len(comp.ranges))]


def update(seed=0):
    return np.random.default_rng(seed).normal(size=SEG.total).astype(np.float32)


def test_the_residual_changes_only_when_the_push_commits():
    s, comp = sender(codecs.topk(0.01))
    bufs = payloads(comp)
    g = update()
    s.encode(g, bufs)
    s.judge()
    assert not s.residual.any()  # encoded and judged, not committed: the old residual
    s.abandoned()
    assert not s.residual.any() and s.seq == 0
    s.encode(g, bufs)
    s.judge()
    s.committed()
    assert s.seq == 1
    sent = comp.decode(bufs, np.empty_like(g))
    np.testing.assert_allclose(s.residual, g - sent, atol=1e-6)  # e = g - C(g): what was not sent
    kept = s.residual.copy()
    s.encode(update(1), bufs)  # written into the other buffer
    s.abandoned()
    np.testing.assert_array_equal(s.residual, kept)


def test_the_same_pushes_give_the_same_residual_as_the_compressor_alone():
    s, comp = sender(codecs.topk(0.01))
    bufs, theirs = payloads(comp), payloads(comp)
    state = comp.init()
    for i in range(4):
        g = update(i)
        s.encode(g, bufs)
        s.judge()
        s.committed()
        state = comp.encode_into(g, theirs, state)
        assert bufs == theirs
    np.testing.assert_array_equal(s.residual, state.residual)


def test_a_successor_continues_from_the_buffers_it_is_given():
    s, comp = sender(codecs.topk(0.01))
    s.encode(update(), payloads(comp))
    s.judge()
    s.committed()
    s.observed(0, 4)
    successor = s.successor()  # the next incarnation: same buffers, seq 0, no version known
    assert successor.residual is s.residual
    assert (successor.seq, successor.known, successor.bases) == (0, [0, 0], [0, 0])
    copy = Sender(SEG, staleness.constant(), 2, comp, residual=s.residual)
    np.testing.assert_array_equal(copy.residual, s.residual)
    assert copy.residual is not s.residual


def test_not_finite_is_judged_on_the_payloads_decoded_back():
    """With several shards and a codec the verdict judges what the shards will apply: here
    the payloads hold a NaN that the flat vector handed to judge() does not."""
    s, comp = sender(codecs.int8())
    bufs = payloads(comp)
    g = update()
    g[700] = np.nan
    s.encode(g, bufs)
    verdict = s.judge(np.zeros_like(g)).verdict
    assert verdict.kind == "not_finite"
    assert "leaf 'w'" in verdict.message(SEG)
    s.committed()
    assert s.residual is None  # int8 keeps no error feedback
    s, comp = sender(codecs.topk(0.01))
    s.encode(g, payloads(comp))
    assert s.judge(np.zeros_like(g)).verdict.kind == "not_finite"
    s.committed()
    assert not s.residual.any()  # a push holding NaN leaves the residual as it was


def test_one_shard_checks_its_whole_slice_itself_so_the_verdict_does_not():
    s, _ = sender(shards=1)
    g = update()
    g[3] = np.inf
    assert s.judge(g).verdict.ok
    s2, _ = sender(shards=2)
    out = s2.judge(g)
    assert out.verdict.kind == "not_finite" and out.verdict.detail == 3


def test_too_stale_against_the_versions_known_at_judgement():
    s, comp = sender(codecs.topk(0.01), rule=staleness.constant(max_staleness=2))
    s.pulled(0, 5)
    s.pulled(1, 5)
    bufs = payloads(comp)
    s.encode(update(), bufs)
    assert s.judge().verdict.ok
    s.observed(1, 8)  # a newer snapshot of shard 1: this push would be 3 versions stale
    out = s.judge()
    assert (out.verdict.kind, out.verdict.detail, out.bases) == ("too_stale", 3, (5, 5))
    s.observed(1, 4)  # an older version changes nothing
    assert s.known == [5, 8]


def test_judge_without_a_codec_needs_the_update_and_encode_needs_a_codec():
    s, _ = sender()
    with pytest.raises(ValueError, match="needs the update"):
        s.judge()
    with pytest.raises(ValueError, match="no codec"):
        s.encode(update(), [bytearray(8)])


def test_acks_fold_into_a_push_result_and_teach_the_versions():
    s, _ = sender()
    ok = Ack(0, 0, True, None, 7, 1)
    result = s.result([ok, ok._replace(version=9)])
    assert (result.status, result.versions, result.staleness) == ("applied", (7, 9), 1)
    assert s.known == [7, 9]
    refused = Ack(0, 1, False, "too stale", 9, 4, kind="too_stale")
    result = s.result([refused, refused._replace(version=10)])
    assert result.status == "refused" and result.kind == "too_stale"
    assert "shard 0: too stale" in result.reason and s.known == [9, 10]


def test_the_budget_rule():
    assert budget.may_begin(7, 2, 10) and not budget.may_begin(8, 2, 10)
    assert not budget.may_begin(10, 0, 10)
    assert budget.settle_first(8, 2, 10)  # own pushes in flight: wait for them, ask again
    assert not budget.settle_first(10, 0, 10)  # nothing in flight: stop
    assert not budget.settle_first(3, 2, 10)  # the rule says go: no need to wait
    assert budget.overshoot_bound(5) == 4 and budget.overshoot_bound(5, exact=True) == 0


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_the_budget_overshoot_is_at_most_workers_minus_one(workers):
    """Workers that read the exact count of committed pushes, then begin a step and commit
    it later (the local runtime's case), in random interleavings: every run commits
    at least ``steps`` pushes and at most ``workers - 1`` beyond, and the bound is met."""
    steps, worst = 20, 0
    for seed in range(300):
        rng = random.Random(seed)
        committed, working, done = 0, [False] * workers, [False] * workers
        while not all(done):
            w = rng.choice([i for i in range(workers) if not done[i]])
            if working[w]:
                committed += 1
                working[w] = False
            elif budget.may_begin(committed, 0, steps):
                working[w] = True
            else:
                done[w] = True
        assert steps <= committed <= steps + budget.overshoot_bound(workers)
        worst = max(worst, committed - steps)
    assert worst == budget.overshoot_bound(workers)
