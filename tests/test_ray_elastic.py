"""Elastic ``Job.train`` on Ray: ``workers="auto"`` follows the cluster's CPUs.

A real ``ray.cluster_utils`` cluster on this machine: a head node of 2 CPUs (one
for the shard, one for a worker). Mid-run a second node of 2 CPUs joins, and the
run starts a worker on each free CPU; then that node is removed, its workers die
with it and leave the job (no restart counted), and the run still spends its
budget and converges. The module's tests share the head (a fixture that shuts it down
whatever happens); every wait is bounded.
"""

import functools
import threading
import time

import mp_helpers
import pytest
import ray

import stalewise as sw
from stalewise import tasks
from stalewise.runtime.options import OptionError

TIMEOUT = 90.0  # wall seconds before the run is declared hung
WAIT = 45.0  # wall seconds any one step of the scenario may take


@pytest.fixture(scope="module")
def head():
    """A head node of 2 CPUs for the module's tests; this process is its driver. Shut down
    even on failure."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": 100 * 2**20,
            # a removed node is noticed within about a second
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 2},
        },
    )
    # the workers cannot import the tests' helpers: their functions travel by value
    ray.cloudpickle.register_pickle_by_value(mp_helpers)
    try:
        nodes.wait_for_nodes(timeout=60)
        ray.init(address=nodes.address, include_dashboard=False, logging_level="warning")
        yield nodes
    finally:
        ray.cloudpickle.unregister_pickle_by_value(mp_helpers)
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture
def cluster(head):
    """The head alone, its CPUs free (the actors of a test before die asynchronously); a
    node a test added and did not remove is removed after it."""
    import ray_helpers

    _until(lambda: sum(n["Alive"] for n in ray.nodes()) == 1, "the head alone")
    ray_helpers.wait_idle(head)
    try:
        yield head
    finally:
        for node in list(head.worker_nodes):
            head.remove_node(node)


def _until(check, what, timeout=WAIT, seen=None):
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(f"{what} did not happen within {timeout} s"
                               + ("" if seen is None else f"; seen: {seen()}"))  # fmt: skip
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("consistency", "steps"), [(sw.ASP(), 800), (sw.BSP(), 400)], ids=["asp", "bsp"]
)
def test_auto_workers_follow_a_node_that_joins_and_leaves(cluster, consistency, steps):
    """Under BSP the rounds go over the live workers: 3 while the node is there, then 1
    (a departure mid-round must not stall them), and the budget is whole rounds of the
    one worker expected (``workers=(1, 4)``, ``"auto"`` with room for 4: min 1), so the
    run makes at least ``steps`` pushes."""
    task = tasks.get("least-squares", n=512, d=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05), consistency=consistency)
    start_loss = task.evaluate(task.init_params(0))["loss"]
    records: list[dict] = []
    seen: dict = {}
    out: dict = {}

    def train():  # in its own thread: Ray adds and removes nodes from the main thread only
        try:
            out["result"] = job.train(
                functools.partial(mp_helpers.slowed, task.loss_and_grad, 0.02),
                data=task.batches,
                workers=(1, 4),  # each worker id's data: a quarter of the rows
                steps=steps,
                runtime="ray",
                evaluate=task.evaluate,
                metrics=sw.Metrics(every=0.2, on_record=records.append),
                # the set-up too: a worker or a shard stuck at its start fails within WAIT
                timeouts=sw.Timeouts(total=TIMEOUT, start=WAIT, shard_start=WAIT),
            )
        except BaseException as e:  # reported by the test
            out["error"] = e

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    until = functools.partial(  # a failure says how far the run got
        _until, seen=lambda: out.get("error") or (records[-1] if records else "no record yet")
    )
    try:
        until(lambda: records and records[-1]["pushes"] >= 20, "the first pushes")
        seen["before"] = records[-1]["workers"]
        node = cluster.add_node(num_cpus=2, object_store_memory=100 * 2**20)
        cluster.wait_for_nodes(timeout=WAIT)
        until(lambda: records[-1]["workers"] >= 3, "the run's growth to 3 workers")
        seen["grown"] = records[-1]["workers"]
        seen["pushes_grown"] = grown = records[-1]["pushes"]
        # the three train together (a joiner joins the shards once it has set up)
        until(lambda: records[-1]["pushes"] >= grown + 30, "pushes with 3 workers")
        cluster.remove_node(node)
        until(lambda: records[-1]["workers"] <= 1, "the departure of the node's workers")
        seen["after"] = records[-1]["workers"]
    finally:
        trainer.join(timeout=TIMEOUT)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert seen["before"] == 1  # the head's 2 CPUs: the shard and one worker
    assert seen["grown"] >= 3  # one worker per CPU of the new node
    assert seen["after"] == 1
    assert seen["pushes_grown"] < result.pushes  # the run went on after the node left
    assert result.pushes >= steps and "budget" in result.stop_reason
    assert task.evaluate(result.params)["loss"] < 1e-3 * start_loss
    left = [e for e in result.failures if e["action"] == "left"]
    assert len(left) == 2 and not [e for e in result.failures if e["action"] != "left"]
    assert sorted(e["worker"] for e in left) == sorted(result.stats["ray"]["workers"]["left"])
    assert result.stats["ray"]["workers"]["peak"] >= 3 and result.restarts == 0
    if consistency.kind == "bsp":  # one update per round, of 1 to 3 pushes (3: some)
        assert steps <= result.stats["version"] < result.pushes


@pytest.mark.parametrize("workers", [0, (0, 2), (3, 2), (1, 2, 3), "all", 2.5, (1, True)], ids=repr)
def test_a_bad_workers_value_is_refused_naming_it(workers):
    job = sw.Job(tasks.get("least-squares", n=64, d=4).init_params(0), optimizer=sw.optim.sgd(0.1))
    with pytest.raises(OptionError, match=r"^workers must be .*got ") as caught:
        job.train(mp_helpers.quadratic_loss_and_grad, data=mp_helpers.quadratic_data,
                  workers=workers, steps=10, runtime="ray")  # fmt: skip
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("runtime", ["local", "sim"])
@pytest.mark.parametrize("workers", [(1, 3), "auto"], ids=repr)
def test_elastic_workers_are_refused_where_job_train_cannot_follow_them(runtime, workers):
    job = sw.Job(tasks.get("least-squares", n=64, d=4).init_params(0), optimizer=sw.optim.sgd(0.1))
    with pytest.raises(OptionError, match=r"^workers .*runtime 'ray' only, not") as caught:
        job.train(mp_helpers.quadratic_loss_and_grad, data=mp_helpers.quadratic_data,
                  workers=workers, steps=10, runtime=runtime)  # fmt: skip
    assert "\n" not in str(caught.value)


def test_the_elastic_options_read_as_room_and_expected_workers():
    def options(workers, **more):
        return sw.RunOptions(loss_and_grad=mp_helpers.quadratic_loss_and_grad,
                             data=mp_helpers.quadratic_data, workers=workers, steps=10, **more)  # fmt: skip

    opts = options([2, 5])
    assert (opts.workers, opts.room, opts.expected, opts.elastic) == ((2, 5), 5, 2, True)
    again = opts.for_workers()  # a copy (as the worker actors get it) keeps them
    assert (again.workers, again.room, again.expected, again.elastic) == ((2, 5), 5, 2, True)
    auto = options("auto")
    assert (auto.room, auto.expected, auto.elastic) == (16, 1, True)
    assert (options(3).room, options(3).expected, options(3).elastic) == (3, 3, False)
    assert not options((3, 3)).elastic
    # a sequence of batches per worker id: one for each of the room's ids
    with pytest.raises(ValueError, match="data has 2 per-worker shards for 4 workers"):
        sw.RunOptions(loss_and_grad=mp_helpers.quadratic_loss_and_grad, data=[[1], [2]],
                      workers=(1, 4), steps=10)  # fmt: skip


def test_each_actor_gets_the_largest_cpu_share_the_nodes_hold():
    from stalewise.runtime.ray.cluster import cpu_share

    assert cpu_share([8.0, 8.0], 10) == 1.0  # a CPU each
    assert cpu_share([2.0, 1.0], 5) == 0.5  # 4 + 2 halves hold 5
    assert cpu_share([2.0], 6) == 0.333  # to 1/1000, rounded down: 6 thirds fit
    with pytest.raises(RuntimeError, match="cannot be shared by 3 actors"):
        cpu_share([0.0], 3)
