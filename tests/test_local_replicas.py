"""replicas=2 on the local runtime, for real: each shard has a backup process that holds
every entry before a reply leaves. A SIGKILLed primary is replaced from its backup (no
worker restarted, nothing acknowledged lost or applied twice, the logs replay to the final
parameters bit for bit); a SIGKILLed backup is replaced and caught up; at close each
backup's state equals its primary's, bit for bit. Job.train stops every process it started,
even when a test fails (the ``no_leaks`` fixture checks)."""

import logging
import os
import re
import signal

import mp_helpers
import numpy as np
import pytest
import test_shard_log_restart
from test_one_cut import ONES, pushes
from test_replay import paced_loss_and_grad_b
from test_shard_log_restart import kill, wait_for

import stalewise as sw
from stalewise.checkpoint import replay, store
from stalewise.protocol.replica import Forward, Held, Primary
from stalewise.runtime.local import wire
from stalewise.runtime.local.client import recv_reply
from stalewise.runtime.local.server import LocalServer

SERVER = "stalewise.runtime.local.server"


class Kills(test_shard_log_restart.Kills):
    """SIGKILLs the process ``prefix + "0"``, then ``prefix + "1"``, ... (each shard backed
    again before its next turn). Marks a record ``relinked_score`` 1 once every kill is made,
    every shard has a backup linked again and ``pushes`` pushes are counted: the job's
    ``stop_at`` (RELINKED), so the run cannot end before the last new backup links."""

    first, gap = (0.3, 0.8), (0.4, 0.8)

    def __init__(self, n, prefix, caplog, seed=0, pushes=400):
        super().__init__(n, seed)
        self.prefix, self.caplog, self.pushes = prefix, caplog, pushes

    def victim(self, procs):
        name = f"{self.prefix}{len(self.pids) % 2}"
        return next((p for p in procs if p.name == name and p.is_alive()), None)

    def __call__(self, rec):
        super().__call__(rec)
        links = len(re.findall(r"shard \d: backup \d+ linked", self.caplog.text))  # 2 + 1 a kill
        done = not self.left and links >= 2 + len(self.pids) and rec["pushes"] >= self.pushes
        rec["relinked_score"] = float(done)


RELINKED = {"relinked_score": 1}


def train(
    folder=None, on_record=None, consistency=None, steps=300, workers=4, resume=False, stop_at=None
):
    params = {"x": np.zeros(8, np.float32), "b": np.ones(300, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.adam(0.05), shards=2, replicas=2,
                 consistency=consistency)  # fmt: skip
    every = None if folder is None else sw.Checkpoints(folder, every=100, keep=100, resume=resume)
    result = job.train(
        paced_loss_and_grad_b,
        data=mp_helpers.counting_data,
        workers=workers,
        steps=steps,
        stop_at=stop_at,
        checkpoints=every,
        metrics=sw.Metrics(every=0.05, on_record=on_record),
        timeouts=sw.Timeouts(total=60),
    )
    return job, result


def backups_equal(caplog):
    """Each shard's backup's state equals its primary's at close (LocalServer.close)."""
    text = caplog.text
    assert "differs from its primary's" not in text
    return all(f"shard {k}: its backup's state equals its primary's" in text for k in (0, 1))


def test_an_ack_waits_for_the_backup_and_a_hung_backup_is_killed_and_replaced(caplog, no_leaks):
    """Shard 1's backup is stopped: shard 1 applies the push but its ack waits (a shard that
    acks before its backup holds the push fails here; random kills rarely hit that), until
    the bound (backup_timeout): then the backup is killed, a new one follows."""
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(1.0), shards=2, replicas=2)
    with (
        caplog.at_level(logging.INFO),
        LocalServer(job.config, 1, backup_timeout=2, heals=False) as server,
    ):
        client = server.client(0)
        pushes(client, 2)
        server.stats()  # shard 1 answered the parent: its backup holds every entry
        backup = server._backups[1][0]
        os.kill(backup.pid, signal.SIGSTOP)
        client.push(ONES, timeout=10)
        with pytest.raises(TimeoutError, match="ack"):
            client.wait(timeout=1.0)
        assert client.wait(timeout=10).status == "applied"
        # (the watcher reaps it: a join here may find no exit code)
        wait_for(lambda: "shard 1's backup ended (killed by SIGKILL)" in caplog.text, "the kill")
        wait_for(lambda: (server._backups[1] or [backup])[0] is not backup, "a new backup")
        pushes(client, 2)
        client.close()
        assert [s["version"] for s in server.state_dicts(timeout=30)] == [5, 5]
    assert backups_equal(caplog), caplog.text


