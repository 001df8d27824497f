"""The simulator runtime: protocol on a virtual clock, queueing science, determinism, faults."""

from __future__ import annotations

import itertools
import logging
import math
import pickle

import numpy as np
import pytest

import stalewise as sw
from stalewise import report, tasks
from stalewise import sweep as sweep_lib
from stalewise.runtime import sim
from stalewise.runtime.sim.config import SimConfig, SimConfigError
from stalewise.runtime.sim.models import (
    Failure,
    Fixed,
    Join,
    Network,
    Service,
    ShiftedExponential,
    Slowdown,
    Stragglers,
    WorkerTiming,
)
from stalewise.strategies import Step, Strategy

FREE = {
    "network": Network(latency=0.0, bandwidth=math.inf),
    "service": Service(time=0.0, rate=math.inf),
}
RECORD_KEYS = {"run", "time", "updates", "pushes", "train_loss", "staleness_mean", "staleness_max"}


def _cheap_task():
    return tasks.get("least-squares", n=64, d=4, exact=True)


def _train(task, *, workers, steps, consistency=None, staleness=None, lr=0.1, shards=1, **kw):
    job = sw.Job(
        task.init_params(),
        optimizer=sw.optim.sgd(lr),
        consistency=consistency,
        staleness=staleness,
        shards=shards,
    )
    kw.setdefault("eval_interval", 1.0)
    return sim.train(
        job.config,
        task.loss_and_grad,
        data=task.batches,
        workers=workers,
        steps=steps,
        strategy=job.strategy,
        evaluate=task.evaluate,
        **kw,
    )


# -- queueing science ---------------------------------------------------------------------


@pytest.mark.parametrize("workers", [4, 16])
def test_bsp_round_time_grows_like_harmonic_number(workers):
    mu, rounds = 2.0, 250
    cfg = SimConfig(compute=ShiftedExponential(shift=0.0, rate=mu), **FREE)
    r = _train(
        _cheap_task(), workers=workers, steps=rounds * workers, consistency=sw.BSP(), sim=cfg
    )
    assert r.stats["version"] == rounds
    harmonic = sum(1.0 / k for k in range(1, workers + 1))
    per_round = r.time / rounds
    print(f"BSP P={workers}: {per_round:.4f} s per round, H_P/mu = {harmonic / mu:.4f}")
    assert per_round == pytest.approx(harmonic / mu, rel=0.10)


@pytest.mark.parametrize("workers", [4, 16])
def test_asp_time_per_update_is_one_over_p_mu(workers):
    mu, steps = 2.0, 3000
    cfg = SimConfig(compute=ShiftedExponential(shift=0.0, rate=mu), **FREE)
    r = _train(_cheap_task(), workers=workers, steps=steps, sim=cfg, eval_interval=5.0)
    steady = [rec for rec in r.records if rec["time"] > 0 and rec["pushes"] < steps - workers]
    rec = steady[-1]  # before the last steps drain
    per_update = rec["time"] / rec["updates"]
    print(f"ASP P={workers}: {per_update:.5f} s per update, 1/(P mu) = {1 / (workers * mu):.5f}")
    assert per_update == pytest.approx(1.0 / (workers * mu), rel=0.10)


def test_asp_mean_staleness_is_p_with_pipelined_pushes():
    """A gradient push is pipelined (stalewise.protocol.pipeline): the next pull reads the
    snapshot at once, before the shard has applied the push, so each push is staler by
    the other P - 1 workers' pushes and by the worker's own last one: P."""
    workers = 8
    cfg = SimConfig(compute=ShiftedExponential(shift=0.0, rate=1.0), **FREE)
    r = _train(_cheap_task(), workers=workers, steps=4000, sim=cfg, eval_interval=100.0)
    print(f"ASP P={workers}: mean staleness {r.stats['staleness_mean']:.3f}")
    assert r.stats["staleness_mean"] == pytest.approx(workers, rel=0.05)


def test_the_worker_loop_is_charged_once_a_push_at_no_stragglers_pace():
    """SimConfig.loop: a worker's own time besides its compute, once a push. An emulated
    straggler sleeps in proportion to its compute only, and DiLoCo's local steps each
    compute, but the loop runs once: neither scales it."""
    cfg = SimConfig(compute=Fixed(0.01), loop=0.002)
    timing = WorkerTiming(cfg, 2, factors=[1.0, 3.0])
    assert timing.finish(0, 0.0) == pytest.approx(0.012)
    assert timing.finish(1, 0.0) == pytest.approx(0.032)
    assert timing.finish(0, 1.0, local_steps=4) == pytest.approx(1.042)
    assert timing.cpu_work(0, timing.draw(0, 4)) == pytest.approx(0.042)  # the loop is CPU too
    assert WorkerTiming(SimConfig(compute=Fixed(0.01)), 1).finish(0, 0.0) == 0.01
    with pytest.raises(SimConfigError, match="loop"):
        SimConfig(loop=-1.0)


