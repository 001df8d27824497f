"""Replicated shards on Ray (``replicas=2``): a backup actor per shard on the shared
two-node cluster (``ray_cluster`` in conftest.py); primaries and backups killed for real
with ``ray.kill`` or SIGKILL (Ray restarts them). Every run has a ``timeout``."""

import os
import re
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray

import stalewise as sw
from stalewise import codecs, tasks
from stalewise.protocol import delivery, replica

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


# -- a failover, actor by actor: shard 0's primary and backup, driven as the driver does --


def one_shard():
    """Shard 0 of a two-shard replicas=2 job (one worker, incarnation 1) and its backup, real
    actors (the primary restartable), and a driver that knows only them."""
    from stalewise.runtime.ray.shard import BackupActor, ShardActor
    from stalewise.runtime.ray.train import _Host

    task = tasks.get("least-squares", n=256, d=16)
    config = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05), shards=2, replicas=2).config
    shard = ray.remote(ShardActor).options(max_restarts=1).remote(config, 0, 1, 0.02)
    backup = ray.remote(BackupActor).remote(config, 0, 1, None)
    lo, hi = config.ranges[0]
    ray.get(shard.load.remote(None, 0, {0: 1}, [], config.init[lo:hi], backup=backup), timeout=60)
    host = _Host.__new__(_Host)
    host.ray, host.shards, host.backups, host.watches, host.logs = ray, [shard], [backup], {}, [""]
    host.o = SimpleNamespace(ack_timeout=60.0, shard_start_timeout=60.0)
    host.stopping, host.tick = False, []
    host.run = SimpleNamespace(failures=SimpleNamespace(shard_restarted=lambda *a, **k: None))
    return config, shard, backup, host


def push(config, shard, seq, update):
    ack, _ = ray.get(shard.push.remote(0, 1, seq, (seq, seq), (0, 0), 1.0, 0, update), timeout=60)
    assert ack.ok and not ack.duplicate


def restart(host, shard):
    """The primary's process dies; Ray restarts it (empty); the driver sees its stats first."""
    watch = shard.watch.remote()
    host.tick = [ray.get(shard.stats.remote(), timeout=60)]
    ray.kill(shard, no_restart=False)
    with pytest.raises(ray.exceptions.RayActorError):  # as the driver: once its watch ended
        ray.get(watch, timeout=60)
    host._ready(shard, "shard 0")


def test_a_failover_keeps_the_ledger_and_serves_in_a_newer_view(ray_cluster):
    """Pushes 0 and 1 reached shard 0 only (the worker may die before shard 1): after shard
    0's primary died, its successor still hands them over, and its backup follows a view no
    earlier primary used."""
    config, shard, backup, host = one_shard()
    update = np.arange(config.spec.size, dtype=np.float32)
    try:
        for seq in range(2):
            push(config, shard, seq, ray.put(update))
        followed = ray.get(backup.view.remote(), timeout=60)
        restart(host, shard)
        assert host._fail_over({"shard": 0})
        got = ray.get(shard.committed.remote(0, 1, 0, 2), timeout=60)
        assert got is not None and [seq for seq, *_ in got] == [0, 1]
        assert all(np.array_equal(u, update) and b == (s, s) for s, b, _, u in got)
        assert ray.get(backup.view.remote(), timeout=60) > followed
        push(config, shard, 2, ray.put(update))  # it serves on, its backup in step
        assert ray.get(shard.digest.remote()) == ray.get(backup.digest.remote())
    finally:
        for a in (shard, backup):
            ray.kill(a, no_restart=True)


def test_a_failover_refuses_a_backup_that_lacks_what_was_let_out(ray_cluster, caplog):
    """The primary moved on to another backup (a newer view) and acknowledged a push there:
    the backup left behind is not taken; the driver rolls back instead, saying why."""
    from stalewise.runtime.ray.shard import BackupActor

    config, shard, old, host = one_shard()
    new = ray.remote(BackupActor).remote(config, 0, 1, None)
    update = ray.put(np.ones(config.spec.size, np.float32))
    try:
        push(config, shard, 0, update)
        ray.get(shard.attach.remote(new), timeout=60)
        push(config, shard, 1, update)  # held by the new backup only
        restart(host, shard)
        assert not host._fail_over({"shard": 0})
        assert [r for r in caplog.records if "its backup is stale" in r.getMessage()]
        assert ray.get(shard.ready.remote(), timeout=60)["version"] == 0  # nothing loaded
    finally:
        for a in (shard, old, new):
            ray.kill(a, no_restart=True)


