"""Numerical faults: overflowing pushes are refused and change nothing; refusals are
reported as they happen; a worker whose pushes keep being refused has diverged."""

import logging
import math

import numpy as np
import pytest

import stalewise as sw
from stalewise import optim
from stalewise.consistency import BSP
from stalewise.protocol import Ack, Diverged, PushHeader, PushResult, Shard, commit, loop
from stalewise.protocol.state import _flatten_state
from stalewise.runtime.errors import DivergedError
from stalewise.segments import Segments

F32_MAX = float(np.finfo(np.float32).max)

OPTIMIZERS = {
    "sgd": lambda lr: optim.sgd(lr),
    "momentum": lambda lr: optim.sgd(lr, momentum=0.9),
    "adam": lambda lr: optim.adam(lr),
    "lamb": lambda lr: optim.lamb(lr, max_trust_ratio=math.inf),
}


def shard_of(opt, params, workers=1, **kw):
    shard = Shard(params, Segments.single(params.size), opt, workers=workers, **kw)
    for w in range(workers):
        shard.join(w, 1)
    return shard


def frozen(shard):
    """Everything a refused push must leave alone, as bytes: params, optimizer state, version."""
    arrays = _flatten_state(shard.opt_state)[1]
    return shard.params.tobytes(), {k: a.tobytes() for k, a in arrays.items()}, shard.version