def _held(result) -> float:
    """The share of a run's pushes after the first that were applied with staleness 0."""
    counts = {int(t): n for t, n in result.stats["staleness_counts"].items()}
    return (counts.get(0, 0) - 1) / (sum(counts.values()) - 1)


RACE = {
    "compute": ShiftedExponential(shift=0.002, rate=1000.0),
    "network": Network(latency=1e-4, bandwidth=math.inf),
    "service": Service(time=2e-4, rate=math.inf),
}


@pytest.mark.parametrize("own_read", [0.0, 0.3, 0.8, 1.0])
def test_a_lone_workers_read_holds_its_own_push_as_often_as_own_read_says(own_read):
    """SimConfig.own_read: the chance a lone worker's snapshot read right after its push
    holds that push (calibrate measures it in a one-worker run); the simulated worker's
    next push is then applied with staleness 0, else 1."""
    cfg = SimConfig(**RACE, own_read=own_read)
    r = _train(_cheap_task(), workers=1, steps=400, sim=cfg, eval_interval=100.0)
    assert _held(r) == pytest.approx(own_read, abs=0.02)


def test_four_workers_are_less_stale_the_more_often_a_read_holds_its_own_push():
    """With other workers' pushes queued before its own at the shard, the race still
    goes both ways: the mean staleness falls as own_read grows (with no race model the
    pipelined read never holds the push)."""
    task, stale = _cheap_task(), {}
    for own_read in (None, 0.0, 0.5, 1.0):
        cfg = SimConfig(**RACE, own_read=own_read)
        r = _train(task, workers=4, steps=800, sim=cfg, eval_interval=100.0)
        stale[own_read] = r.stats["staleness_mean"]
    print(stale)
    assert stale[None] == stale[0.0] > stale[0.5] > stale[1.0]
    assert stale[None] - stale[1.0] > 0.9  # its own push is one version of it


def test_asp_mean_staleness_is_p_minus_one_when_pushes_settle():
    """A settling push (model averaging) is answered at its acks, and the next pull
    holds it: only the other P - 1 workers' pushes make it stale."""
    workers, task = 8, _cheap_task()
    cfg = SimConfig(compute=ShiftedExponential(shift=0.0, rate=1.0), **FREE)
    job = sw.Job(
        task.init_params(),
        strategy=sw.strategies.local_sgd(local_steps=1, inner=sw.optim.sgd(0.01)),
    )
    r = sim.train(
        job.config, task.loss_and_grad, data=task.batches, workers=workers, steps=4000,
        strategy=job.strategy, sim=cfg, eval_interval=100.0,
    )  # fmt: skip
    print(f"settling P={workers}: mean staleness {r.stats['staleness_mean']:.3f}")
    assert r.stats["staleness_mean"] == pytest.approx(workers - 1, rel=0.10)


def test_sharding_cuts_communication_time():
    # 10 workers, a 100M-parameter model (400 MB of float32) on 10 Gbit/s links.
    task = tasks.get("least-squares", n=64, d=1000, exact=True)
    cfg = SimConfig(
        compute=Fixed(0.1),
        network=Network(latency=50e-6, bandwidth=1.25e9),
        model_bytes=400_000_000,
    )
    comm, per_update = {}, {}
    for shards in (1, 5, 10):
        r = _train(task, workers=10, steps=100, shards=shards, sim=cfg, eval_interval=10.0)
        comm[shards] = r.stats["sim"]["comm_time_mean"]
        per_update[shards] = r.time / r.stats["version"]
    print(f"communication time per update: {comm} s; virtual time per update: {per_update}")
    for shards in (5, 10):
        assert comm[shards] <= 0.6 * comm[1]
        assert per_update[shards] <= 0.6 * per_update[1]


def test_straggler_asp_beats_ssp_beats_bsp():
    task = tasks.get("least-squares", n=512, d=32, batch_size=16)
    cfg = SimConfig(compute=Fixed(1.0), stragglers=Stragglers(count=1, slowdown=4.0))
    target = 1e-3 * task.evaluate(task.init_params())["loss"]
    times = {}
    for cons in (sw.ASP(), sw.SSP(2), sw.BSP()):
        times[str(cons)] = _train_until(task, cons, cfg, target)
    print(f"virtual time to loss {target:.3g} under a 4x straggler: {times}")
    assert times["ASP"] < times["SSP(2)"] < times["BSP"]


