"""The Ray runtime on real Ray: a local instance, then a two-node cluster on this machine.

The first test lets the runtime start (and stop) a local Ray instance; the rest run on
the cluster the Ray test files share (``ray_cluster`` in conftest.py: ``ray.cluster_utils``,
two raylets of 2 CPUs each), which is shut down whatever happens. Every run has a ``timeout``.
Failures are injected for real: ``ray.kill`` of a worker's or a shard's actor,
found by the names the runtime gives its actors, a worker whose ``loss_and_grad``
sleeps for 1000 s, and corrupt compressed payloads sent to real shard actors.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import mp_helpers
import numpy as np
import pytest
import ray

import stalewise as sw
from stalewise import checkpoint, codecs, tasks
from stalewise.runtime.errors import WorkerError

ACCURACY = 0.95  # held-out accuracy a record of every digits run must reach (it then stops)
FINAL = 0.90  # ... and the final parameters (pushes in flight at the stop still land)
STOP_AT = {"accuracy": ACCURACY}
BUDGET = 2500  # pushes; the runs stop at ACCURACY after about 300-700
TIMEOUT = 120.0  # wall seconds before a run is declared hung


@pytest.mark.slow
def test_a_run_starts_and_stops_its_own_ray_instance_when_none_is_connected(
    monkeypatch, no_ray_driver
):
    """This process is a driver of no cluster: ``ray.init()`` starts a local instance,
    which the run shuts down. One shard: pulls view the object store's copy."""
    assert not ray.is_initialized()
    # Ray's rule for no address: RAY_ADDRESS, else a cluster already running on this
    # machine (another job's), else a new one; "local" makes it the new one here
    monkeypatch.setenv("RAY_ADDRESS", "local")
    task = tasks.get("least-squares", n=256, d=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05))
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=2,
        steps=300,
        runtime="ray",
        timeouts=sw.Timeouts(total=TIMEOUT),
    )
    assert not ray.is_initialized()
    assert result.pushes >= 300 and result.stats["shards"] == 1
    assert task.evaluate(result.params)["loss"] < 1e-3 * task.evaluate(task.init_params(0))["loss"]


def digits_job(consistency, staleness, shards=2):
    task = tasks.get("digits")
    job = sw.Job(
        task.init_params(0),
        optimizer=sw.optim.lamb(0.004, weight_decay=1e-4, exclude_from_weight_decay=["b$"]),
        consistency=consistency,
        staleness=staleness,
        shards=shards,
    )
    return task, job


def least_squares_job(shards=2):
    task = tasks.get("least-squares", n=256, d=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05), shards=shards)
    return task, job


def train(task, job, *, run="run", on_record=None, every=0.1, **kw):
    kw = {"workers": 3, "steps": 600, "timeouts": sw.Timeouts(total=TIMEOUT)} | kw
    return job.train(
        task.loss_and_grad,
        data=task.batches,
        evaluate=task.evaluate,
        runtime="ray",
        metrics=sw.Metrics(every=every, name=run, on_record=on_record),
        **kw,
    )


def no_torn_pushes(caplog):
    """merge_stats(settled=True) warns when shards disagree on the per-push counters."""
    torn = [r.getMessage() for r in caplog.records if "disagree with shard 0" in r.getMessage()]
    assert not torn, torn


class KillAt:
    """An ``on_record`` callback that ``ray.kill``s a named actor of the run once, when the
    records reach ``pushes`` pushes. ``role`` is ``"worker-W."`` or ``"shard-K"``."""

    def __init__(self, run, role, pushes, restart=False):
        self.run, self.role, self.pushes, self.restart = run, role, pushes, restart
        self.killed = None

    def __call__(self, record):
        if self.killed is not None or record["pushes"] < self.pushes:
            return
        names = [
            n
            for n in ray.util.list_named_actors()
            if n.startswith(f"stalewise:{self.run}:") and n.split(":")[-1].startswith(self.role)
        ]
        assert names, (self.role, ray.util.list_named_actors())
        self.killed = max(names)  # the newest incarnation
        ray.kill(ray.get_actor(self.killed), no_restart=not self.restart)