@pytest.mark.parametrize("kind", ["codec", "scratched"])
def test_a_backup_copies_a_payload_from_its_push_region_or_gets_it_whole(kind, caplog, no_leaks):
    """A forward leaves out a payload that is its worker's push region (int8's bytes), and
    carries one the step scratched (delayed Nesterov) whole: each backup ends equal."""
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    opt = sw.optim.delayed_nesterov(0.5, every=2) if kind == "scratched" else sw.optim.sgd(0.1)
    codec = sw.codecs.int8() if kind == "codec" else None
    job = sw.Job(params, optimizer=opt, shards=2, replicas=2, codec=codec)
    with caplog.at_level(logging.INFO), LocalServer(job.config, 2, heals=False) as server:
        clients = [server.client(w) for w in range(2)]
        for _ in range(3):
            for c in clients:
                pushes(c, 1)
        for c in clients:
            c.close()
        assert [s["version"] for s in server.state_dicts(timeout=30)] == [6, 6]
    assert backups_equal(caplog), caplog.text


@pytest.mark.parametrize("consistency", [None, sw.BSP()], ids=["asp", "bsp"])
def test_a_replicated_job_ends_with_each_backup_equal_to_its_primary(consistency, caplog, no_leaks):
    with caplog.at_level(logging.INFO, logger=SERVER):
        _, result = train(consistency=consistency, steps=200, workers=3)
    assert result.pushes >= 200
    assert backups_equal(caplog), caplog.text


def test_a_resumed_replicated_job_starts_its_backups_at_the_checkpoint(tmp_path, caplog, no_leaks):
    train(tmp_path, steps=100, workers=2)
    with caplog.at_level(logging.INFO, logger=SERVER):
        _, result = train(tmp_path, steps=200, workers=2, resume=True)
    assert 200 <= result.pushes < 210 and backups_equal(caplog), caplog.text


def test_a_killed_primary_is_replaced_from_its_backup_losing_nothing(tmp_path, caplog, no_leaks):
    kills = Kills(2, "stalewise-shard-", caplog)
    with caplog.at_level(logging.INFO):
        job, result = train(tmp_path, kills, steps=20_000, stop_at=RELINKED)
    assert len(kills.pids) == 2
    restarted = [e for e in result.failures if "shard" in e]
    assert len(restarted) == 2 and all(e["lost"] == 0 for e in restarted), restarted
    assert caplog.text.count("from its backup (0 updates of its slice lost)") == 2, caplog.text
    assert len(kills.workers) == 4, kills.workers  # the same worker processes throughout
    final = store.load(tmp_path)
    assert final.flat().tobytes() == result.flat.tobytes()
    assert all(np.asarray(s["incarnation"]).tolist() == [1] * 4 for s in final.states)
    # every push the workers counted handled once by each shard, none twice
    applied = [int(s["stats.applied"]) for s in final.states]
    versions = [int(s["version"]) for s in final.states]
    assert applied == versions == [result.pushes] * 2, (applied, versions, result.pushes)
    first = min(p.name for p in store._complete(tmp_path))
    flat, _, logs = replay.replay(tmp_path, job.config, first)
    assert flat.tobytes() == result.flat.tobytes(), (first, logs)
    assert backups_equal(caplog)  # the new backups followed the new primaries