def _train_until(task, consistency, cfg, target):
    r = _train(
        task,
        workers=4,
        steps=1600,
        consistency=consistency,
        staleness=sw.staleness.inverse(),
        lr=0.2,
        sim=cfg,
        stop_at={"loss": target},  # the records up to it are those of the run to its budget
    )
    t = report.time_to_target(r.records, "loss", target, mode="min")
    assert t is not None, f"{consistency} never reached {target}"
    return t


# -- protocol on the virtual clock -----------------------------------------------------------


def test_records_and_result_have_the_local_schema():
    task = tasks.get("least-squares", n=128, d=8)
    r = _train(task, workers=4, steps=200, shards=2, eval_interval=0.1, run="sim-run")
    assert r.pushes == 200 and r.stats["applied"] == 200 and r.stats["shards"] == 2
    assert r.records[0]["time"] == 0.0 and r.records[-1]["time"] == r.time
    for rec in r.records:
        assert set(rec) == RECORD_KEYS | {"loss", "distance"}
        assert rec["run"] == "sim-run"
    times = [rec["time"] for rec in r.records[:-1]]
    assert times == pytest.approx([0.1 * i for i in range(len(times))])
    assert r.records[-1]["loss"] < 0.1 * r.records[0]["loss"]
    assert set(r.params) == {"x"} and np.array_equal(r.params["x"], r.flat)


def test_same_seed_is_bit_identical_and_other_seed_differs():
    task = tasks.get("least-squares", n=128, d=8)
    runs = [
        _train(
            task,
            workers=6,
            steps=300,
            shards=2,
            consistency=sw.SSP(1),
            sim_seed=s,
            eval_interval=0.05,
        )
        for s in (7, 7, 8)
    ]
    a, b, c = runs
    assert a.flat.tobytes() == b.flat.tobytes()
    assert a.records == b.records and a.time == b.time
    assert a.flat.tobytes() != c.flat.tobytes()
    assert a.time != c.time


def test_ssp_gate_bounds_the_clock_gap():
    task = _cheap_task()
    order = []

    def loss_and_grad(params, batch):
        order.append(batch)
        return task.loss_and_grad(params, None)

    def data(worker, workers):
        return iter(lambda: worker, None)

    def max_gap(consistency):
        order.clear()
        job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1), consistency=consistency)
        cfg = SimConfig(compute=Fixed(1.0), stragglers=Stragglers(count=1, slowdown=4.0))
        sim.train(
            job.config,
            loss_and_grad,
            data=data,
            workers=4,
            steps=200,
            strategy=job.strategy,
            sim=cfg,
        )
        started, gap = [0] * 4, 0
        for w in order:
            started[w] += 1
            gap = max(gap, max(started) - started[3])
        return gap

    assert max_gap(sw.SSP(2)) <= 3
    assert max_gap(sw.BSP()) <= 1
    assert max_gap(sw.ASP()) > 20


def test_failure_under_bsp_does_not_deadlock_and_join_resumes():
    task = _cheap_task()
    seen = []

    def loss_and_grad(params, batch):
        seen.append(batch)
        return task.loss_and_grad(params, None)

    def data(worker, workers):
        return iter(lambda: worker, None)

    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1), consistency=sw.BSP())
    cfg = SimConfig(
        compute=Fixed(1.0),
        failures=[Failure(worker=1, time=5.5)],
        joins=[Join(worker=1, time=20.0), Join(worker=3, time=10.0)],
        **FREE,
    )
    r = sim.train(
        job.config, loss_and_grad, data=data, workers=4, steps=120, strategy=job.strategy, sim=cfg
    )
    # the BSP budget is whole rounds: 120 pushes of 4 workers are 30 rounds, of which
    # worker 3 misses the first 10 and worker 1 those between its failure and its join
    assert r.stats["version"] == 30 and r.pushes == r.stats["applied"]
    assert 120 - 10 - 15 <= r.pushes <= 120 - 10 - 10
    assert r.time < 60
    first = {w: seen.index(w) for w in range(4)}
    assert first[3] >= 20  # worker 3 was absent until its join at t=10
    ones = [i for i, w in enumerate(seen) if w == 1]
    assert any(i > len(seen) // 2 for i in ones)  # worker 1 works again after its join


def test_everyone_failing_ends_the_run_with_a_warning(caplog):
    cfg = SimConfig(compute=Fixed(1.0), failures=[Failure(w, 2.5) for w in range(3)])
    with caplog.at_level("WARNING"):
        r = _train(
            _cheap_task(),
            workers=3,
            steps=100,
            consistency=sw.SSP(1),
            sim=cfg,
            on_worker_failure="drop",  # under "restart" they would come back
        )
    assert r.pushes == 6 and r.time == pytest.approx(2.5)
    assert "6 of 100 pushes" in caplog.text


def test_stop_at_stops_at_the_first_record_that_meets_it():
    task = tasks.get("least-squares", n=128, d=8)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))

    def evaluate(params):
        m = task.evaluate(params)
        return m | {"progress": -m["loss"]}

    r = sim.train(
        job.config,
        task.loss_and_grad,
        data=task.batches,
        workers=4,
        steps=5000,
        strategy=job.strategy,
        evaluate=evaluate,
        eval_interval=0.05,
        stop_at={"progress": (-0.1, "max")},  # a name that tells no direction
    )
    assert r.records[-1]["progress"] >= -0.1 > r.records[-2]["progress"]
    assert r.pushes < 5000 and r.time == r.records[-1]["time"]