@pytest.mark.slow
@pytest.mark.parametrize(
    "consistency, staleness",
    [
        (sw.ASP(), sw.staleness.constant()),
        (sw.SSP(2), sw.staleness.inverse()),
        (sw.BSP(), sw.staleness.constant()),
        (sw.Hybrid(), sw.staleness.constant()),
    ],
    ids=["asp", "ssp", "bsp", "hybrid"],
)
def test_digits_reaches_the_bar_under_each_consistency_model(
    ray_cluster, consistency, staleness, caplog
):
    task, job = digits_job(consistency, staleness)
    result = train(task, job, steps=BUDGET, stop_at=STOP_AT)
    assert result.stop_reason == "accuracy >= 0.95 reached", result.records[-1]
    assert result.ended == "stop_at"
    assert max(r["accuracy"] for r in result.records) >= ACCURACY
    assert task.evaluate(result.params)["accuracy"] >= FINAL, result.records[-1]
    assert result.records[-1]["pushes"] == result.pushes
    assert result.stats["applied"] >= 1 and result.stats["shards"] == 2
    assert sorted(result.params) == ["layer1", "layer2"]
    assert result.params["layer1"]["w"].dtype == np.float32
    if consistency.kind == "bsp":  # rounds of 3: every push of a round at staleness 0
        assert result.stats["staleness_max"] == 0
        assert result.stats["version"] == result.stats["applied"] // 3
    assert not result.failures
    no_torn_pushes(caplog)


def test_a_bsp_run_ends_at_its_budget(ray_cluster, caplog):
    """A worker whose loop ends leaves the shards, so the others' rounds stop waiting for it."""
    task = tasks.get("least-squares", n=256, d=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05), consistency=sw.BSP(), shards=2)
    result = train(task, job, steps=300)
    assert result.pushes >= 300 and result.stop_reason.startswith("the budget")
    assert result.stats["staleness_max"] == 0 and not result.failures
    no_torn_pushes(caplog)


def test_shards_go_on_separate_nodes_and_a_killed_worker_actor_is_a_new_incarnation(
    ray_cluster, caplog
):
    """Two shards and three workers on the two nodes; worker 1's actor is killed mid-run
    and restarted as its second incarnation."""
    task, job = least_squares_job(shards=2)
    kill = KillAt("kill-worker", "worker-1.", pushes=100)
    result = train(task, job, steps=300, run="kill-worker", on_record=kill)
    nodes = result.stats["ray"]["nodes"]  # each shard's, as started
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(alive) == 2
    assert len(set(nodes)) == 2 and set(nodes) == alive, (nodes, alive)
    cpus = sum(n["Resources"]["CPU"] for n in ray.nodes() if n["Alive"])
    assert 0 < result.stats["ray"]["cpus_per_actor"] <= cpus / 5  # 5 actors on 4 CPUs
    assert kill.killed is not None and kill.killed.endswith("worker-1.1")
    assert [(e.get("worker"), e["action"]) for e in result.failures] == [(1, "restarted")]
    assert result.restarts == 1
    assert result.pushes >= 300 and result.stop_reason.startswith("the budget")
    initial = task.evaluate(task.init_params(0))["loss"]
    assert task.evaluate(result.params)["loss"] < 1e-3 * initial
    no_torn_pushes(caplog)


def test_a_killed_worker_actor_is_dropped_under_the_drop_policy(ray_cluster, caplog):
    task, job = least_squares_job()
    kill = KillAt("drop-worker", "worker-0.", pushes=100)
    result = train(
        task, job, steps=300, run="drop-worker", on_record=kill, failures=sw.Failures("drop")
    )
    assert [(e.get("worker"), e["action"]) for e in result.failures] == [(0, "dropped")]
    assert result.pushes >= 300  # the other two workers spent the budget
    no_torn_pushes(caplog)


@pytest.mark.slow
def test_a_killed_shard_actor_is_restarted_from_the_last_checkpoint(ray_cluster, caplog, tmp_path):
    task, job = least_squares_job()
    kill = KillAt("kill-shard", "shard-1", pushes=150, restart=True)
    result = train(
        task,
        job,
        steps=300,
        run="kill-shard",
        on_record=kill,
        checkpoints=sw.Checkpoints(tmp_path, every=50),
    )
    assert kill.killed is not None
    assert [(e.get("shard"), e["action"]) for e in result.failures] == [(1, "restarted")]
    assert result.pushes >= 300 and result.stop_reason.startswith("the budget")
    initial = task.evaluate(task.init_params(0))["loss"]
    assert task.evaluate(result.params)["loss"] < 1e-3 * initial
    rolled = [re.search(r"rolled back to version (\d+)", r.getMessage()) for r in caplog.records]
    versions = [int(m.group(1)) for m in rolled if m]
    assert len(versions) == 1 and versions[0] >= 50, versions  # a checkpoint, not the start
    no_torn_pushes(caplog)


