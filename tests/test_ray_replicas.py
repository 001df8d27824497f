"""Replicated shards on Ray (``replicas=2``): a backup actor per shard on the shared
two-node cluster (``ray_cluster`` in conftest.py); primaries and backups killed for real
with ``ray.kill`` or SIGKILL (Ray restarts them). Every run has a ``timeout``."""

import os
import re
import signal

import pytest
import ray

import stalewise as sw
from stalewise import codecs, tasks

TIMEOUT = 90.0  # wall seconds before a run is declared hung


def run(name, steps, on_record=None, consistency=None, pull_codec=None):
    task = tasks.get("least-squares", n=256, d=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05), shards=2, replicas=2,
                 consistency=consistency or sw.ASP(), pull_codec=pull_codec)  # fmt: skip
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=2,
        steps=steps,
        runtime="ray",
        metrics=sw.Metrics(every=0.05, name=name, on_record=on_record),
        timeouts=sw.Timeouts(total=TIMEOUT),
    )
    return task, result


class Kill:
    """An ``on_record`` callback that ``ray.kill``s (or, ``sigkill``, SIGKILLs the process
    of) the run's actors named in ``role`` (``shard-K`` or ``backup-K``, space-separated)
    once the records reach ``pushes``; Ray restarts them. Notes each shard's and backup's
    node first."""

    def __init__(self, run, role, pushes, sigkill=False):
        self.run, self.roles, self.pushes, self.sigkill = run, role.split(), pushes, sigkill
        self.nodes: dict[str, str] = {}
        self.pids: dict[str, int] = {}

    def __call__(self, record):
        if self.nodes or record["pushes"] < self.pushes:
            return
        prefix = f"stalewise:{self.run}:"
        names = [n for n in ray.util.list_named_actors() if n.startswith(prefix)]
        for n in names:
            if re.search(r":(shard|backup)-\d$", n):
                got = ray.get(ray.get_actor(n).ready.remote(), timeout=30)
                self.nodes[n.split(":")[-1]] = got["node"]
                self.pids[n.split(":")[-1]] = got["pid"]
        for role in self.roles:
            (victim,) = [n for n in names if n.endswith(f":{role}")]
            if self.sigkill:  # both nodes run on this machine
                os.kill(self.pids[role], signal.SIGKILL)
            else:
                ray.kill(ray.get_actor(victim), no_restart=False)


def exact(result, caplog):
    """No rollback, no worker restarted, every shard applied each acknowledged push once,
    and each backup ends equal to its primary (with delta pulls: bytes out included)."""
    info = result.stats["ray"]
    assert not [r for r in caplog.records if "rolled back" in r.getMessage()]
    assert not [r for r in caplog.records if "disagree" in r.getMessage()]  # duplicates
    assert all(e.get("shard") is not None for e in result.failures), result.failures
    assert info["applied"] == [result.pushes] * 2 == [info["acked"]] * 2, info
    assert info["backups"] == ["equal", "equal"]


def test_backups_follow_their_primaries_bit_for_bit(ray_cluster, caplog):
    task, result = run("rep", 200)
    assert result.failures == [] and result.pushes >= 200
    exact(result, caplog)
    assert task.evaluate(result.params)["loss"] < 1e-2 * task.evaluate(task.init_params(0))["loss"]


@pytest.mark.parametrize(
    "k, consistency, codec",
    [(0, sw.ASP(), None), (1, sw.BSP(), None), (1, sw.ASP(), codecs.int8())],
    ids=["asp", "bsp", "asp-int8-pulls-sigkill"],
)
def test_a_killed_primary_comes_back_from_its_backup(ray_cluster, caplog, k, consistency, codec):
    name = f"rep-kill-{k}" + ("-int8" if codec else "")
    kill = Kill(name, f"shard-{k}", pushes=80, sigkill=codec is not None)
    with pytest.warns(
        sw.FailureWarning,
        match=f"shard {k} .* 0 updates .* lost \\(from its backup\\), .* carried on",
    ):
        _, result = run(kill.run, 400, kill, consistency, codec)
    assert kill.nodes, "the kill did not happen"
    for j in range(2):  # two nodes: a backup is not on its primary's
        assert kill.nodes[f"backup-{j}"] != kill.nodes[f"shard-{j}"], kill.nodes
    assert [(e["shard"], e["action"], e.get("source"), e["lost"]) for e in result.failures] == [
        (k, "restarted", "backup", 0)
    ]
    assert result.pushes >= 400
    exact(result, caplog)


def test_a_killed_backup_is_replaced_and_caught_up(ray_cluster, caplog):
    kill = Kill("rep-backup", "backup-1", pushes=80)
    _, result = run(kill.run, 400, kill)
    assert kill.nodes, "the kill did not happen"
    assert result.failures == [] and result.stats["ray"]["backups_replaced"] == [0, 1]
    exact(result, caplog)


def test_a_primary_and_its_backup_killed_together_roll_back(ray_cluster, caplog):
    """Both copies of shard 1 gone: the driver's rollback, as without replicas; the new
    backups catch up from the restored primaries."""
    kill = Kill("rep-both", "shard-1 backup-1", pushes=60)
    _, result = run(kill.run, 200, kill)
    assert kill.nodes, "the kill did not happen"
    assert [(e["shard"], e.get("source")) for e in result.failures] == [(1, None)]
    assert [r for r in caplog.records if "rolled back" in r.getMessage()]
    assert result.pushes >= 200 and result.stats["ray"]["backups"] == ["equal", "equal"]