def test_late_fault_events_do_not_extend_the_run():
    cfg = SimConfig(compute=Fixed(1.0), failures=[Failure(0, 500.0)], joins=[Join(0, 900.0)])
    r = _train(_cheap_task(), workers=2, steps=20, sim=cfg)
    assert r.pushes == 20 and 10 < r.time < 11 and r.records[-1]["time"] == r.time


def test_staleness_rules_run_in_the_simulator():
    task = _cheap_task()
    rule = sw.staleness.inverse(max_staleness=2, dc_lambda=0.1)
    cfg = SimConfig(compute=ShiftedExponential(0.0, 1.0))
    r = _train(task, workers=8, steps=400, staleness=rule, sim=cfg)
    assert r.stats["rejected"]["too_stale"] > 0
    assert r.stats["applied"] + r.stats["rejected"]["too_stale"] == 400
    assert r.stats["staleness_max"] <= 2


def test_timeout_is_wall_seconds():
    with pytest.raises(TimeoutError, match="timeout"):
        _train(_cheap_task(), workers=4, steps=2000, timeout=0.0)


def test_user_error_becomes_worker_error():
    task = _cheap_task()

    def broken(params, batch):
        raise ZeroDivisionError("boom")

    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    with pytest.raises(sw.WorkerError, match="boom"):
        sim.train(job.config, broken, data=task.batches, workers=2, steps=10, strategy=job.strategy)


def test_model_bytes_scales_transfer_times():
    task = _cheap_task()
    base = dict(
        compute=Fixed(0.0),
        network=Network(latency=0.0, bandwidth=1e6),
        service=Service(0.0, math.inf),
    )
    small = _train(task, workers=1, steps=10, sim=SimConfig(**base))
    big = _train(task, workers=1, steps=10, sim=SimConfig(**base, model_bytes=1_000_000))
    # a pull of 16 bytes per step; each push (pipelined) leaves on the worker's egress link
    # while its next pull comes in on its ingress link: only the last push adds its time
    assert small.time == pytest.approx((10 + 1) * 16 / 1e6)
    assert big.time == pytest.approx((10 + 1) * 1.0)
    assert np.array_equal(small.flat, big.flat)  # timing only: same updates, same order


# -- the protocol's worker loop and commit rule in the simulator -----------------------------

TARGET_A = np.arange(1.0, 5.0, dtype=np.float32)
TARGET_B = -np.arange(1.0, 5.0, dtype=np.float32)


def _two_leaf_job(**kw):
    """Leaves ``a`` and ``b`` of 4 elements each: with 2 shards, shard 0 holds a, shard 1 b."""
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(0.1), shards=2, **kw)
    assert job.config.ranges == [(0, 4), (4, 8)]
    return job


def _counting(worker, workers):
    return ((worker, i) for i in itertools.count())


def _poisoned(batch):
    worker, i = batch
    return worker == 0 and i % 5 == 4


def _two_leaf_loss_and_grad(bad_batches, nan):
    def loss_and_grad(params, batch):
        ga, gb = params["a"] - TARGET_A, params["b"] - TARGET_B
        loss = 0.5 * float(ga @ ga + gb @ gb)
        if _poisoned(batch):
            bad_batches.append(batch)
            if nan:  # leaf a: a large but finite step; leaf b: one NaN
                ga, gb = np.full(4, 1e3, np.float32), gb.copy()
                gb[1] = np.nan
            else:  # the reference: a push that changes nothing
                ga, gb = np.zeros(4, np.float32), np.zeros(4, np.float32)
        return loss, {"a": ga, "b": gb}

    return loss_and_grad


