"""The Ray runtime on real Ray: a local instance, then a two-node cluster on this machine.

The first test lets the runtime start (and stop) a local Ray instance; then one
cluster (``ray.cluster_utils``: two raylets, 2 + 1 CPUs) serves the rest of the
module, and the fixture's finalizer shuts it down whatever happens. Every run has a ``timeout``.
Failures are injected for real: ``ray.kill`` of a worker's or a shard's actor,
found by the names the runtime gives its actors.
"""

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import ray

import stalewise as sw
from stalewise import tasks

# Ray starts its processes by fork + exec from this (JAX-importing) test process;
# JAX's at-fork hook warns about a deadlock that cannot happen before the exec.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

ACCURACY = 0.95  # held-out accuracy a record of every digits run must reach (it then stops)
FINAL = 0.90  # ... and the final parameters (pushes in flight at the stop still land)
STOP_AT = {"accuracy": ACCURACY}
BUDGET = 2500  # pushes; the runs stop at ACCURACY after about 300-700
TIMEOUT = 120.0  # wall seconds before a run is declared hung


def test_a_run_starts_and_stops_its_own_ray_instance_when_none_is_connected(monkeypatch):
    """Runs first, before the module's cluster exists: ``ray.init()`` starts a local
    instance, which the run shuts down. One shard: pulls view the object store's copy."""
    assert not ray.is_initialized()
    # Ray's rule for no address: RAY_ADDRESS, else a cluster already running on this
    # machine (another job's), else a new one; "local" makes it the new one here
    monkeypatch.setenv("RAY_ADDRESS", "local")
    task = tasks.get("least-squares", n=256, d=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05))
    result = job.train(
        task.loss_and_grad, data=task.batches, workers=2, steps=300, runtime="ray", timeout=TIMEOUT
    )
    assert not ray.is_initialized()
    assert result.pushes >= 300 and result.stats["shards"] == 1
    assert task.evaluate(result.params)["loss"] < 1e-3 * task.evaluate(task.init_params(0))["loss"]


@pytest.fixture(scope="module")
def cluster():
    """A head node (2 CPUs) and a second node (1 CPU); the driver connects to it."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": 150 * 2**20},
    )
    try:
        nodes.add_node(num_cpus=1, object_store_memory=100 * 2**20)
        nodes.wait_for_nodes(timeout=60)
        ray.init(address=nodes.address, include_dashboard=False, logging_level="warning")
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


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


def train(task, job, **kw):
    kw = {"workers": 3, "steps": 600, "eval_interval": 0.1, "timeout": TIMEOUT} | kw
    return job.train(
        task.loss_and_grad, data=task.batches, evaluate=task.evaluate, runtime="ray", **kw
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
    cluster, consistency, staleness, caplog
):
    task, job = digits_job(consistency, staleness)
    result = train(task, job, steps=BUDGET, stop_at=STOP_AT)
    assert result.stop_reason == "accuracy >= 0.95 reached", result.records[-1]
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


def test_shards_go_on_separate_nodes(cluster):
    task, job = least_squares_job(shards=2)
    result = train(task, job, steps=200)
    nodes = result.stats["ray"]["nodes"]
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(alive) == 2
    assert len(set(nodes)) == 2 and set(nodes) == alive, (nodes, alive)
    assert 0 < result.stats["ray"]["cpus_per_actor"] <= 3 / 5  # 5 actors, 3 CPUs
    assert task.evaluate(result.params)["loss"] < task.evaluate(task.init_params(0))["loss"]


def test_a_bsp_run_ends_at_its_budget(cluster, caplog):
    """A worker whose loop ends leaves the shards, so the others' rounds stop waiting for it."""
    task = tasks.get("least-squares", n=256, d=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05), consistency=sw.BSP(), shards=2)
    result = train(task, job, steps=300)
    assert result.pushes >= 300 and result.stop_reason.startswith("the budget")
    assert result.stats["staleness_max"] == 0 and not result.failures
    no_torn_pushes(caplog)


def test_a_killed_worker_actor_is_restarted_as_a_new_incarnation(cluster, caplog):
    task, job = least_squares_job()
    kill = KillAt("kill-worker", "worker-1.", pushes=150)
    result = train(task, job, steps=900, run="kill-worker", on_record=kill)
    assert kill.killed is not None and kill.killed.endswith("worker-1.1")
    assert [(e.get("worker"), e["action"]) for e in result.failures] == [(1, "restarted")]
    assert result.restarts == 1
    assert result.pushes >= 900 and result.stop_reason.startswith("the budget")
    initial = task.evaluate(task.init_params(0))["loss"]
    assert task.evaluate(result.params)["loss"] < 1e-3 * initial
    no_torn_pushes(caplog)


def test_a_killed_worker_actor_is_dropped_under_the_drop_policy(cluster, caplog):
    task, job = least_squares_job()
    kill = KillAt("drop-worker", "worker-0.", pushes=100)
    result = train(
        task, job, steps=500, run="drop-worker", on_record=kill, on_worker_failure="drop"
    )
    assert [(e.get("worker"), e["action"]) for e in result.failures] == [(0, "dropped")]
    assert result.pushes >= 500  # the other two workers spent the budget
    no_torn_pushes(caplog)


def test_a_killed_shard_actor_is_restarted_from_the_last_checkpoint(cluster, caplog, tmp_path):
    task, job = least_squares_job()
    kill = KillAt("kill-shard", "shard-1", pushes=200, restart=True)
    result = train(
        task,
        job,
        steps=900,
        run="kill-shard",
        on_record=kill,
        checkpoint_dir=tmp_path,
        checkpoint_every=50,
    )
    assert kill.killed is not None
    assert [(e.get("shard"), e["action"]) for e in result.failures] == [(1, "restarted")]
    assert result.pushes >= 900 and result.stop_reason.startswith("the budget")
    initial = task.evaluate(task.init_params(0))["loss"]
    assert task.evaluate(result.params)["loss"] < 1e-3 * initial
    rolled = [re.search(r"rolled back to version (\d+)", r.getMessage()) for r in caplog.records]
    versions = [int(m.group(1)) for m in rolled if m]
    assert len(versions) == 1 and versions[0] >= 50, versions  # a checkpoint, not the start
    no_torn_pushes(caplog)


def test_a_push_that_reached_one_shard_is_delivered_to_the_other(cluster):
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


def test_checkpoints_and_resume_on_ray(cluster, tmp_path):
    task, job = least_squares_job()
    first = train(task, job, steps=300, checkpoint_dir=tmp_path, checkpoint_every=50)
    assert (tmp_path / "latest").exists()
    again = train(task, job, steps=600, checkpoint_dir=tmp_path, resume=True)
    assert again.pushes >= 600  # steps is the job's total budget, pushes before included
    assert again.stats["version"] > first.stats["version"]
    assert sw.load(tmp_path)["x"].shape == (16,)


def test_cli_trains_on_ray_with_an_address(cluster, tmp_path):
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
            [run]
            workers = 2
            steps = 300
            runtime = "ray"
            """
        )
    )
    out = tmp_path / "run"
    argv = ["train", str(toml), "--address", cluster.address, "--out", str(out), "-q"]
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
