"""The parameter-server shard as a state machine: consistency, staleness, exactly-once, validation."""

import math
import os
import re
import signal
import threading
import time
from multiprocessing import connection

import numpy as np
import pytest

import stalewise as sw
from stalewise import optim, sharding
from stalewise import staleness as st
from stalewise.consistency import ASP, BSP, SSP
from stalewise.protocol import PushHeader, Shard
from stalewise.segments import Segments


def make_shard(n=6, workers=3, lr=0.5, join=True, **kw):
    params = np.arange(n, dtype=np.float32)
    shard = Shard(
        params,
        Segments.from_sizes(["a", "b"], [n // 2, n - n // 2]),
        optim.sgd(lr),
        workers=workers,
        **kw,
    )
    for w in range(workers if join else 0):
        shard.join(w, 1)  # every worker's first incarnation
    return shard


def push(shard, worker, seq, base, g, incarnation=None):
    if incarnation is None:
        incarnation = int(shard.incarnation[worker])
    return shard.push(
        PushHeader(worker, seq, base, incarnation), np.array(g, dtype=shard.params.dtype)
    )  # a copy: the shard uses it as scratch


def test_asp_applies_each_push_on_arrival():
    shard = make_shard()
    before = shard.params.copy()
    ack = push(shard, 0, 0, 0, np.ones(6))
    assert ack.ok and ack.staleness == 0 and shard.version == 1
    np.testing.assert_array_equal(shard.params, before - 0.5)
    ack = push(shard, 1, 0, 0, np.ones(6))  # computed on version 0, applied at version 1
    assert ack.staleness == 1 and shard.version == 2
    assert shard.stats.staleness == {0: 1, 1: 1}


@pytest.mark.parametrize(
    ("rule", "tau", "weight"),
    [
        (st.constant(), 3, 1.0),
        (st.inverse(), 0, 1.0),
        (st.inverse(), 4, 0.25),
        (st.exponential(0.5), 3, 0.125),
        (st.polynomial(), 3, 0.5),
        (st.polynomial(1.0), 4, 0.2),
    ],
)
def test_staleness_rules_scale_the_step(rule, tau, weight):
    assert rule.weight(tau) == pytest.approx(weight)
    shard = make_shard(staleness=rule)
    for i in range(tau):  # advance the version with fresh pushes of worker 1
        push(shard, 1, i, i, np.zeros(6))
    before = shard.params.copy()
    ack = push(shard, 0, 0, 0, np.ones(6))
    assert ack.staleness == tau
    np.testing.assert_allclose(shard.params, before - 0.5 * weight, rtol=1e-6)


def test_too_stale_push_is_rejected_and_params_unchanged():
    shard = make_shard(staleness=st.inverse(max_staleness=1))
    push(shard, 1, 0, 0, np.zeros(6))
    push(shard, 1, 1, 1, np.zeros(6))
    before = shard.params.copy()
    ack = push(shard, 0, 0, 0, np.ones(6))
    assert not ack.ok and "staleness 2 exceeds max_staleness 1" in ack.reason
    np.testing.assert_array_equal(shard.params, before)
    assert shard.stats.rejected == {"too_stale": 1}
    assert shard.clocks[0] == 1  # the worker's step is over even though its push was refused


def test_dc_asgd_compensation():
    lam = 0.5
    shard = make_shard(staleness=st.constant(dc_lambda=lam), lr=1.0)
    shard.pull(worker=0)
    w_pulled = shard.params.copy()
    push(shard, 1, 0, 0, np.ones(6))  # moves w_now away from what worker 0 pulled
    w_now = shard.params.copy()
    g = np.linspace(-1, 1, 6).astype(np.float32)
    push(shard, 0, 0, 0, g)
    expected = w_now - (g + lam * g * g * (w_now - w_pulled))
    np.testing.assert_allclose(shard.params, expected, rtol=1e-6)


def test_replayed_push_is_acknowledged_but_not_applied():
    shard = make_shard()
    push(shard, 0, 0, 0, np.ones(6))
    after_first = shard.params.copy()
    ack = push(shard, 0, 0, 0, np.ones(6))
    assert ack.ok and ack.duplicate and shard.version == 1
    np.testing.assert_array_equal(shard.params, after_first)
    assert shard.stats.duplicates == 1 and shard.clocks[0] == 1


@pytest.mark.parametrize(
    ("header", "payload", "kind", "message"),
    [
        (PushHeader(0, 0, 0, 1), np.ones(5, np.float32), "bad_length", "shape (5,), expected (6,)"),
        (
            PushHeader(0, 0, 0, 1),
            np.ones(6, np.float64),
            "bad_dtype",
            "dtype float64, expected float32",
        ),
        (
            PushHeader(0, 0, 0, 1),
            np.array([1, 1, math.nan, 1, 1, 1], np.float32),
            "not_finite",
            "element 2, leaf 'a'",
        ),
        (
            PushHeader(0, 0, 0, 1),
            np.array([1, 1, 1, 1, -math.inf, 1], np.float32),
            "not_finite",
            "leaf 'b'",
        ),
        (PushHeader(0, 0, 0, 1), [1.0] * 6, "bad_payload", "numpy array, got list"),
        (
            PushHeader(7, 0, 0, 1),
            np.ones(6, np.float32),
            "unknown_worker",
            "worker 7 is not in 0..2",
        ),
        (
            PushHeader(0, -1, 0, 1),
            np.ones(6, np.float32),
            "malformed_header",
            "negative sequence number",
        ),
        (
            PushHeader(0, 0, 5, 1),
            np.ones(6, np.float32),
            "malformed_header",
            "base_version 5 is not in 0..0",
        ),
        (
            (0, 0),
            np.ones(6, np.float32),
            "malformed_header",
            "expected (worker, seq, base_version, incarnation)",
        ),
        (("0", 0, 0, 1), np.ones(6, np.float32), "malformed_header", "must be integers"),
        ((True, 0, 0, 1), np.ones(6, np.float32), "malformed_header", "must be integers"),
    ],
)
def test_bad_pushes_are_rejected_with_a_reason_and_change_nothing(header, payload, kind, message):
    shard = make_shard()
    before = shard.params.copy()
    state_before = [np.copy(x) for x in shard.opt_state]
    ack = shard.push(header, payload)
    assert not ack.ok
    assert message in ack.reason
    assert shard.stats.rejected == {kind: 1}
    np.testing.assert_array_equal(shard.params, before)
    assert shard.version == 0
    for a, b in zip(shard.opt_state, state_before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_bsp_applies_one_averaged_update_per_round():
    shard = make_shard(consistency=BSP(), lr=1.0)
    before = shard.params.copy()
    grads = [np.full(6, v, np.float32) for v in (1.0, 2.0, 6.0)]
    for w in (2, 0):
        assert push(shard, w, 0, 0, grads[w]).ok
        assert shard.version == 0  # the round is open
        assert not shard.may_start(w)  # and the worker waits for it to close
    assert shard.may_start(1)
    push(shard, 1, 0, 0, grads[1])
    assert shard.version == 1 and shard.stats.rounds == 1
    np.testing.assert_allclose(shard.params, before - 3.0)  # mean of 1, 2, 6
    assert all(shard.may_start(w) for w in range(3))


def test_bsp_round_closes_when_a_worker_leaves():
    shard = make_shard(consistency=BSP(), lr=1.0)
    push(shard, 0, 0, 0, np.ones(6))
    push(shard, 1, 0, 0, np.ones(6))
    assert shard.version == 0
    shard.leave(2)
    assert shard.version == 1
    assert push(shard, 2, 1, 1, np.ones(6)).reason.endswith("has left the job")


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_never_lets_a_worker_start_more_than_s_ahead(bound):
    rng = np.random.default_rng(bound)
    workers = 4
    shard = make_shard(workers=workers, consistency=SSP(bound), lr=0.0)
    seq = [0] * workers
    blocked_seen = 0
    for _ in range(400):
        w = int(rng.integers(workers)) if rng.random() < 0.7 else 0  # worker 0 is the eager one
        if not shard.may_start(w):
            blocked_seen += 1
            assert shard.clocks[w] - shard.clocks.min() > bound
            continue
        assert shard.clocks[w] - shard.clocks.min() <= bound
        push(shard, w, seq[w], shard.version, np.zeros(6))
        seq[w] += 1
        assert shard.clocks.max() - shard.clocks.min() <= bound + 1
    assert blocked_seen > 0


@pytest.mark.parametrize(
    ("consistency", "seed"),
    [(SSP(0), 0), (SSP(2), 1), (SSP(5), 2), (BSP(), 3), (BSP(), 4), (ASP(), 5)],
    ids=str,
)
def test_clock_and_round_bookkeeping_matches_brute_force(consistency, seed):
    """Random pushes (gated, ungated, rejected, replayed), leaves and joins against a model."""
    rng = np.random.default_rng(seed)
    workers = 6
    shard = make_shard(workers=workers, consistency=consistency, lr=0.0)
    clocks = [0] * workers
    live = [True] * workers
    counted = [True] * workers  # for the gates: a rejoin past clock 0 from its first push
    seq = [0] * workers
    done: set[int] = set()  # BSP: workers that pushed in the open round (live or not)
    merged = 0  # BSP: pushes merged into the open round
    version = 0
    rounds_closed = 0
    seen = {"nobody_live": 0, "blocked": 0}  # the test must reach these states

    floor = 0  # BSP: the slowest counted clock when the last counted worker left

    def brute_min():
        going = [c for c, ok, n in zip(clocks, live, counted, strict=True) if ok and n]
        if going:
            return min(going)
        return max(min([c for c, ok in zip(clocks, live, strict=True) if ok], default=0), floor)

    def gone(v):  # v leaves; under BSP the last counted one leaves the floor at its round
        nonlocal floor
        if (
            consistency.averages_rounds
            and live[v]
            and counted[v]
            and sum(ok and n for ok, n in zip(live, counted, strict=True)) == 1
        ):
            floor = max(floor, brute_min())
        live[v] = counted[v] = False

    def start_clock(v):
        return clocks[v] if counted[v] else max(clocks[v], brute_min())

    def maybe_close_round():
        nonlocal merged, version, rounds_closed
        alive = {w for w in range(workers) if live[w] and counted[w]}
        # a round closes when every live worker pushed in it, or when the last live
        # worker left it holding pushes (they were acknowledged as applied)
        if consistency.averages_rounds and ((alive and alive <= done) or (not alive and merged)):
            version += merged > 0
            rounds_closed += 1
            done.clear()
            merged = 0

    for _ in range(3000):
        r = rng.random()
        w = int(rng.integers(workers))
        if r < 0.12:
            shard.leave(w)
            gone(w)
            maybe_close_round()
        elif r < 0.24:  # a new incarnation of w: a live one departs first, seq starts at 0
            shard.join(w, int(shard.incarnation[w]) + 1)
            if live[w]:
                gone(w)
                maybe_close_round()
            clocks[w] = max(clocks[w], brute_min())
            live[w] = True
            counted[w] = clocks[w] == 0
            done.discard(w)
            seq[w] = 0
        elif r < 0.28:  # a replay of the worker's last push: acknowledged, nothing changes
            ack = push(shard, w, seq[w] - 1, shard.version, np.zeros(6))
            assert ack.ok == ack.duplicate == (live[w] and seq[w] > 0)
        else:
            if r < 0.85:  # a well-behaved worker: a live one its gate lets start
                ready = [v for v in range(workers) if live[v] and shard.may_start(v)]
                if not ready:
                    continue
                w = ready[int(rng.integers(len(ready)))]
            bad = r >= 0.95  # a push the shard refuses after validation (still a step)
            g = np.full(6, math.nan if bad else 0.0)
            ack = push(shard, w, seq[w], shard.version, g)
            assert ack.ok == (live[w] and not bad)
            if live[w]:
                clocks[w], counted[w] = start_clock(w), True
                seq[w] += 1
                clocks[w] += 1
                done.add(w)
                if consistency.averages_rounds:
                    merged += not bad
                else:
                    version += not bad
                maybe_close_round()

        assert shard.live.tolist() == live
        assert shard.clocks.tolist() == clocks
        assert shard.min_clock() == brute_min()
        assert shard.version == version
        for v in range(workers):
            assert shard.may_start(v) == consistency.may_start(start_clock(v), brute_min())
            seen["blocked"] += live[v] and not shard.may_start(v)
        seen["nobody_live"] += not any(live)
    assert seen["nobody_live"] > 0
    assert seen["blocked"] > 0 or consistency.bound == math.inf
    if consistency.averages_rounds:
        assert rounds_closed > 50 and version > 50


def test_ssp_extremes_match_bsp_and_asp_gating():
    assert SSP(0).may_start(3, 3) and not SSP(0).may_start(4, 3)
    assert BSP().may_start(3, 3) and not BSP().may_start(4, 3)
    assert SSP(math.inf).may_start(10**9, 0) and ASP().may_start(10**9, 0)
    with pytest.raises(ValueError, match="SSP bound must be an integer >= 0"):
        SSP(-1)
    with pytest.raises(ValueError, match="SSP bound must be an integer >= 0"):
        SSP(1.5)


def test_rejected_staleness_rule_arguments():
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        st.inverse(max_staleness=-1)
    with pytest.raises(ValueError, match="base must be in"):
        st.exponential(1.5)
    with pytest.raises(ValueError, match="unknown staleness rule 'fancy'"):
        st.from_name("fancy")
    assert st.from_name("polynomial", power=1.0).param == 1.0


def test_unknown_worker_pull_raises():
    shard = make_shard()
    with pytest.raises(ValueError, match="unknown worker 3"):
        shard.pull(worker=3)
    with pytest.raises(ValueError, match="pull buffer is float32"):
        shard.pull(worker=0, out=np.empty(5, np.float32))


# -- sharding ---------------------------------------------------------------------------


def test_sharding_balances_bytes_on_leaf_boundaries():
    seg = Segments.from_sizes([f"l{i}" for i in range(8)], [100, 20, 30, 50, 100, 60, 40, 100])
    ranges = sharding.plan(seg, 3)
    bounds = set(seg.offsets.tolist()) | {seg.total}
    assert all(a in bounds and b in bounds for a, b in ranges)
    sizes = [b - a for a, b in ranges]
    assert sum(sizes) == seg.total and max(sizes) <= 1.4 * seg.total / 3


def test_sharding_splits_only_a_leaf_larger_than_a_share():
    seg = Segments.from_sizes(["emb", "w", "b"], [1000, 100, 10])
    ranges = sharding.plan(seg, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 1110
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 100  # the big leaf is cut to keep the balance
    pieces = [seg.slice(a, b) for a, b in ranges]
    assert pieces[0].names == ("emb",) and sum(p.total for p in pieces) == 1110


def test_sharding_rejects_bad_counts():
    with pytest.raises(ValueError, match="shards must be an integer >= 1, got 0"):
        sharding.plan(Segments.single(10), 0)


# -- a shard process that dies under Job.serve: every client call says so, at once ----------


def kill_shard(server, k):
    """SIGKILLs shard ``k``'s process and waits (bounded) until it has exited."""
    os.kill(server._procs[k].pid, signal.SIGKILL)
    assert connection.wait([server.shard_sentinels()[k]], 10), f"shard {k} did not die"


def two_shards(**kw):
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    return sw.Job(params, optimizer=optim.sgd(1.0), shards=2, **kw)


ONES = {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}


DIED = r"^shard {} has died \(killed by SIGKILL\)$"


def raises_shard_error_at_once(k, call, limit=2.0):
    """``call()`` raises ShardError naming shard ``k`` within ``limit`` seconds."""
    start = time.monotonic()
    with pytest.raises(sw.ShardError, match=DIED.format(k)):
        call()
    assert time.monotonic() - start < limit


def pulls_until_shard_error(client, k, limit=2.0):
    """Pulls until one raises ShardError naming shard ``k``, which must happen within
    ``limit`` seconds of its process's exit (the server's watcher writes it into shared
    memory; until then a pull may still read the last snapshot). Returns those pulls."""
    start, stale = time.monotonic(), 0
    while True:
        try:
            client.pull(timeout=30)
        except sw.ShardError as e:
            assert re.match(DIED.format(k), str(e)), e
            return stale
        stale += 1
        assert time.monotonic() - start < limit, f"{stale} pulls after shard {k} died"


def test_every_client_call_after_a_shard_process_died_raises_shard_error_naming_it(no_leaks):
    """A pull after a shard died never returns its last snapshot nor blocks; push and
    wait do not hang either. Once per case: shard 0 or shard 1 dies, with the last push
    acknowledged or still in flight (each trial starts two shard processes, ~3 s)."""
    outcomes = set()  # (acks read before the kill, what wait() did after it)
    for trial in range(4):
        k = trial % 2
        with two_shards().serve(workers=2) as server:
            client = server.client(0)
            client.pull(timeout=30)
            for _ in range(3):
                client.push(ONES)
            if trial % 4 < 2:  # else the last push's acks are still unread
                assert client.wait(timeout=30).status == "applied"
            kill_shard(server, k)
            pulls_until_shard_error(client, k)
            raises_shard_error_at_once(k, lambda c=client: c.pull(timeout=30))  # again
            raises_shard_error_at_once(k, lambda c=client: c.push(ONES, timeout=30))
            # the acks of the push in flight: the live shard's, or ShardError naming the dead
            # one; never a hang (that would be a TimeoutError, 30 s on)
            try:
                result = client.wait(timeout=30)
            except sw.ShardError as e:
                assert re.match(DIED.format(k), str(e)), e
                outcomes.add((trial % 4 < 2, "ShardError"))
            else:
                assert result is not None and result.status == "applied", result
                outcomes.add((trial % 4 < 2, "applied"))
            with pytest.raises(sw.ShardError, match=rf"shard {k} has died"):
                server.pull(timeout=30)
            client.close()
    # acks read before the kill: wait() has nothing left to wait for and says so at once
    assert {o for o in outcomes if o[0]} == {(True, "applied")}, outcomes


def test_a_pull_waiting_at_a_gate_raises_shard_error_when_a_shard_process_dies(no_leaks):
    """Under BSP worker 0's pull waits for worker 1's push; shard 1's process is killed
    meanwhile: the waiting pull raises ShardError naming it, it does not wait forever."""
    with two_shards(consistency=sw.BSP()).serve(workers=2) as server:
        c0 = server.client(0)
        c0.pull(timeout=30)
        c0.push(ONES)
        assert c0.wait(timeout=30).status == "applied"
        killer = threading.Timer(0.5, kill_shard, (server, 1))
        killer.start()
        try:
            start = time.monotonic()
            with pytest.raises(sw.ShardError, match=DIED.format(1)):
                c0.pull(timeout=60)  # the round waits for worker 1, which never pushes
            assert 0.4 < time.monotonic() - start < 10
        finally:
            killer.join()
        c0.close()