def gone(pid):
    """Whether process ``pid`` (on this machine) has exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_a_primary_serves_alone_only_once_the_backup_it_gave_up_on_is_gone(ray_cluster):
    """A backup that refuses a forward (here: told it holds one entry fewer, so the next one
    leaves a gap) is given up on; the push's ack leaves only once Ray says that backup died
    or a new, empty incarnation of it answers, so a failover right after cannot take its
    copy, which lacks the push yet passes the driver's last look. Six rounds, a new backup
    attached for each."""
    from stalewise.runtime.ray.shard import BackupActor

    config, shard, backup, _ = one_shard()
    update, backups = ray.put(np.ones(config.spec.size, np.float32)), [backup]
    try:
        for r in range(6):
            if r:
                backups.append(ray.remote(BackupActor).remote(config, 0, 1, None))
                ray.get(shard.attach.remote(backups[-1]), timeout=60)
            push(config, shard, 2 * r, update)
            got = ray.get(backups[-1].state.remote(), timeout=60)
            start = replica.CatchUp(got["view"], got["entries"] - 1, got["state"])
            rest = [got[n] for n in ("handled", "seats", "held", "kept")]
            ray.get(backups[-1].start.remote(start, *rest), timeout=60)
            seen = ray.get(shard.stats.remote(), timeout=60)["exposed"]
            assert replica.stale(seen, got["view"], got["state"]["version"], got["handled"]) is None
            pid = ray.get(backups[-1].ready.remote(), timeout=60)["pid"]
            push(config, shard, 2 * r + 1, update)  # acknowledged alone
            try:  # what a failover would take now: a new, empty incarnation, or nothing
                left = ray.get(backups[-1].state.remote(), timeout=60)
            except ray.exceptions.ActorDiedError:
                left = None
            assert left is None, f"round {r}: the backup given up on holds a copy after the ack"
            ends = time.monotonic() + 10  # its process, told dead, may still be exiting
            while not gone(pid) and time.monotonic() < ends:
                time.sleep(0.05)
            assert gone(pid), f"round {r}: backup process {pid} outlived its death by 10 s"
        with pytest.raises(ray.exceptions.ActorDiedError):
            ray.get(backups[-1].state.remote(), timeout=60)
        assert ray.get(shard.stats.remote(), timeout=60)["exposed"][1] is False
    finally:
        for a in (shard, *backups):
            ray.kill(a, no_restart=True)


def test_a_worker_failure_met_while_a_primary_restarts_is_settled_after_its_failover(ray_cluster):
    """Worker 0's incarnation 1 fails while shard 0's primary is dead: a call reaching the
    restarted actor waits for its state (never acts on a blank shard); the driver, seeing the
    shard down at once, makes the commit rule, incarnation 2's join and its start once it
    failed over, so incarnation 2 is admitted there."""
    from stalewise.runtime.ray.train import _ShardDown

    config, shard, backup, host = one_shard()
    update = ray.put(np.ones(config.spec.size, np.float32))
    host.incs, host.ef, host.unsettled, host.live, started = [1], False, {}, {0}, []
    host._respawn = started.append
    try:
        for seq in range(2):
            push(config, shard, seq, update)
        host.watches = {shard.watch.remote(): 0}
        restart(host, shard)
        early = shard.cut.remote(0, 1)
        assert not ray.wait([early], timeout=1.0)[0]  # it waits for the state
        t = time.monotonic()
        host._depart(0)  # as _worker_failed does, then the failure policy: a restart
        host.incs[0] = 2
        with pytest.raises(_ShardDown):
            host._settle()
        assert time.monotonic() - t < host.o.ack_timeout / 4
        assert host.unsettled == {0: 1} and started == []
        host.watches = {shard.watch.remote(): 0}  # the driver watches the restarted actor
        assert host._fail_over({"shard": 0})
        assert ray.get(early, timeout=60) == 2  # on the state loaded
        host._settle()
        assert host.unsettled == {} and started == [0]
        ack, _ = ray.get(shard.push.remote(0, 2, 0, (0, 0), (0, 0), 1.0, 0, update), timeout=60)
        assert ack.ok
    finally:
        for a in (shard, backup):
            ray.kill(a, no_restart=True)


# -- the rules, pure --


def test_a_backups_ledger_replays_its_primarys_changes():
    primary = delivery.Ledger()
    primary.keep(0, 1, 0, acked=0, entry="a")
    backup = delivery.Ledger(primary.kept)  # a new backup's start
    primary.changes = []
    primary.keep(0, 1, 1, acked=0, entry="b")
    primary.keep(1, 1, 0, acked=0, entry="c")
    primary.keep(0, 1, 2, acked=1, entry="d")  # push 0 is everywhere: forgotten
    primary.forget(1)
    backup.replay(primary.changes)
    assert backup.kept == primary.kept == {0: {1: (1, "b"), 2: (1, "d")}}
    assert backup.between(0, 1, 1, 3) == ["b", "d"] and backup.between(1, 1, 0, 1) is None


def test_a_new_view_is_newer_than_the_one_the_backup_followed():
    from stalewise import optim, segments
    from stalewise.protocol import Shard

    primary = replica.Primary(Shard(np.zeros(2, np.float32), segments.Segments.single(2),
                                    optim.sgd(1.0), workers=1))  # fmt: skip
    assert primary.attach(after=-1).view == 1  # a backup that followed none
    assert primary.attach(after=5).view == 6  # a dead primary's view 5: never again


@pytest.mark.parametrize(
    "seen, backup, why",
    [
        (None, (1, 0, 0), None),  # nothing seen let out
        ((1, True, 5, 4), (1, 5, 4), None),
        ((1, True, 5, 4), (2, 0, 0), None),  # caught up after the look
        ((1, True, 5, 4), (1, 4, 4), "at version 4 after 4 pushes; .* version 5 after 4"),
        ((1, True, 5, 4), (1, 5, 3), "after 3 pushes"),
        ((2, True, 5, 4), (1, 9, 9), "follows view 1; its primary served view 2$"),
        ((1, False, 5, 4), (1, 5, 4), "served view 1, alone"),  # what it let out alone
        ((1, True, 5, 4), (1, 4), "at version 4; its primary let out version 5$"),  # local
        ((1, True, 5, 4), (1, 5), None),  # pushes not counted
    ],
)
def test_a_backup_is_stale_if_it_may_lack_what_its_primary_let_out(seen, backup, why):
    got = replica.stale(seen, *backup)
    assert got is None if why is None else re.search(why, got), got