class KillShardProcess:
    """An ``on_record`` callback that SIGKILLs the process of shard ``k``'s actor (its pid
    from the actor's ``ready()``) once the records reach each of ``at`` pushes in turn,
    each time after Ray has restarted it: the run's restart path takes over."""

    def __init__(self, run, k, at):
        self.run, self.k, self.at = run, k, list(at)
        self.pids: list[int] = []

    def __call__(self, record):
        if len(self.pids) == len(self.at) or record["pushes"] < self.at[len(self.pids)]:
            return
        names = [
            n
            for n in ray.util.list_named_actors()
            if n.startswith(f"stalewise:{self.run}:") and n.endswith(f":shard-{self.k}")
        ]
        assert len(names) == 1, (self.k, ray.util.list_named_actors())
        pid = ray.get(ray.get_actor(names[0]).ready.remote(), timeout=30)["pid"]
        if pid in self.pids:  # not restarted yet: the same process
            return
        os.kill(pid, signal.SIGKILL)
        self.pids.append(pid)


@pytest.mark.parametrize("policy", [pytest.param("restart", marks=pytest.mark.slow), "fail"])
def test_a_killed_shard_process_with_evaluate_restarts_or_fails_with_shard_error(
    ray_cluster, policy
):
    """Every shard call of the driver (the evaluation pull, stats, states for backups,
    the final stats and pull) goes through the restart path: never a private exception.
    The last kill comes with the run's last record, just before the final calls."""
    task, job = least_squares_job()
    run, steps = f"kill-shard-eval-{policy}", 300
    at = [100, steps] if policy == "restart" else [150]  # mid-run, and at the final calls
    kill = KillShardProcess(run, 1, at)
    kw = dict(steps=steps, run=run, on_record=kill, every=0.02)
    if policy == "fail":
        with pytest.raises(sw.ShardError, match=r"^shard 1 failed: its actor died"):
            train(task, job, failures=sw.Failures("fail", max_restarts=len(at)), **kw)
        assert len(kill.pids) == 1
        return
    result = train(task, job, failures=sw.Failures(max_restarts=len(at)), **kw)
    assert len(kill.pids) == len(at), kill.pids
    shards = [(e.get("shard"), e["action"]) for e in result.failures]
    assert shards == [(1, "restarted")] * len(at), result.failures
    assert result.stop_reason.startswith("the budget"), result.stop_reason
    assert result.pushes >= steps, result.pushes  # those a rollback took back made again
    assert all("loss" in r for r in result.records)
    initial = task.evaluate(task.init_params(0))["loss"]
    assert task.evaluate(result.params)["loss"] < 1e-2 * initial


def test_a_push_that_reached_one_shard_is_delivered_to_the_other(ray_cluster):
    """The commit rule when a worker dies mid-send: its last push everywhere, exactly once."""
    from stalewise.runtime.ray.cluster import depart
    from stalewise.runtime.ray.shard import ShardActor

    _, job = least_squares_job(shards=2)
    config = job.config
    shards = [ray.remote(ShardActor).remote(config, k, 2, 0.02) for k in range(2)]
    opened = [
        s.load.remote(None, 0, {0: 1, 1: 1}, [], init=config.init[lo:hi])
        for s, (lo, hi) in zip(shards, config.ranges, strict=True)
    ]
    ray.get(opened, timeout=60)
    ones = ray.put(np.ones(config.spec.size, np.float32))
    both = [s.push.remote(0, 1, 0, (0, 0), (0, 0), 1.0, 0, ones) for s in shards]
    assert all(ack.ok for ack, _ in ray.get(both, timeout=60))
    # push 1 reaches shard 0 only, then the worker "dies"
    ack, _ = ray.get(shards[0].push.remote(0, 1, 1, (1, 1), (0, 0), 1.0, 0, ones), timeout=60)
    assert ack.ok and ack.version == 2
    ray.get(depart(shards, 0, 1), timeout=60)
    # a late copy from the dead incarnation is dropped: its connection is cut
    assert ray.get(shards[1].push.remote(0, 1, 1, (1, 1), (0, 0), 1.0, 0, ones), timeout=60) is None
    stats = ray.get([s.stats.remote() for s in shards], timeout=60)
    assert [s["version"] for s in stats] == [2, 2]
    assert [s["applied"] for s in stats] == [2, 2]
    flat = np.concatenate(
        [ray.get(ray.get(s.observe.remote(), timeout=60)[1], timeout=60) for s in shards]
    )
    np.testing.assert_allclose(flat, config.init - 2 * 0.05, rtol=1e-6)
    # worker 1 pushed nothing before it "died": nothing is delivered, it just leaves
    ray.get(depart(shards, 1, 1), timeout=60)
    assert [s["version"] for s in ray.get([s.stats.remote() for s in shards])] == [2, 2]
    for s in shards:
        ray.kill(s)