class Pusher:
    """Pushes into a list of shards as one worker, judging each push under the commit rule."""

    def __init__(self, shards, seg):
        self.shards, self.seg, self.seq = shards, seg, 0

    def push(self, flat):
        flat = np.asarray(flat, np.float32)
        n = len(self.shards)
        ranges = [(k * flat.size // n, (k + 1) * flat.size // n) for k in range(n)]
        bases = [s.version for s in self.shards]
        verdict = commit.judge(flat, self.seg, bases, bases, sw.staleness.constant(), whole=n > 1)
        acks = [
            s.push(PushHeader(0, self.seq, s.version, 1), flat[lo:hi].copy(), verdict=verdict)
            for s, (lo, hi) in zip(self.shards, ranges, strict=True)
        ]
        self.seq += 1
        return PushResult.of(acks)


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_huge_pushes_are_refused_as_overflow_and_change_nothing(name, shards):
    """1e38 and 1e19 pushes (squared norms beyond float32) are refused, bit for bit."""
    n = 8
    rng = np.random.default_rng(0)
    params = rng.normal(size=n).astype(np.float32)
    size = n // shards
    seg = Segments.single(n)
    group = [
        Shard(
            params[k * size : (k + 1) * size],
            Segments.single(size),
            OPTIMIZERS[name](0.01),
            workers=1,
            shard_id=k,
            job_segments=seg,
        )
        for k in range(shards)
    ]
    for s in group:
        s.join(0, 1)
    pusher = Pusher(group, seg)
    for _ in range(3):  # the optimizer state is not trivial any more
        assert pusher.push(rng.normal(size=n)).status == "applied"
    before = [frozen(s) for s in group]
    for value in (1e38, 1e19, F32_MAX, -F32_MAX):
        result = pusher.push(np.full(n, value))
        assert result.status == "refused" and result.kind == "overflow", result
        assert "overflows the dtype" in result.reason
    huge_one = np.zeros(n, np.float32)
    huge_one[n - 1] = 1.85e19  # one element whose square overflows
    result = pusher.push(huge_one)
    assert result.kind == "overflow" and f"element {n - 1}" in result.reason
    assert [frozen(s) for s in group] == before
    assert all(s.stats.rejected == {"overflow": 5} for s in group)
    result = pusher.push(rng.normal(size=n))  # the worker goes on
    assert result.status == "applied" and all(s.version == 4 for s in group)
    assert np.all(np.isfinite(params)) and group[0].params.tobytes() != before[0][0]


OVERFLOWING_LR = {"sgd": 1e38, "momentum": 1e38, "adam": 1e38, "lamb": 3.0}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_that_would_overflow_the_params_is_not_taken(name):
    """A modest push, but params near float32's limit: the shard's own check refuses it."""
    params = np.full(8, 3e38, np.float32)
    shard = shard_of(OPTIMIZERS[name](OVERFLOWING_LR[name]), params)
    before = frozen(shard)
    ack = shard.push(PushHeader(0, 0, 0, 1), -np.ones(8, np.float32))
    assert not ack.ok and ack.kind == "overflow", ack
    assert "would make parameter 0 (leaf 'params') non-finite on shard 0" in ack.reason
    assert frozen(shard) == before  # params, moments and step count, bit for bit
    assert shard.clocks[0] == 1  # still the worker's step
    ack = shard.push(PushHeader(0, 1, 0, 1), np.zeros(8, np.float32))
    assert ack.ok and shard.version == 1 and np.all(np.isfinite(params))


def test_a_step_that_would_overflow_the_optimizer_state_is_not_taken():
    """Adam's coupled weight decay squares ``g + 0.01 * p``: with p near the limit, nu overflows."""
    params = np.full(8, 3e38, np.float32)
    shard = shard_of(optim.adam(1e-3, weight_decay=0.01), params)
    before = frozen(shard)
    ack = shard.push(PushHeader(0, 0, 0, 1), np.ones(8, np.float32))
    assert ack.kind == "overflow" and "the optimizer state 'nu'" in ack.reason
    assert frozen(shard) == before


def test_a_bsp_round_that_would_overflow_is_dropped_with_a_warning(caplog):
    params = np.full(4, 3e38, np.float32)
    shard = shard_of(optim.sgd(1e38), params, workers=2, consistency=BSP())
    before = frozen(shard)
    with caplog.at_level(logging.WARNING, logger="stalewise.protocol.shard"):
        assert shard.push(PushHeader(0, 0, 0, 1), -np.ones(4, np.float32)).ok
        assert shard.push(PushHeader(1, 0, 0, 1), -np.ones(4, np.float32)).ok  # closes the round
    assert "a BSP round of 2 pushes is dropped" in caplog.text
    assert frozen(shard) == before
    assert shard.stats.applied == 0 and shard.stats.rejected == {"overflow": 2}
    assert shard.may_start(0) and shard.may_start(1)  # the round is over all the same


def test_an_overflow_on_one_shard_only_splits_the_push_and_says_so(caplog):
    """The one refusal the sender cannot judge: reported as ``split``, counted, warned."""
    seg = Segments.single(8)
    near_limit = np.full(4, 3e38, np.float32)
    shards = [
        Shard(near_limit, Segments.single(4), optim.sgd(1e38), workers=1, job_segments=seg),
        Shard(np.zeros(4, np.float32), Segments.single(4), optim.sgd(1e38), workers=1),
    ]
    for s in shards:
        s.join(0, 1)
    result = Pusher(shards, seg).push(-np.ones(8))
    assert result.status == "split" and result.kind == "overflow"
    assert "shard 0: overflow" in result.reason and result.versions == (0, 1)
    stats = loop.LoopStats(steps=1)
    with caplog.at_level(logging.WARNING, logger="stalewise.protocol.loop"):
        loop.report([result], stats, 3)
    assert stats.outcomes == {"split": 1} and stats.refusals == {"overflow": 1}
    assert "worker 3: push 0 split (applied by some shards only)" in caplog.text


def refused(seq, kind="not_finite"):
    ack = Ack(0, seq, False, f"{kind}: bad push {seq}", 0, 0, kind=kind)
    return PushResult.of([ack])


def applied(seq):
    return PushResult.of([Ack(0, seq, True, None, seq + 1, 0)])


def test_refusals_are_warned_as_they_happen_but_not_one_line_each(caplog, monkeypatch):
    stats = loop.LoopStats()
    with caplog.at_level(logging.WARNING, logger="stalewise.protocol.loop"):
        for seq in range(120):
            stats.steps += 1
            loop.report([refused(seq)], stats, 2)
        first = list(caplog.messages)
        # the first, the 10th and the 100th: each with the worker and the counts
        assert len(first) == 3, first
        assert first[0].startswith("worker 2: push 0 refused: shard 0: not_finite: bad push 0")
        assert "(1 of 1 pushes refused so far)" in first[0]
        assert "worker 2: 10 pushes refused as not_finite (10 of 10 pushes so far)" in first[1]
        assert "last: push 99 refused: shard 0: not_finite: bad push 99" in first[2]
        # and besides those, at most one every WARN_EVERY seconds
        monkeypatch.setattr(loop, "WARN_EVERY", 0.0)
        stats.steps += 1
        loop.report([refused(120, "too_stale")], stats, 2)  # a new kind: its first
        stats.steps += 1
        loop.report([refused(121)], stats, 2)
        assert len(caplog.messages) == 5
        assert "121 pushes refused as not_finite (122 of 122 pushes so far)" in caplog.messages[-1]
    assert stats.refusals == {"not_finite": 121, "too_stale": 1}


def test_diverged_after_k_numerical_refusals_in_a_row():
    stats = loop.LoopStats()
    loop.report([refused(0), refused(1, "overflow")], stats, 4, diverge_after=3)
    loop.report([applied(2)], stats, 4, diverge_after=3)  # an applied push starts again
    loop.report([refused(3), refused(4, "too_stale"), refused(5)], stats, 4, diverge_after=3)
    assert stats.refused_in_a_row == 2  # too_stale neither counts nor breaks the run
    with pytest.raises(Diverged) as info:
        loop.report([refused(6, "overflow")], stats, 4, diverge_after=3)
    e = info.value
    assert (e.worker, e.pushes) == (4, 3)
    assert "worker 4 diverged: its last 3 pushes were refused" in str(e)
    assert "overflow: bad push 6" in str(e)


def test_the_worker_loop_raises_diverged_and_checks_its_setting():
    grads = lambda p, b: (math.nan, {"x": np.full(2, np.nan)})  # noqa: E731
    seq = iter(range(100))

    def answer(request):
        if request is loop.BEGIN:
            return True
        if request is loop.PULL:
            return {"x": np.zeros(2)}
        return [refused(next(seq))]

    gen = loop.worker_loop(sw.strategies.gradients(), grads, iter([0] * 100), diverge_after=5)
    with pytest.raises(Diverged, match="worker 0 diverged: its last 5 pushes"):
        loop.run(gen, answer)
    assert next(seq) == 5  # it stopped at the 5th refusal
    with pytest.raises(ValueError, match="diverge_after must be an integer >= 1 or None"):
        next(loop.worker_loop(sw.strategies.gradients(), grads, iter([]), diverge_after=0))


def nan_loss_and_grad(params, batch):
    return math.nan, {"x": np.full(4, np.nan, np.float32)}


def tagged_batches(worker, workers):
    return iter([(worker, i) for i in range(10**6)])


def grads_nan_on_worker_0(params, batch):
    worker, _ = batch
    value = np.nan if worker == 0 else 0.1
    return 1.0, {"x": np.full(4, value, np.float32)}


def test_a_simulated_run_whose_every_push_is_refused_is_not_a_success(caplog):
    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.adam(0.1), shards=2)
    with pytest.raises(
        DivergedError, match=r"^training diverged: worker\(s\) 0, 1, 2 stopped because their pushes"
    ):
        job.train(nan_loss_and_grad, data=[[0]] * 3, workers=3, steps=10_000, runtime="sim")
    assert sum("diverged: its last 20 pushes" in m for m in caplog.messages) == 3


def test_a_simulated_worker_that_diverges_stops_and_the_others_finish(caplog):
    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1))
    with caplog.at_level(logging.WARNING):
        r = job.train(
            grads_nan_on_worker_0, data=tagged_batches, workers=2, steps=200, runtime="sim"
        )
    # a gradient worker learns that a push was refused once its next one is sent (its
    # pull overlaps the push, as in the local runtime): one more push is refused
    refused = loop.DIVERGE_AFTER + 1
    assert r.pushes == 200
    assert r.stats["rejected"] == {"not_finite": refused}
    assert r.stats["applied"] == 200 - refused
    assert any("worker 0 diverged" in m for m in caplog.messages)
    np.testing.assert_allclose(r.params["x"], np.full(4, -0.01 * (200 - refused)), rtol=1e-4)


