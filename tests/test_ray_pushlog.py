"""Push logs on Ray: a ``replicas=2`` run with a checkpoint folder on the shared two-node
cluster (``ray_cluster`` in conftest.py), a primary shard actor SIGKILLed mid-run (Ray
restarts it, from its backup's state, its log chain going on); the first checkpoint and
the logs replay to the final parameters bit for bit. Every run has a ``timeout``."""

import os
import signal
from pathlib import Path

import ray

import stalewise as sw
from stalewise import tasks
from stalewise.checkpoint import replay, store


class KillPrimary:
    """An ``on_record`` callback: SIGKILLs the process of run ``name``'s ``shard-1`` actor
    once the records reach ``pushes``."""

    def __init__(self, name, pushes):
        self.name, self.pushes, self.done = name, pushes, False

    def __call__(self, record):
        if self.done or record["pushes"] < self.pushes:
            return
        prefix = f"stalewise:{self.name}:"
        names = ray.util.list_named_actors()
        (victim,) = [n for n in names if n.startswith(prefix) and n.endswith(":shard-1")]
        os.kill(ray.get(ray.get_actor(victim).ready.remote(), timeout=30)["pid"], signal.SIGKILL)
        self.done = True


def test_a_replay_of_the_logs_equals_the_final_params_after_a_primary_kill(ray_cluster, tmp_path):
    task = tasks.get("least-squares", n=256, d=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05, momentum=0.9), shards=2,
                 replicas=2)  # fmt: skip
    kill = KillPrimary("raylog", 150)
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=2,
        steps=400,
        runtime="ray",
        metrics=sw.Metrics(every=0.05, name="raylog", on_record=kill),
        checkpoints=sw.Checkpoints(tmp_path, every=100, keep=100),
        timeouts=sw.Timeouts(total=90.0),
    )
    assert kill.done and result.pushes >= 400
    assert [e.get("source") for e in result.failures] == ["backup"], result.failures
    first = min(p.name for p in store._complete(Path(tmp_path)))
    flat, ckpt, read = replay.replay(tmp_path, job.config, first)
    assert ckpt.step["pushes"] == 0  # begun before any push: the logs hold the whole run
    final = store.load(tmp_path)
    assert set(final.step["logs"]) <= set(read)  # one chain per shard, unbroken
    assert flat.tobytes() == result.flat.tobytes()
