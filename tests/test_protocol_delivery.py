"""Delivery across shards, without Ray: admission, the push ledger, departures, the cut.

Two real :class:`~stalewise.protocol.Shard` objects stand for two shard actors; each
test plays a sender whose pushes reach one shard and not the other, as a sender
that dies between its calls leaves them, and repairs them by the rules of
:mod:`stalewise.protocol.delivery` as the Ray runtime does.
"""

import numpy as np
import pytest

import stalewise as sw
from stalewise import optim
from stalewise.protocol import PushHeader, Shard, delivery, pipeline
from stalewise.segments import Segments


def two_shards(workers=2):
    shards = [
        Shard(np.zeros(2, np.float32), Segments.single(2), optim.sgd(1.0), workers=workers)
        for _ in range(2)
    ]
    for s in shards:
        for w in range(workers):
            s.admit(w, 1)
    return shards


def push(shard, ledger, w, inc, seq, acked=0):
    """Push ``seq`` to ``shard`` (its own slice of ones), kept in ``ledger`` as a shard
    actor keeps it; returns the ack."""
    header = PushHeader(w, seq, shard.version, inc)
    ledger.keep(w, inc, seq, acked=acked, entry=header)
    return shard.push(header, np.ones(2, np.float32))


def test_admission_hears_one_incarnation_and_names_why_others_are_dropped():
    shard = two_shards()[0]
    assert shard.dropped(0, 1) is None  # admitted
    assert shard.dropped(0, 2) is None  # not yet admitted: its pulls wait
    shard.admit(0, 2)
    assert shard.dropped(0, 1) == 2  # moved: a newer incarnation is admitted
    assert shard.incarnation[0] == 2 and shard.live[0]
    shard.retire(0, 1)  # not the admitted one: nothing happens
    assert shard.dropped(0, 2) is None
    shard.retire(0, 2)  # cut off: still live (its departure is still to come)
    assert shard.dropped(0, 2) == 0 and shard.live[0]
    assert shard.dropped(0, 3) is None  # the next one may come
    shard.depart(0, 2)
    assert not shard.live[0]


def test_the_ledger_keeps_the_pushes_not_acked_everywhere_and_one_incarnation():
    ledger = delivery.Ledger()
    for seq in range(4):
        ledger.keep(0, 1, seq, acked=seq - 1 if seq else 0, entry=seq)
    # acked=2 at push 3: pushes 0 and 1 are on every shard, dropped
    assert ledger.between(0, 1, 2, 4) == [2, 3]
    assert ledger.between(0, 1, 1, 4) is None
    ledger.keep(0, 2, 0, acked=0, entry="new")  # a new incarnation: the old one's go
    assert ledger.between(0, 1, 3, 4) is None and ledger.between(0, 2, 0, 1) == ["new"]
    ledger.forget(0)
    assert ledger.between(0, 2, 0, 1) is None
    assert ledger.between(0, 2, 0, 0) == []  # nothing lacking: nothing to read


def test_a_push_that_reached_one_shard_is_delivered_to_the_other_exactly_once():
    shards, ledgers = two_shards(), [delivery.Ledger(), delivery.Ledger()]
    for s, led in zip(shards, ledgers, strict=True):
        assert push(s, led, 0, 1, 0).ok
    assert push(shards[0], ledgers[0], 0, 1, 1, acked=1).ok  # shard 1 never gets push 1
    for s in shards:
        s.retire(0, 1)  # the sender is gone: cut it off everywhere first
    counts = [s.handled(0, 1) for s in shards]
    assert counts == [2, 1] and shards[0].handled(0, 2) is None  # another incarnation
    source, lacking = delivery.departure(counts)
    assert (source, lacking) == (0, {1: (1, 2)})
    (header,) = ledgers[source].between(0, 1, *lacking[1])
    ack = shards[1].depart(0, 1, (header, np.ones(2, np.float32), None))
    assert ack is not None and ack.ok
    shards[0].depart(0, 1)
    assert [s.version for s in shards] == [2, 2]
    assert delivery.committed([s.handled(0, 1) for s in shards]) == 2  # on both now
    # a late copy from the dead incarnation changes nothing
    ack = shards[1].push(PushHeader(0, 1, 2, 1), np.ones(2, np.float32))
    assert not ack.ok and [s.version for s in shards] == [2, 2]


def test_a_departure_with_nothing_lacking_reads_nothing():
    assert delivery.departure([3, 3]) == (0, {})
    assert delivery.departure([0, 0]) == (None, {})
    assert delivery.departure([None, None]) == (None, {})
    assert delivery.departure([None, 2, 1]) == (1, {2: (1, 2)})
    every = [delivery.committed(c) for c in ([3, 3], [0, 0], [None, None], [None, 2, 1])]
    assert every == [3, 0, None, 2]