@pytest.mark.slow
@pytest.mark.parametrize("codec", [codecs.topk(0.01), codecs.int8()], ids=repr)
def test_compressed_pushes_train_digits_with_two_shards(ray_cluster, codec, caplog):
    """Each push is the codec's payloads, exactly ``nbytes`` per shard; topk keeps error
    feedback in the worker. Both reach the bar; the shards apply the same pushes."""
    task = tasks.get("digits")
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.1), codec=codec, shards=2)
    comp = job.config.compressor()
    assert comp.error_feedback == isinstance(codec, codecs.TopK)
    per_push = comp.nbytes(0) + comp.nbytes(1)
    assert per_push < job.config.spec.nbytes / (30 if isinstance(codec, codecs.TopK) else 3.5)
    initial = task.evaluate(task.init_params(0))["accuracy"]
    result = train(task, job, workers=2, steps=BUDGET, stop_at={"accuracy": 0.9})
    assert result.stop_reason == "accuracy >= 0.9 reached", result.records[-1]
    assert task.evaluate(result.params)["accuracy"] >= 0.85 > initial + 0.5
    assert result.stats["applied"] == result.pushes > 0
    assert result.stats["bytes_in"] == result.pushes * per_push  # the real payloads' bytes
    assert result.stats["ray"]["pull_bytes"] == job.config.spec.nbytes  # full pulls
    assert not result.failures
    no_torn_pushes(caplog)