def test_a_push_with_nan_in_one_leaf_is_refused_by_every_shard(caplog):
    # Regression: each shard judged its own slice, so shard 0 applied leaf a's slice
    # of a push whose leaf b (on shard 1) held a NaN: a torn push.
    job = _two_leaf_job()
    cfg = SimConfig(compute=ShiftedExponential(shift=0.5, rate=2.0))
    runs = {}
    for nan in (True, False):
        bad = []
        with caplog.at_level(logging.WARNING, logger="stalewise.protocol.loop"):
            caplog.clear()
            r = sim.train(
                job.config,
                _two_leaf_loss_and_grad(bad, nan),
                data=_counting,
                workers=3,
                steps=90,
                strategy=job.strategy,
                sim=cfg,
                sim_seed=3,
            )
            refusals = [m for m in caplog.messages if "refused" in m]
        runs[nan] = r, bad, refusals
    r, bad, refusals = runs[True]
    n = len(bad)
    assert n >= 5 and r.pushes == 90
    assert r.stats["rejected"] == {"not_finite": n}  # once per push, not once per shard
    assert r.stats["applied"] == 90 - n
    for shard in r.stats["sim"]["shards"]:
        assert shard == {
            "version": 90 - n,
            "applied": 90 - n,
            "rejected": {"not_finite": n},
            "duplicates": 0,
        }
    # the worker's loop learned of the refusals: the first named with its leaf, then
    # summaries at the 10th, 100th, ... so a long run's log stays legible
    assert "leaf 'b'" in refusals[0]
    assert len(refusals) == 1 + sum(n >= 10**i for i in range(1, 6))
    # A refused push changes nothing: the run ends bit for bit where the run whose
    # poisoned pushes were all zeros (so changed nothing either) ends; had shard 0
    # applied its slices, leaf a would have taken steps of 100.
    ref, ref_bad, ref_refusals = runs[False]
    assert ref_bad == bad and not ref_refusals and ref.stats["applied"] == 90
    assert r.time == ref.time
    assert r.flat.tobytes() == ref.flat.tobytes()
    assert np.all(np.abs(r.params["a"] - TARGET_A) < 1.0)


def test_a_nan_push_is_refused_by_every_shard_in_bsp_rounds():
    job = _two_leaf_job(consistency=sw.BSP())
    bad = []
    r = sim.train(
        job.config,
        _two_leaf_loss_and_grad(bad, nan=True),
        data=_counting,
        workers=3,
        steps=60,
        strategy=job.strategy,
        sim=SimConfig(compute=Fixed(1.0), **FREE),
    )
    assert r.stats["rejected"] == {"not_finite": len(bad)} and len(bad) == 4
    assert r.stats["version"] == 20  # a refused push still counts as its worker's step
    assert [s["applied"] for s in r.stats["sim"]["shards"]] == [60 - 4] * 2
    assert np.all(np.isfinite(r.flat))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("consistency", [sw.ASP(), sw.SSP(1)], ids=str)
def test_failures_at_random_instants_never_tear_a_push(seed, consistency, caplog):
    _train_with_failures(seed, consistency, caplog)


def _train_with_failures(seed, consistency, caplog):
    """Workers 0 and 1 fail 40 times and rejoin; returns the log's committed-push deliveries."""
    # A push takes 0.1 s to leave its worker (shard 0's slice first, then shard 1's),
    # so many failures land between the two shards' handling of a committed push.
    rng = np.random.default_rng(seed)
    times = np.sort(rng.uniform(0.0, 30.0, size=40))
    failures = [
        Failure(int(w), float(t)) for w, t in zip(rng.integers(0, 2, 40), times, strict=True)
    ]
    joins = [Join(f.worker, f.time + float(rng.uniform(0.05, 0.5))) for f in failures]
    cfg = SimConfig(
        compute=ShiftedExponential(shift=0.2, rate=5.0),
        network=Network(latency=0.01, bandwidth=1e7),
        model_bytes=2_000_000,
        failures=failures,
        joins=joins,
    )
    with caplog.at_level(logging.INFO, logger="stalewise"):
        r = _train(
            _cheap_task(),
            workers=3,
            steps=100,
            shards=2,
            consistency=consistency,
            sim=cfg,
            sim_seed=seed,
        )
    shards = r.stats["sim"]["shards"]
    assert shards[0] == shards[1]  # same version, same applied: no torn push
    # every committed push was applied once, by every shard, however its sender died
    assert shards[0]["applied"] == r.pushes == r.stats["applied"]
    if consistency.bound == math.inf:
        assert shards[0]["version"] == r.pushes
    assert shards[0]["rejected"] == {} and shards[0]["duplicates"] == 0
    assert not [m for m in caplog.messages if "disagree" in m]
    failed = [m for m in caplog.messages if " fails at " in m]
    assert len(failed) >= 10
    return [m for m in caplog.messages if "delivered to shard(s)" in m]