def test_a_cut_holds_pushes_past_the_furthest_shard_and_waits_for_the_others():
    shards = two_shards()
    ledgers = [delivery.Ledger(), delivery.Ledger()]
    for seq in range(2):
        push(shards[0], ledgers[0], 0, 1, seq)
    push(shards[1], ledgers[1], 0, 1, 0)  # shard 1 is one push behind for worker 0
    cuts = [delivery.Cut(), delivery.Cut()]
    target = delivery.targets([c.freeze(s) for c, s in zip(cuts, shards, strict=True)])
    assert target == {0: (1, 2), 1: (1, 0)}
    assert cuts[1].holds(0, 1, 1)  # frozen, no target yet: every push waits
    for c in cuts:
        c.aim(target)
    assert [c.reached(s) for c, s in zip(cuts, shards, strict=True)] == [True, False]
    assert not cuts[1].holds(0, 1, 1)  # below the target: it goes through
    assert cuts[1].holds(0, 1, 2) and cuts[1].holds(1, 1, 0)  # beyond it: held
    push(shards[1], ledgers[1], 0, 1, 1)
    assert cuts[1].reached(shards[1])
    states = [s.state_dict() for s in shards]
    assert [int(st["version"]) for st in states] == [2, 2]
    cuts[1].thaw()
    assert not cuts[1].holds(1, 1, 0)


def test_a_cut_does_not_wait_for_an_incarnation_that_left():
    shards = two_shards()
    cut = delivery.Cut()
    cut.freeze(shards[0])
    cut.aim({0: (1, 3)})  # another shard got 3 pushes of it, this one none
    assert not cut.reached(shards[0])
    shards[0].depart(0, 1)
    assert cut.reached(shards[0])


def test_exact_pulls_is_one_rule():
    def config(consistency, staleness=None):
        params = {"w": np.zeros(2, np.float32)}
        job = sw.Job(
            params, optimizer=sw.optim.sgd(0.1), consistency=consistency, staleness=staleness
        )
        return job.config

    assert not pipeline.exact_pulls(config(sw.ASP()))
    assert pipeline.exact_pulls(config(sw.SSP(2))) and pipeline.exact_pulls(config(sw.BSP()))
    assert pipeline.exact_pulls(config(sw.ASP(), sw.staleness.constant(dc_lambda=0.1)))


def test_a_publication_is_at_once_for_an_exact_pull_and_rarer_when_it_is_costly():
    pub = pipeline.Publication(every=0.02)
    assert pub.due(0, 0.0, exact=False)  # nothing published yet
    pub.published(0, start=0.0, end=0.001)
    assert pub.wait(0, 0.5) is None  # nothing new
    assert not pub.due(1, 0.01, exact=False) and pub.due(1, 0.01, exact=True)
    assert pub.due(1, 0.03, exact=False)  # every 20 ms
    assert pub.wait(1, 0.011) == pytest.approx(0.01)
    for _ in range(60):  # a large slice: 50 ms per copy
        pub.published(1, start=0.0, end=0.05)
    # publishing at most a quarter of the time: every 200 ms, whatever `every` says
    assert pub.wait(2, 0.05) == pytest.approx(0.2, rel=1e-3)
    assert pub.wait(2, 0.05, extra=0.05) == pytest.approx(0.4, rel=1e-3)  # and its pulls


def test_a_pull_is_served_once_the_admitted_incarnations_pushes_arrived_and_the_gate_opens():
    shards = [
        Shard(np.zeros(2, np.float32), Segments.single(2), optim.sgd(1.0), workers=2, **kw)
        for kw in ({}, {"consistency": sw.BSP()})
    ]
    for s in shards:
        for w in range(2):
            s.admit(w, 1)
    asp, bsp = shards
    assert asp.may_serve(0, 1, pushed=5)  # ASP: no gate to see the worker's clock
    assert bsp.may_serve(0, 1) and not bsp.may_serve(0, 2)  # incarnation 2 is not admitted
    assert not bsp.may_serve(0, 1, pushed=1)  # its push 0 is still on its way
    bsp.push(PushHeader(0, 0, 0, 1), np.ones(2, np.float32))
    assert not bsp.may_serve(0, 1, pushed=1)  # arrived; the round waits for worker 1
    bsp.push(PushHeader(1, 0, 0, 1), np.ones(2, np.float32))
    assert bsp.may_serve(0, 1, pushed=1)
    bsp.retire(0, 1)
    assert not bsp.may_serve(0, 1, pushed=1)  # cut off


def test_a_push_waits_for_an_earlier_one_and_for_a_cut_but_not_once_cut_off():
    shard = two_shards()[0]
    cut = delivery.Cut()
    assert not cut.waits(shard, 0, 1, 0)
    assert cut.waits(shard, 0, 1, 1)  # push 0 has not arrived yet: calls may overtake
    cut.freeze(shard)
    assert cut.waits(shard, 0, 1, 0)  # frozen
    cut.aim({0: (1, 1)})
    assert not cut.waits(shard, 0, 1, 0)  # below the cut's target
    shard.retire(0, 1)
    assert not cut.waits(shard, 0, 1, 1)  # cut off: dropped, not held