def test_a_corrupt_compressed_push_is_refused_by_real_shard_actors(ray_cluster):
    """A payload that does not decode is refused by every shard (the protocol decodes it)
    and changes nothing, while an honest worker's pushes are still applied."""
    from stalewise.runtime.ray.shard import ShardActor, payload_spans

    params = {"b": np.zeros(8, np.float32), "w": np.zeros(3000, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(1.0), codec=codecs.topk(0.1), shards=2)
    config, comp = job.config, job.config.compressor()
    spans = payload_spans(config)
    assert spans == [(0, comp.nbytes(0)), (comp.nbytes(0), comp.nbytes(0) + comp.nbytes(1))]
    rng = np.random.default_rng(0)
    shards = [ray.remote(ShardActor).remote(config, k, 2, 0.02) for k in range(2)]
    try:
        opened = [
            s.load.remote(None, 0, {0: 1, 1: 1}, [], init=config.init[lo:hi])
            for s, (lo, hi) in zip(shards, config.ranges, strict=True)
        ]
        ray.get(opened, timeout=60)

        def push(w, seq, buf):
            ref = ray.put(buf)
            acks = [s.push.remote(w, 1, seq, (0, 0), (0, 0), 1.0, 0, ref) for s in shards]
            return [ack for ack, _ in ray.get(acks, timeout=60)]

        def flat():
            replies = ray.get([s.observe.remote() for s in shards], timeout=60)
            return np.concatenate(ray.get([r[1] for r in replies], timeout=60))

        def encoded():
            buf = np.empty(spans[-1][1], np.uint8)
            comp.encode_into(
                rng.standard_normal(3008).astype(np.float32), [buf[a:b] for a, b in spans]
            )
            return buf, comp.decode([buf[a:b] for a, b in spans], np.empty(3008, np.float32))

        buf, values = encoded()
        assert all(ack.ok for ack in push(0, 0, buf))
        expected = -values  # sgd(1.0) from zeros
        np.testing.assert_array_equal(flat(), expected)
        bad = buf.copy()
        bad[spans[0][0]] = bad[spans[1][0]] = 0  # each shard's first magic byte
        for seq, corrupt in enumerate([bad, buf[:-1].copy()]):  # then a truncated one
            acks = push(1, seq, corrupt)
            assert [ack.kind for ack in acks] == ["bad_payload"] * 2, acks
            assert all(f"shard {k}" in ack.reason for k, ack in enumerate(acks)), acks
        np.testing.assert_array_equal(flat(), expected)  # nothing applied
        buf, values = encoded()
        assert all(ack.ok and ack.version == 2 for ack in push(0, 1, buf))  # still served
        np.testing.assert_array_equal(flat(), expected - values)
        stats = ray.get([s.stats.remote() for s in shards], timeout=60)
        assert [s["rejected"] for s in stats] == [{"bad_payload": 2}] * 2
        assert [s["bytes_in"] for s in stats] == [2 * comp.nbytes(k) for k in (0, 1)]
    finally:
        for s in shards:
            ray.kill(s)


# -- error feedback as worker state, delta pulls ------------------------------------------

D, LR = 3000, 0.01
G = np.random.default_rng(7).standard_normal(D)  # a constant gradient (float64)


def feedback_job():
    """Plain SGD from zeros, topk(0.01) pushes with error feedback, 2 shards: every push
    applied moves the params by exactly ``-lr * C(g + e)``, so after any run
    ``params = -lr * (applied * g - sum of the workers' residuals)``."""
    return sw.Job({"x": np.zeros(D)}, optimizer=sw.optim.sgd(LR), codec=codecs.topk(0.01), shards=2)


def train_feedback(d, steps, *, run="run", on_record=None, **checkpoints):
    return feedback_job().train(
        constant_gradient(G),
        data=endless(),
        runtime="ray",
        steps=steps,
        workers=2,
        metrics=sw.Metrics(every=0.1, name=run, on_record=on_record),
        timeouts=sw.Timeouts(total=TIMEOUT),
        checkpoints=sw.Checkpoints(d, **checkpoints),
    )


def assert_nothing_lost(flat, applied, residuals):
    """What was not applied is held in the residuals, to rounding; losing a residual (or
    counting one twice) would be off by at least 1e-4."""
    held = np.sum(residuals, axis=0)
    assert np.count_nonzero(held) > D // 2
    np.testing.assert_allclose(flat, -LR * (applied * G - held), rtol=0, atol=1e-9)
    assert min(np.abs(LR * r).max() for r in residuals) > 1e-4


@pytest.mark.slow
def test_topk_residuals_are_checkpointed_and_a_resume_continues_them(ray_cluster, tmp_path):
    first = train_feedback(tmp_path, 60, every=10)
    assert first.stats["applied"] == first.stats["version"] == first.pushes >= 60
    saved = checkpoint.load(tmp_path)
    assert saved.step["pushes"] == first.pushes and len(saved.residuals) == 2
    assert all(r.dtype == np.float64 and np.count_nonzero(r) > D // 2 for r in saved.residuals)
    assert_nothing_lost(first.flat, first.pushes, saved.residuals)
    mid = [checkpoint.load(p) for p in tmp_path.iterdir() if (p / "manifest.json").exists()]
    mid = [c for c in mid if c.version < first.pushes]
    assert mid  # a mid-run checkpoint is a consistent cut, residuals included
    for c in mid:
        assert_nothing_lost(c.flat(), c.version, c.residuals)
    resumed = train_feedback(tmp_path, 120, resume=True)
    end = checkpoint.load(tmp_path)
    assert resumed.stats["version"] == resumed.pushes >= 120 > first.pushes
    # holds across the resume only if each worker continued with its saved residual
    assert_nothing_lost(resumed.flat, resumed.pushes, end.residuals)
    assert not any(
        np.array_equal(a, b) for a, b in zip(saved.residuals, end.residuals, strict=True)
    )


def test_a_killed_worker_actors_residual_reaches_its_restarted_incarnation(ray_cluster, tmp_path):
    kill = KillAt("fb-kill", "worker-0.", pushes=40)
    r = train_feedback(tmp_path, 150, run="fb-kill", on_record=kill)
    assert kill.killed is not None and r.restarts == 1
    assert [(e.get("worker"), e["action"]) for e in r.failures] == [(0, "restarted")]
    # with the killed incarnation's residual dropped, this is off by lr * that residual
    assert r.stats["applied"] == r.stats["version"] == r.pushes >= 150
    assert_nothing_lost(r.flat, r.pushes, checkpoint.load(tmp_path).residuals)


@pytest.mark.slow
def test_delta_pulls_train_digits_with_two_shards(ray_cluster, caplog):
    """int8 delta pulls (ASP: the standing requests carry deltas): the run learns, and its
    pulls are several times smaller than the full slices."""
    task = tasks.get("digits")
    job = sw.Job(
        task.init_params(0), optimizer=sw.optim.sgd(0.1), pull_codec=codecs.int8(), shards=2
    )
    result = train(task, job, workers=2, steps=400)
    assert result.pushes >= 400 and result.stop_reason.startswith("the budget")
    assert task.evaluate(result.params)["accuracy"] >= 0.9, result.records[-1]
    ray_stats = result.stats["ray"]
    assert min(ray_stats["pulls"]) >= 40, ray_stats  # the first (full) ones weigh little
    assert ray_stats["pull_bytes"] < job.config.spec.nbytes / 3, ray_stats
    assert not result.failures
    no_torn_pushes(caplog)


def test_delta_pulls_under_ssp(ray_cluster):
    """Gated pulls carry deltas too (one request per step and shard)."""
    task = tasks.get("least-squares", n=256, d=2000)
    job = sw.Job(
        task.init_params(0),
        optimizer=sw.optim.sgd(0.01),
        consistency=sw.SSP(2),
        pull_codec=codecs.topk(0.1),
        shards=2,
    )
    result = train(task, job, workers=2, steps=200)
    assert result.pushes >= 200 and result.stop_reason.startswith("the budget")
    initial = task.evaluate(task.init_params(0))["loss"]
    assert task.evaluate(result.params)["loss"] < 1e-3 * initial
    assert result.stats["ray"]["pull_bytes"] < job.config.spec.nbytes / 3


def test_a_corrupt_pull_payload_is_refused_and_the_next_pull_repairs_it(ray_cluster):
    """A real shard actor serves delta pulls; the worker's copy refuses a corrupt one and
    stays as it was, and the pull after it (naming the reference it still holds) is full."""
    from stalewise.protocol import pulls
    from stalewise.runtime.ray.shard import ShardActor

    params = {"b": np.zeros(8, np.float32), "w": np.zeros(5000, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(1.0), pull_codec=codecs.int8(), shards=2)
    config = job.config
    shards = [ray.remote(ShardActor).remote(config, k, 1, 0.02) for k in range(2)]
    try:
        opened = [
            s.load.remote(None, 0, {0: 1}, [], init=config.init[lo:hi])
            for s, (lo, hi) in zip(shards, config.ranges, strict=True)
        ]
        ray.get(opened, timeout=60)
        replica = pulls.Replica.for_job(config)

        def pull(seq):
            replies = ray.get(
                [s.pull.remote(0, 1, seq, replica.have(k)) for k, s in enumerate(shards)],
                timeout=60,
            )
            assert [r[0] for r in replies] == ["ok", "ok"], replies
            return [r[2] for r in replies]

        def flat():
            replies = ray.get([s.observe.remote() for s in shards], timeout=60)
            return np.concatenate(ray.get([r[1] for r in replies], timeout=60))

        for k, payload in enumerate(pull(0)):  # the first pulls are full
            replica.apply(k, payload)
        update = np.random.default_rng(0).standard_normal(config.spec.size).astype(np.float32)
        acks = ray.get(
            [s.push.remote(0, 1, 0, (0, 0), (0, 0), 1.0, 0, ray.put(update)) for s in shards],
            timeout=60,
        )
        assert all(ack.ok for ack, _ in acks)
        deltas = pull(1)
        assert all(0 < len(d) < config.spec.nbytes / 2 / 3 for d in deltas)  # int8: ~4x smaller
        before = replica.params.copy()
        bad = np.array(deltas[1])
        bad[30] ^= 0xFF  # a byte of the first piece's header
        for corrupt in (bad, deltas[1][:-1]):  # then a truncated one
            with pytest.raises(sw.codecs.PayloadError, match="pull from shard 1"):
                replica.apply(1, corrupt)
            np.testing.assert_array_equal(replica.params, before)  # unchanged
        replica.apply(0, deltas[0])
        again = pull(2)  # shard 1 holds a reference this worker lacks: a full pull
        full_1 = config.ranges[1][1] - config.ranges[1][0]
        assert len(again[1]) == 24 + codecs.NONE.nbytes(full_1, np.float32)
        for k, payload in enumerate(again):
            replica.apply(k, payload)
        lo = config.ranges[1][0]
        np.testing.assert_array_equal(replica.params[lo:], flat()[lo:])  # repaired, exactly
        stats = ray.get([s.stats.remote() for s in shards], timeout=60)
        assert [s["pulled"][1] for s in stats] == [3, 3]
    finally:
        for s in shards:
            ray.kill(s)


# Ray workers cannot import this test module: what they run is made in functions,
# so that cloudpickle sends it by value.


def constant_gradient(g):
    """``loss_and_grad``: the constant gradient ``g`` whatever the params."""

    def loss_and_grad(params, batch):
        return 1.0, {"x": g.copy()}

    return loss_and_grad


def endless():
    """``data``: no data, forever."""

    def data(worker, workers):
        return iter(lambda: 0, 1)

    return data


def tagged(batches):
    """``data``: a task's batches, each tagged with the worker that draws it."""

    def data(worker, workers):
        return ((worker, b) for b in batches(worker, workers))

    return data


def indexed(batches):
    """``data``: a task's batches as ``(worker, index, batch)``."""

    def data(worker, workers):
        return ((worker, i, b) for i, b in enumerate(batches(worker, workers)))

    return data


def bad_batch(inner, worker, index, seen=None):
    """``loss_and_grad`` of ``indexed`` batches: ``inner``'s, except that batch ``index`` of
    ``worker`` always raises. With ``seen`` (a file), appends ``"worker index"`` to it."""

    def loss_and_grad(params, batch):
        w, i, b = batch
        if seen is not None:
            with open(seen, "a") as f:
                f.write(f"{w} {i}\n")
        if w == worker and i == index:
            raise ValueError(f"worker {w}'s batch {i} is bad")
        return inner(params, b)

    return loss_and_grad


def hang_once(inner, worker, after, marker, how="sleep"):
    """``loss_and_grad``: the task's, except that worker ``worker`` hangs in its call
    number ``after`` (counted in its actor), once per run: it sleeps 1000 s, or with
    ``how="stop"`` its whole process stops (SIGSTOP: not even its heartbeat thread
    answers). The first to hang writes the wall time into ``marker``, and no call hangs
    once that file exists."""
    calls = [0]

    def loss_and_grad(params, batch):
        w, b = batch
        calls[0] += 1
        if w == worker and calls[0] > after and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(repr(time.time()))
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(1000)
        return inner(params, b)

    return loss_and_grad


def hang_run(tmp_path, policy, how="sleep"):
    """A least-squares run on Ray with worker_timeout=2, whose worker 1 hangs once in its
    ``loss_and_grad``; returns (result or the error, when the hang began, the run's start)."""
    task, job = least_squares_job()
    marker = tmp_path / "hung"
    starts = []  # wall time minus the record's time: no earlier than the run's start

    def on_record(record):
        starts.append(time.time() - record["time"])

    try:
        out = job.train(
            hang_once(task.loss_and_grad, 1, 40, str(marker), how),
            data=tagged(task.batches),
            workers=2,
            steps=400,
            runtime="ray",
            evaluate=task.evaluate,
            timeouts=sw.Timeouts(total=TIMEOUT),
            failures=sw.Failures(policy=policy, worker_timeout=2),
            metrics=sw.Metrics(every=0.1, name=f"hang-{policy}", on_record=on_record),
        )
    except WorkerError as e:
        out = e
    assert marker.exists(), f"worker 1 did not hang: {out!r}"
    return task, out, float(marker.read_text()), min(starts, default=None)


@pytest.mark.parametrize("how", ["sleep", "stop"])
def test_a_hung_worker_is_killed_after_worker_timeout_and_restarted(
    ray_cluster, tmp_path, caplog, how
):
    task, result, hung_at, start = hang_run(tmp_path, "restart", how)
    assert [(e.get("worker"), e["action"]) for e in result.failures] == [(1, "restarted")]
    cause = result.failures[0]["cause"]
    assert "no heartbeat for" in cause and "(worker_timeout=2 s): hung or stopped" in cause
    # found by the heartbeat watch after worker_timeout, long before the run's TIMEOUT
    # (start: an upper bound); how soon after worker_timeout is for benchmarks/, not here
    silent = float(re.search(r"no heartbeat for ([\d.]+) s", cause).group(1))
    assert silent >= 2, cause
    assert result.failures[0]["time"] + start - hung_at < 2 + 30, (result.failures, hung_at)
    assert result.pushes >= 400 and result.stop_reason.startswith("the budget")
    initial = task.evaluate(task.init_params(0))["loss"]
    assert task.evaluate(result.params)["loss"] < 1e-3 * initial
    no_torn_pushes(caplog)


def test_a_hung_worker_fails_the_job_under_the_fail_policy(ray_cluster, tmp_path):
    _, error, _, _ = hang_run(tmp_path, "fail")
    assert isinstance(error, WorkerError), error
    assert str(error).startswith("worker 1 failed: no heartbeat for"), error
    assert "worker_timeout=2 s" in str(error)
    deadline = time.monotonic() + 30  # every actor of the run is killed (ray.kill is async)
    while [n for n in ray.util.list_named_actors() if n.startswith("stalewise:hang-fail:")]:
        assert time.monotonic() < deadline, ray.util.list_named_actors()
        time.sleep(0.2)


def nan_gradients():
    """``loss_and_grad``: NaN, whatever the params."""

    def loss_and_grad(params, batch):
        return float("nan"), {"x": np.full_like(params["x"], np.nan)}

    return loss_and_grad


def test_every_push_refused_ends_the_run_as_diverged_or_says_none_was_applied(ray_cluster):
    task, job = least_squares_job()
    kw = dict(data=task.batches, workers=2, runtime="ray", timeouts=sw.Timeouts(TIMEOUT))
    with pytest.raises(
        sw.DivergedError,
        match=r"^training diverged: worker\(s\) 0, 1 stopped because their pushes kept being "
        r"refused \(worker \d diverged: its last 3 pushes were refused",
    ):
        job.train(
            nan_gradients(),
            steps=10_000,
            failures=sw.Failures(diverge_after=3),
            metrics=sw.Metrics(every=0.1, name="diverge"),
            **kw,
        )
    result = job.train(
        nan_gradients(),
        steps=40,
        failures=sw.Failures(diverge_after=None),
        metrics=sw.Metrics(every=0.1),
        **kw,
    )
    assert result.stats["applied"] == 0 and result.stats["rejected"]["not_finite"] >= 40
    assert result.stop_reason.startswith(
        "the budget of 40 pushes is spent; no push was applied, every one was refused "
    )
    np.testing.assert_array_equal(result.params["x"], task.init_params(0)["x"])


@pytest.mark.slow
def test_checkpoints_and_resume_on_ray(ray_cluster, tmp_path):
    task, job = least_squares_job()
    seen = tmp_path / "seen"
    loss = bad_batch(task.loss_and_grad, -1, -1, str(seen))  # no bad batch: it records them
    kw = dict(data=indexed(task.batches), workers=3, runtime="ray", timeouts=sw.Timeouts(TIMEOUT))
    first = job.train(loss, steps=100, checkpoints=sw.Checkpoints(tmp_path, every=50), **kw)
    assert (tmp_path / "latest").exists()
    drawn = checkpoint.load(tmp_path).step["drawn"]
    before = mp_helpers.read_records(seen)
    assert drawn == [max(before[w]) + 1 for w in range(3)], (drawn, before)
    seen.unlink()
    again = job.train(loss, steps=200, checkpoints=sw.Checkpoints(tmp_path, resume=True), **kw)
    assert again.pushes >= 200  # steps is the job's total budget, pushes before included
    assert again.stats["version"] > first.stats["version"]
    assert sw.load_params(tmp_path)["x"].shape == (16,)
    after = mp_helpers.read_records(seen)
    assert [min(after[w]) for w in range(3)] == drawn  # each stream goes on where it stopped


def test_a_batch_that_always_raises_costs_one_restart_not_the_job(ray_cluster):
    task, job = least_squares_job()
    result = job.train(
        bad_batch(task.loss_and_grad, 1, 30),
        data=indexed(task.batches),
        workers=2,
        steps=300,
        runtime="ray",
        timeouts=sw.Timeouts(total=TIMEOUT),
        failures=sw.Failures(max_restarts=1),
    )
    assert [(e["worker"], e["action"]) for e in result.failures] == [(1, "restarted")]
    assert result.failures[0]["cause"] == "raised ValueError: worker 1's batch 30 is bad"
    assert result.pushes >= 300 and result.stop_reason.startswith("the budget")


def test_cli_trains_on_ray_with_an_address(ray_cluster, tmp_path):
    from stalewise import cli

    toml = tmp_path / "ls.toml"
    toml.write_text(
        textwrap.dedent(
            """
            [task]
            name = "least-squares"
            args = { n = 256, d = 16 }
            [optimizer]
            name = "sgd"
            lr = 0.05
            [server]
            shards = 2
            pull_codec = "int8"
            [run]
            workers = 2
            steps = 300
            runtime = "ray"
            """
        )
    )
    out = tmp_path / "run"
    argv = ["train", str(toml), "--address", ray_cluster.address, "--out", str(out), "-q"]
    assert cli.main(argv) == 0
    assert (out / "metrics.jsonl").stat().st_size > 0


def test_address_needs_the_ray_runtime(tmp_path, capsys):
    from stalewise import cli, config

    toml = tmp_path / "ls.toml"
    toml.write_text('[task]\nname = "least-squares"\n[optimizer]\nname = "sgd"\nlr = 0.1\n')
    argv = ["train", str(toml), "--runtime", "local", "--address", "auto", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stalewise: --address: is for --runtime ray") and "\n" not in err
    raw = {"task": {"name": "least-squares"}, "optimizer": {"name": "sgd", "lr": 0.1}}
    with pytest.raises(config.ConfigError, match=r"run\.address: is for runtime 'ray'"):
        config.parse(raw | {"run": {"address": "auto"}})


def test_stalewise_imports_without_ray():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        import numpy as np
        import stalewise as sw
        from stalewise import runtime
        assert "ray" in runtime.names()
        job = sw.Job({"x": np.zeros(2, np.float32)}, optimizer=sw.optim.sgd(0.1))
        try:
            job.train(lambda p, b: (0.0, p), data=[[None]], workers=1, steps=1, runtime="ray")
        except ImportError as e:
            print(e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "pip install 'stalewise[ray]'" in out