def test_without_a_checkpoint_folder_a_killed_primary_restarts_no_worker(caplog, no_leaks):
    kills = Kills(1, "stalewise-shard-", caplog, seed=1)
    with caplog.at_level(logging.INFO):
        _, result = train(None, kills, steps=20_000, stop_at=RELINKED)
    assert len(kills.pids) == 1 and len(kills.workers) == 4, kills.workers
    assert "from its backup (0 updates of its slice lost)" in caplog.text
    assert result.ended == "stop_at" and result.pushes >= 400, result
    assert backups_equal(caplog), caplog.text


def test_a_killed_backup_is_replaced_and_caught_up(caplog, no_leaks):
    kills = Kills(2, "stalewise-backup-", caplog, seed=2)
    with caplog.at_level(logging.INFO):
        _, result = train(None, kills, steps=20_000, stop_at=RELINKED)
    assert len(kills.pids) == 2 and len(kills.workers) == 4
    assert not [e for e in result.failures if "shard" in e]
    assert caplog.text.count("backup ended (killed by SIGKILL); starting a new one") == 2
    assert result.ended == "stop_at" and result.pushes >= 400, result
    assert backups_equal(caplog), caplog.text


def test_a_backup_killed_before_it_links_is_replaced_again(caplog, no_leaks, monkeypatch):
    """Shard 0's backup is killed, then its replacement while it starts: a third one links."""
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(1.0), replicas=2)
    killed = []

    def kill_the_second(control, timeout, what, **kw):  # before the parent reads its "ready"
        if what == "start of shard 0's backup" and not killed:
            killed.append(next(iter(server._spawning)))
            os.kill(killed[0].pid, signal.SIGKILL)
        return recv_reply(control, timeout, what, **kw)

    with caplog.at_level(logging.INFO), LocalServer(job.config, 1, heals=False) as server:
        first = server._backups[0][0]
        monkeypatch.setattr("stalewise.runtime.local.server.recv_reply", kill_the_second)
        os.kill(first.pid, signal.SIGKILL)
        wait_for(lambda: killed, "a replacement starting")
        second = killed[0]
        wait_for(lambda: server._backups[0] and server._backups[0][0] not in (first, second),
                 "a third backup linked", 60)  # fmt: skip
        assert "shard 0: no backup: " in caplog.text
        client = server.client(0)
        pushes(client, 2)
        client.close()
    assert "shard 0: its backup's state equals its primary's" in caplog.text, caplog.text


def test_a_backup_without_the_newest_log_is_taken_and_a_new_chain_begins(
    tmp_path, caplog, no_leaks
):
    """Shard 0 loses its log and dies with its backup: it restarts from its snapshot, with no
    log. Its new backup then holds no log, yet at the next death its (exact) state is taken,
    not refused for a replay that lacks the updates since."""
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(1.0), replicas=2)
    with caplog.at_level(logging.INFO), LocalServer(job.config, 1, heals=False) as server:
        client = server.client(0)
        _, step, _ = server.checkpoint_parts(timeout=30, log_dir=str(tmp_path))
        pushes(client, 3)
        client.close()
        wait_for(lambda: server.published_version(0) == 3, "shard 0 publishes the pushes")
        os.unlink(tmp_path / step["logs"][0])
        backup = server._backups[0][0]
        os.kill(backup.pid, signal.SIGKILL)
        wait_for(lambda: not backup.is_alive(), "the backup is dead")
        kill(server, 0)
        assert server.restart_shard(0, timeout=30)["source"] == "published snapshot"
        wait_for(lambda: server._backups[0], "a new backup", 60)
        client = server.client(0)
        pushes(client, 2)
        client.close()
        kill(server, 0)
        info = server.restart_shard(0, timeout=30)
        assert (info["source"], info["version"], info["lost"]) == ("backup", 5, 0), info
        assert "a new log chain begins" in caplog.text