def test_failures_while_pushing_deliver_committed_pushes(caplog):
    # the scenario the previous test guards is really exercised: some failures hit a
    # committed push that shard 0 had handled and shard 1 had not (delivered at departure)
    delivered = []
    for seed in range(5):
        caplog.clear()
        delivered += _train_with_failures(seed, sw.ASP(), caplog)
    assert any("delivered to shard(s) [1]" in m for m in delivered)
    assert any("delivered to shard(s) [0, 1]" in m for m in delivered)


def test_a_failure_before_the_commit_pushes_nothing():
    # worker 1 fails while computing (t=0.5 of a 1 s step): its step pushes nothing
    cfg = SimConfig(compute=Fixed(1.0), failures=[Failure(1, 0.5)], **FREE)
    r = _train(_cheap_task(), workers=2, steps=10, shards=2, sim=cfg, on_worker_failure="drop")
    assert r.pushes == 10 and r.stats["applied"] == 10
    assert [s["applied"] for s in r.stats["sim"]["shards"]] == [10, 10]
    assert r.time == 10.0  # worker 0 made all ten pushes


def test_max_staleness_is_judged_once_for_all_shards():
    rule = sw.staleness.inverse(max_staleness=2)
    cfg = SimConfig(compute=ShiftedExponential(0.0, 1.0))
    r = _train(_cheap_task(), workers=8, steps=400, shards=2, staleness=rule, sim=cfg)
    stale = r.stats["rejected"]["too_stale"]
    assert stale > 0 and r.stats["applied"] + stale == 400
    shards = r.stats["sim"]["shards"]
    assert shards[0] == shards[1] and shards[0]["rejected"] == {"too_stale": stale}


def test_merge_stats_takes_per_push_counters_from_shard_0_and_names_torn_shards(caplog):
    from stalewise.runtime.result import merge_stats

    s = {"applied": 5, "rejected": {"not_finite": 2}, "duplicates": 1, "staleness_mean": 1.0,
         "staleness_max": 2, "bytes_in": 10, "bytes_out": 20}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="stalewise.runtime.result"):
        merged = merge_stats([s, s | {"rejected": {"not_finite": 2, "too_stale": 0}}], settled=True)
        assert not caplog.messages  # a zero count is no disagreement
        resent = merge_stats([s, s | {"duplicates": 3}], settled=True)  # a resend to shard 1
        assert not caplog.messages and resent["duplicates"] == 4
        assert merged["rejected"] == {"not_finite": 2} and merged["applied"] == 5
        assert merged["bytes_in"] == 20 and merged["bytes_out"] == 40
        torn = [s, s, s | {"applied": 6, "rejected": {"not_finite": 1}}]
        merge_stats(torn)  # mid-run a push may be half-way: not checked
        assert not caplog.messages
        merge_stats(torn, settled=True)
    assert len(caplog.messages) == 1 and "shard(s) 2 disagree" in caplog.messages[0]


class FourLocalSteps(Strategy):
    """Four minibatch gradients per push, averaged (module level: picklable)."""

    name = "four-local-steps"

    def step(self, state, params, loss_and_grad, batches):
        losses, grads = [], []
        for _ in range(4):
            loss, g = loss_and_grad(params, next(batches))
            losses.append(loss)
            grads.append(g["x"])
        return Step({"x": sum(grads) / 4}, 4, float(np.mean(losses)), state)


def test_a_step_of_four_local_steps_takes_four_step_times():
    assert pickle.loads(pickle.dumps(FourLocalSteps())) == FourLocalSteps()
    task = _cheap_task()
    cfg = SimConfig(compute=Fixed(0.5), **FREE)
    times, compute = {}, {}
    for strategy in (sw.strategies.gradients(), FourLocalSteps()):
        job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1), strategy=strategy)
        r = sim.train(
            job.config,
            task.loss_and_grad,
            data=task.batches,
            workers=2,
            steps=20,
            strategy=job.strategy,
            sim=cfg,
        )
        assert r.pushes == 20
        times[strategy.name], compute[strategy.name] = r.time, r.stats["sim"]["compute_time_mean"]
    assert times == {"gradients": 5.0, "four-local-steps": 20.0}
    assert compute == {"gradients": 0.5, "four-local-steps": 2.0}