def huge_then_fine(params, batch):
    """Gradients of 1e38 (batches 3 and 4) and 1e19 (batch 5) among ordinary ones."""
    value = {3: 1e38, 4: -1e38, 5: 1e19}.get(batch % 50, 0.5)
    return 1.0, {"a": np.full(4, value, np.float32), "b": np.full(4, 0.5, np.float32)}


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_a_simulated_run_with_huge_pushes_refuses_them_and_goes_on(name):
    opt = OPTIMIZERS[name](0.01)
    job = sw.Job({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}, optimizer=opt)
    counting = lambda w, n: iter(range(10**6))  # noqa: E731
    r = job.train(huge_then_fine, data=counting, workers=1, steps=40, runtime="sim")
    assert r.stats["rejected"] == {"overflow": 3} and r.stats["applied"] == 37
    assert np.all(np.isfinite(r.flat))
    assert np.all(r.params["a"] < -0.1)  # Adam did not freeze: every good push moved it


@pytest.mark.parametrize("shards", [1, 2])
def test_huge_finite_input_never_crashes_the_client_and_changes_nothing(no_leaks, shards):
    """Regression: 1e38 was applied (then Inf, NaN); with 2 shards ~1.85e19 crashed the client."""
    job = sw.Job(
        {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)},
        optimizer=sw.optim.adam(0.1),
        shards=shards,
    )
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=10)
        client.push({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})
        assert client.wait(timeout=10).status == "applied"
        before = server.pull()
        for a in (1.85e19, 1e38, F32_MAX, -F32_MAX, 1e19):
            client.push({"a": np.full(4, a, np.float32), "b": np.ones(4, np.float32)})
            result = client.wait(timeout=10)
            assert result.status == "refused" and result.kind == "overflow", (a, result)
        after = server.pull()
        for leaf in ("a", "b"):
            assert after[leaf].tobytes() == before[leaf].tobytes()
        client.push({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})
        assert client.wait(timeout=10).status == "applied"
        assert np.all(server.pull()["a"] < before["a"])  # Adam still moves: not frozen
        assert [s["rejected"] for s in server.stats()] == [{"overflow": 5}] * shards
        client.close()