@pytest.mark.parametrize(
    "body, says",
    [
        (b"\x99 not a message", "not a message between a shard's copies (15 bytes)"),
        (wire.link(Forward(1, 0, (b"entry",))), "a Forward before its catch-up"),
        ([wire.link(Held(1, 0))], "a Held on a backup's link"),
        ([wire.link(Forward(1, 0, (b"ab",)))], "a forwarded entry of 2 bytes"),
    ],
    ids=["garbled", "forward-first", "held-after-catch-up", "short-entry"],
)
def test_a_bad_message_on_a_backups_link_stops_it_in_one_line(body, says, capfd, no_leaks):
    """A backup sent what no primary sends logs one line naming its shard and stops (the
    parent replaces a linked one: test_a_killed_backup_is_replaced_and_caught_up)."""
    job = sw.Job({"a": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(1.0), replicas=2)
    with LocalServer(job.config, 1) as server:
        p, control, link = server._start_backup(0)
        with control, link:
            assert recv_reply(control, 60, "the backup's start") == ("ready", 0)
            if isinstance(body, list):  # after a catch-up, from a primary of the same job
                shard = job.config.build_shard(0, np.zeros(4, np.float32), 1)
                link.send_bytes(wire.link(Primary(shard).attach()))
                assert wire.decode_link(link.recv_bytes())[0] == Held(1, 0)
                body = body[0]
            link.send_bytes(body)
            p.join(30)
        assert p.exitcode == 0
    err = capfd.readouterr().err
    assert f"stalewise backup 0: ERROR: backup 0: a bad message from its primary ({says})" in err
    assert "Traceback" not in err, err


def test_a_backup_asked_how_far_it_is_first_holds_the_dead_primarys_last_forward(monkeypatch):
    """The parent cuts the log where the backup says it holds it, then promotes it: a
    forward still on the link when it asks (the backup busy applying) is held and counted
    before the answer, so the state promoted is the log's up to the cut."""
    import multiprocessing as mp
    import threading
    import time

    from stalewise.protocol import PushHeader
    from stalewise.protocol.replica import Backup
    from stalewise.runtime.local import shard_proc

    job = sw.Job({"a": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(1.0), replicas=2)
    primary = Primary(job.config.build_shard(0, np.zeros(4, np.float32), 1))
    (link, theirs), (control, their_control) = mp.Pipe(), mp.Pipe()
    slow, apply = threading.Event(), Backup.apply

    def slowly(self):  # the apply of a large turn on a loaded machine
        if slow.is_set() and self.pending:
            slow.clear()
            time.sleep(0.5)
        apply(self)

    monkeypatch.setattr(Backup, "apply", slowly)
    out = []
    args = (job.config.build_shard(0, np.zeros(4, np.float32), 1), [np.zeros(4, np.float32)])
    follower = threading.Thread(
        target=lambda: out.append(shard_proc.follow(*args, theirs, their_control))
    )
    follower.start()
    link.send_bytes(wire.link(primary.attach(), "log", 0))
    assert wire.decode_link(link.recv_bytes())[0] == Held(1, 0)
    primary.join(0, 1)
    at = 0
    slow.set()
    for seq in range(2):
        primary.shard.push(PushHeader(0, seq, seq, 1), np.ones(4, np.float32))
        fwd = primary.forward()
        tagged = fwd._replace(entries=tuple(shard_proc._REGION.pack(-1) + e for e in fwd.entries))
        link.send_bytes(wire.link(tagged, "log", at))
        at += sum(map(len, fwd.entries))
        if seq == 0:
            assert wire.decode_link(link.recv_bytes())[0] == Held(1, 2)
            time.sleep(0.1)  # the backup is now applying the first forward
    link.close()  # the primary dies before it hears of the second
    control.send_bytes(wire.stats())
    told = recv_reply(control, 30, "the backup's stats", trusted=True)[1]
    assert told == {"version": 2, "held": ("log", at)}, told
    control.send_bytes(wire.load(None, ("log", at, False), ()))
    follower.join(30)
    assert out[0][0]["version"] == 2 and out[0][1] == ("log", at, False)
    np.testing.assert_array_equal(out[0][0]["params"], primary.shard.params)