def test_local_steps_draw_one_step_time_each():
    cfg = SimConfig(compute=ShiftedExponential(shift=0.1, rate=3.0))
    four = WorkerTiming(cfg, 2, seed=5).finish(1, 0.0, local_steps=4)
    one, t = WorkerTiming(cfg, 2, seed=5), 0.0
    for _ in range(4):
        t = one.finish(1, t)
    assert four == t  # the same draws, in the same order: the same bits
    assert WorkerTiming(cfg, 2, seed=5).finish(1, 0.0, local_steps=4) == four
    assert WorkerTiming(cfg, 2, seed=6).finish(1, 0.0, local_steps=4) != four


class BrokenInit(Strategy):
    name = "broken-init"

    def init(self, params):
        raise KeyError("no state for you")


def test_strategy_errors_become_worker_errors_naming_the_worker():
    task = _cheap_task()
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1), strategy=BrokenInit())
    with pytest.raises(sw.WorkerError, match=r"worker \d failed:(.|\n)*no state for you"):
        sim.train(job.config, task.loss_and_grad, data=task.batches, workers=2, steps=4,
                  strategy=job.strategy)  # fmt: skip


# -- timing models and validation -------------------------------------------------------------


def test_worker_timing_factors_delays_and_transient_slowdowns():
    cfg = SimConfig(
        compute=Fixed(1.0),
        speeds=(1.0, 2.0, 1.0, 1.0),
        stragglers=Stragglers(count=1, slowdown=3.0),
        slowdowns=[Slowdown(worker=0, factor=4.0, start=0.5, end=1.0)],
    )
    t = WorkerTiming(cfg, 4, factors=[1.0, 1.0, 2.0, 1.0], delays=[0.0, 0.0, 0.5, 0.0])
    assert t.finish(1, 0.0) == 0.5  # twice as fast
    assert t.finish(2, 0.0) == 3.0  # (1 + 0.5) * 2
    assert t.finish(3, 0.0) == 3.0  # the persistent straggler
    # worker 0: 0.5 s of work before the slowdown, then 0.5 s of work at 1/4 speed would take 2 s,
    # but the slowdown ends at 1.0 after 0.125 s of work; the remaining 0.375 s run at full speed.
    assert t.finish(0, 0.0) == pytest.approx(1.375)
    assert t.finish(0, 2.0) == 3.0


def test_shifted_exponential_is_seeded_per_worker():
    cfg = SimConfig(compute=ShiftedExponential(shift=1.0, rate=2.0))
    a = [WorkerTiming(cfg, 3, seed=1).finish(w, 0.0) for w in range(3)]
    b = [WorkerTiming(cfg, 3, seed=1).finish(w, 0.0) for w in range(3)]
    c = [WorkerTiming(cfg, 3, seed=2).finish(w, 0.0) for w in range(3)]
    assert a == b != c and min(a) >= 1.0


def test_worker_timing_streams_continue_from_their_saved_states():
    cfg = SimConfig(compute=ShiftedExponential(shift=0.0, rate=1.0))
    a = WorkerTiming(cfg, 2, seed=5)
    a.finish(0, 0.0), a.finish(1, 0.0, local_steps=3)
    b = WorkerTiming(cfg, 2, seed=9)  # another seed: its streams are all replaced
    b.load_rng_states(a.rng_states())
    assert [b.finish(w, 1.0) for w in (0, 1)] == [a.finish(w, 1.0) for w in (0, 1)]
    fixed = WorkerTiming(SimConfig(compute=Fixed(1.0)), 2)
    assert fixed.rng_states() is None
    fixed.load_rng_states(None)  # nothing to restore
    assert fixed.finish(0, 0.0) == 1.0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Network(latency=-1.0), "Network.latency = -1.0"),
        (lambda: Network(bandwidth=0), "Network.bandwidth = 0"),
        (lambda: Service(rate=-5), "Service.rate = -5"),
        (lambda: ShiftedExponential(rate=0.0), "ShiftedExponential.rate = 0.0"),
        (lambda: Fixed(time=math.nan), "Fixed.time = nan"),
        (lambda: Stragglers(count=-1), "Stragglers.count = -1"),
        (lambda: Stragglers(slowdown=0.5), "Stragglers.slowdown = 0.5"),
        (lambda: Slowdown(worker=0, factor=2.0, start=3.0, end=1.0), "Slowdown.end = 1.0"),
        (lambda: Failure(worker=-2, time=1.0), "Failure.worker = -2"),
        (lambda: Join(worker=1, time=-1.0), "Join.time = -1.0"),
        (lambda: SimConfig(speeds=[1.0, 0.0]), r"SimConfig.speeds\[1\] = 0.0"),
        (lambda: SimConfig(model_bytes=1.5), "SimConfig.model_bytes = 1.5"),
        (lambda: SimConfig(network="fast"), "SimConfig.network = 'fast'"),
        (lambda: SimConfig(failures=[(1, 2.0)]), r"SimConfig.failures\[0\] = \(1, 2.0\)"),
        (lambda: SimConfig.from_dict({"rate": -1}), "sim: ShiftedExponential.rate = -1"),
        (lambda: SimConfig.from_dict({"latncy": 0.1}), "sim.latncy: unknown option"),
        (lambda: SimConfig.from_dict({"compute": "gamma"}), "compute = 'gamma'"),
        (lambda: SimConfig.from_dict({"compute": "fixed", "rate": 3}), "shift and rate belong"),
    ],
)
def test_validation_names_the_field_and_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_worker_dependent_fields_are_checked_at_train_time():
    task = _cheap_task()
    with pytest.raises(ValueError, match=r"SimConfig.failures\[0\].worker = 9"):
        _train(task, workers=4, steps=10, sim=SimConfig(failures=[Failure(9, 1.0)]))
    with pytest.raises(ValueError, match=r"SimConfig\.speeds"):
        _train(task, workers=4, steps=10, sim=SimConfig(speeds=(1.0, 2.0)))
    with pytest.raises(ValueError, match="eval_interval"):
        _train(task, workers=4, steps=10, eval_interval=0.0)


def test_sim_config_pickles_and_reads_a_toml_table():
    cfg = SimConfig.from_dict(
        {
            "compute": "exponential",
            "shift": 0.01,
            "rate": 100.0,
            "stragglers": {"count": 2, "slowdown": 3.0},
            "slowdowns": [{"worker": 0, "factor": 2.0, "start": 1.0, "end": 2.0}],
            "failures": [{"worker": 1, "time": 3.0}],
            "joins": [{"worker": 1, "time": 4.0}],
            "latency": 1e-4,
            "shard_bandwidth": 2.5e9,
            "service_time": 0.0,
            "model_bytes": 400_000_000,
        }
    )
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert cfg.compute == ShiftedExponential(0.01, 100.0)
    assert cfg.network.shard_bw == 2.5e9 and cfg.network.worker_bw == 1.25e9
    assert cfg.service.time == 0.0 and cfg.joins == (Join(1, 4.0),)


# -- sweeps --------------------------------------------------------------------------------


def test_sweep_over_workers_and_consistency(tmp_path):
    task = tasks.get("least-squares", n=256, d=8)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1), staleness=sw.staleness.inverse())
    cfg = SimConfig(compute=Fixed(0.01), stragglers=Stragglers(count=1, slowdown=4.0))
    rows = sweep_lib.sweep(
        job,
        task,
        over="consistency",
        values=["asp", "ssp:2", sw.BSP()],
        workers=4,
        steps=2000,
        target=1e-3,
        sim=sw.Simulation(cfg),
        out=tmp_path,
    )
    assert [r["run"] for r in rows] == ["ASP", "SSP(2)", "BSP"]
    t = [r["time_to_target"] for r in rows]
    assert t[0] < t[1] < t[2]
    assert all(r["final"] <= 1e-3 for r in rows)  # each run stopped at its target
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    recs = report.read_metrics(tmp_path / "metrics.jsonl")
    assert {r["run"] for r in recs} == {"ASP", "SSP(2)", "BSP"} and all(
        "workers" in r for r in recs
    )
    print(report.format_table(rows, sweep_lib.COLUMNS))

    rows = sweep_lib.sweep(job, task, over="workers", values=[1, 4], steps=400, target=1e-3)
    assert [r["workers"] for r in rows] == [1, 4] and all(r["time_to_target"] for r in rows)
    with pytest.raises(ValueError, match="over must be"):
        sweep_lib.sweep(job, task, over="shards", values=[1], steps=10, target=1.0)
    with pytest.raises(ValueError, match="'ssp:x'"):
        sweep_lib.sweep(job, task, over="consistency", values=["ssp:x"], steps=10, target=1.0)


def test_a_train_result_prints_as_one_short_line():
    r = _train(_cheap_task(), workers=2, steps=20)
    text = repr(r)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith(f"TrainResult(pushes={r.pushes}, updates=") and "parameters" in text
