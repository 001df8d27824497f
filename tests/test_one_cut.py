"""A checkpoint of ``stalewise run`` is one consistent cut (issue #42 item 1): the
launcher is SIGKILLed at random moments and started again with ``--resume``, every data
item is applied exactly once and no acknowledged push is lost (issue #45: the resume
replays the push logs). The one-hot job: rank ``r``'s ``i``-th push adds 1 to item
``(r, i)`` of the parameters, so an item applied twice (a resume that repeats the
pushes made after a rank's saved ``ctx.state``) or skipped shows in the final ones."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from multiprocessing import connection

import child_procs
import numpy as np
import pytest
from test_own_pulls import N, ShardThread

import stalewise as sw
from stalewise import checkpoint
from stalewise.checkpoint import store
from stalewise.launch import checkpoints as saving
from stalewise.protocol import PushHeader, budget, delivery, pushlog
from stalewise.runtime.local import shard_proc, wire
from stalewise.runtime.local.server import LocalServer

STEPS, EVERY, WORKERS, KILLS = 1200, 20, 2, 3
TIMEOUT = 180  # seconds for one process's step (a loaded machine)

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import stalewise as sw

    if __name__ == "__main__":
        steps, workers, bsp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "bsp"
        # BSP applies a round's mean: a learning rate of `workers` makes each item 1
        job = sw.Job({"items": np.zeros((workers, steps), np.float32)},
                     optimizer=sw.optim.sgd(float(workers) if bsp else 1.0),
                     consistency=sw.BSP() if bsp else sw.ASP())
        ctx = sw.init(job)
        # this rank's pushes the shards hold as it starts, then each one acknowledged
        acked = os.open(f"acked-{ctx.rank}", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(acked, b"start %d\\n" % ctx.client.pushed)
        while not ctx.should_stop():
            i = ctx.state.get("i", 0)
            ctx.client.pull()
            g = np.zeros((workers, steps), np.float32)
            g[ctx.rank, i] = -1.0
            ctx.client.push({"items": g})
            ctx.client.wait()
            os.write(acked, b"%d\\n" % ctx.client.pushed)
            ctx.state["i"] = i + 1
            time.sleep(0.004)
        ctx.close()
    """
)


def test_the_cut_rule_names_a_push_on_one_shard_and_a_rank_state_off_the_cut():
    """The rule (no processes): every shard's state holds the same pushes of a worker, and
    its rank's ``ctx.state`` is after exactly those."""
    params = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(1.0), shards=2)
    shards = [job.config.build_shard(k, job.config.init[lo:hi].copy(), workers=2)
              for k, (lo, hi) in enumerate(job.config.ranges)]  # fmt: skip
    for shard in shards:
        shard.join(0, incarnation=1)
        shard.push(PushHeader(0, 0, 0, 1), np.ones(2, np.float32))
    states = [s.state_dict() for s in shards]
    assert budget.off_cut(states, 0, held=1, state=1) is None
    assert budget.off_cut(states, 1, held=0, state=None) is None  # no push, no state
    assert budget.off_cut(states, 0, held=1, state=0) == (
        "rank 0's ctx.state is after 0 of its pushes, the shards' after 1: "
        "a resume repeats 1 of them"
    )
    assert "skips 2" in budget.off_cut(states, 0, held=1, state=3)
    shards[1].push(PushHeader(0, 1, 1, 1), np.ones(2, np.float32))  # in flight to shard 0
    split = [shards[0].state_dict(), shards[1].state_dict()]
    assert budget.off_cut(split, 0, held=1, state=1) == (
        "worker 0: the shards hold different pushes of it, [(1, 1), (1, 2)]"
    )


def _launch(tmp_path, consistency: str, resume: bool):
    args = ["--workers", str(WORKERS), "--steps", str(STEPS), "--checkpoint-dir", "ckpt"]
    args += ["--checkpoint-every", str(EVERY), *(["--resume"] if resume else [])]
    args += ["job.py", str(STEPS), str(WORKERS), consistency]
    return child_procs.launched(tmp_path, *args, stdout=subprocess.DEVNULL)


def acked_lost(folder, workers: int) -> list[int]:
    """Per rank, the most of its acknowledged pushes (its ``acked-<rank>`` file: ``start
    N`` as a run starts, then each count acknowledged) a resumed run's shards lacked."""
    lost = []
    for r in range(workers):
        most = worst = 0
        for line in (folder / f"acked-{r}").read_text().splitlines():
            n = int(line.split()[-1])
            if line.startswith("start"):
                worst = max(worst, most - n)
            most = max(most, n)
        lost.append(worst)
    return lost


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
def test_every_item_is_applied_once_and_no_acked_push_is_lost_across_random_kills(
    tmp_path, consistency
):
    (tmp_path / "job.py").write_text(SCRIPT)
    rng = random.Random(42 if consistency == "asp" else 43)
    ckpts = tmp_path / "ckpt"
    kills = 0
    for attempt in range(KILLS + 1):
        with _launch(tmp_path, consistency, resume=attempt > 0) as proc:
            if attempt < KILLS:  # killed at a random moment once it has saved something new
                seen = checkpoint.load(ckpts).version if checkpoint.exists(ckpts) else -1
                deadline = time.monotonic() + 120
                while proc.poll() is None and time.monotonic() < deadline:
                    if checkpoint.exists(ckpts) and checkpoint.load(ckpts).version > seen:
                        break
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 1.0))
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)  # the launcher alone: its ranks follow
                    kills += 1
            proc.wait(timeout=180)
            err = proc.stderr.read()
        if attempt == KILLS:
            assert proc.returncode == 0, err
    assert kills >= 2, "the runs ended before they could be killed"
    assert acked_lost(tmp_path, WORKERS) == [0] * WORKERS
    final = checkpoint.load(ckpts)
    for path in ckpts.glob("ckpt-*"):  # numbered by the job's pushes, as --checkpoint-every counts
        assert path.name == f"ckpt-{checkpoint.load(path).step['pushes']:09d}"
    items = final.flat().reshape(WORKERS, STEPS)
    made = [int(r["i"]) for r in final.ranks]
    assert sum(made) == final.step["pushes"] >= STEPS, (made, final.step)
    for r, n in enumerate(made):
        twice = np.flatnonzero(items[r] > 1.5).tolist()
        skipped = np.flatnonzero(items[r, :n] < 0.5).tolist()
        assert not twice and not skipped, f"rank {r}: twice {twice}, skipped {skipped}"
        np.testing.assert_array_equal(items[r, :n], 1.0)
        np.testing.assert_array_equal(items[r, n:], 0.0)


def test_job_train_counts_checkpoint_every_in_pushes_and_loads_a_folder_numbered_by_version(
    tmp_path,
):
    """``Job.train``'s ``checkpoint_every`` counts the job's pushes, as ``stalewise run``'s
    does (one rule: ``budget.checkpoint_due``), and its folders are numbered by them: a BSP
    round of 2 workers is one version and 2 pushes. A folder of the older numbering (by
    shard 0's version) still loads and resumes."""
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.1), consistency=sw.BSP())

    def train(steps, **ckpt):
        return job.train(lambda p, b: (0.0, {"w": p["w"] - 1.0}), data=[[0], [0]], workers=2,
                         steps=steps, runtime=sw.Simulation(seed=1),
                         checkpoints=sw.Checkpoints(tmp_path, keep=100, **ckpt))  # fmt: skip

    train(40, every=10)
    saved = [checkpoint.load(p) for p in sorted(tmp_path.glob("ckpt-*"))]
    pushes = [c.step["pushes"] for c in saved]
    assert [c.path.name for c in saved] == [f"ckpt-{n:09d}" for n in pushes]
    # due at the commit of push 10, 20, ... (not yet applied: not in it), and the end
    assert pushes == [9, 19, 29, 39, 40], pushes
    assert [c.version for c in saved] == [n // 2 for n in pushes]  # rounds of 2 pushes
    last = saved[-1]
    older = last.path.rename(tmp_path / f"ckpt-{last.version:09d}")  # as before: by version
    (tmp_path / "latest").write_text(older.name + "\n")
    assert checkpoint.load(tmp_path).path == older
    resumed = train(60, resume=True)
    assert resumed.stats["version"] == 30 and resumed.pushes == 60


NEVER_STOPS = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import stalewise as sw

    if __name__ == "__main__":
        steps = int(sys.argv[1])
        job = sw.Job({"w": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.01))
        ctx = sw.init(job)
        if ctx.rank == 1:
            ctx.budget(None)  # it counts on its own
        paused = 0.0
        while True:
            if ctx.rank == 0:  # asks should_stop() between steps: saved at the cut
                t = time.monotonic()
                stop = ctx.should_stop()
                paused += time.monotonic() - t
            else:  # counts on its own: never calls should_stop()
                stop = ctx.client.job_pushes >= steps
            if stop:
                break
            ctx.client.pull()
            ctx.client.push({"w": np.ones(4, np.float32)})
            ctx.state["i"] = ctx.state.get("i", 0) + 1
            time.sleep(0.005 if ctx.rank == 0 else 0.03)
        ctx.close()
        with open(f"paused-{ctx.rank}.json", "w") as f:
            json.dump(paused, f)
    """
)


def test_a_rank_that_never_calls_should_stop_costs_the_checkpoints_no_wait(tmp_path):
    """Issue #42: the launcher waited ``RANK_STATE_WAIT`` (10 s) per checkpoint for a rank
    that never offers its state, and the ranks that do waited at the cut meanwhile. Now
    it does not wait for a rank that has never called ``ctx.should_stop()`` (said once):
    rank 0 pauses less than 5 s in all over at least 3 checkpoints."""
    (tmp_path / "job.py").write_text(NEVER_STOPS)
    steps, every = 300, 75  # 3 checkpoints while both run, and the end
    args = ["--workers", "2", "--steps", str(steps), "--checkpoint-dir", "ckpt"]
    args += ["--checkpoint-every", str(every), "job.py", str(steps)]
    seen = set()
    with child_procs.launched(tmp_path, *args, stdout=subprocess.DEVNULL) as proc:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(p.name for p in (tmp_path / "ckpt").glob("ckpt-*"))
            time.sleep(0.01)
        proc.wait(timeout=30)
        err = proc.stderr.read()
    assert proc.returncode == 0, err
    periodic = sorted(n for n in (int(s.split("-")[1]) for s in seen) if 0 < n < steps)
    assert len(periodic) >= 3, (periodic, err)
    paused = json.loads((tmp_path / "paused-0.json").read_text())
    assert paused < 5.0, (paused, periodic)
    assert err.count("rank 1 has not called ctx.should_stop()") == 1, err
    assert "rank 0's ctx.state is after" not in err, err  # rank 0's states are of the cut


SERVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import stalewise as sw

    name, ckpts, workers, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    job = sw.Job({"items": np.zeros((workers, n), np.float32)}, optimizer=sw.optim.sgd(1.0),
                 shards=2)
    saves = sw.Checkpoints(ckpts, every=30, resume=True)
    with job.serve(workers=workers, name=name, checkpoints=saves) as server:
        print("served", flush=True)
        sys.stdin.readline()
    print("closed", flush=True)
    """
)

PUSHER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import stalewise as sw

    name, w, start, workers, n = sys.argv[1], *map(int, sys.argv[2:])
    client = sw.attach(name, worker=w)
    for i in range(start, n):  # push i of worker w sets item (w, i)
        g = np.zeros((workers, n), np.float32)
        g[w, i] = -1.0
        client.push({"items": g})
        time.sleep(0.005)
    client.close()
    """
)


def test_a_served_jobs_checkpoints_are_one_cut_and_a_resume_applies_each_push_once(tmp_path):
    """Issue #45 item 1: ``job.serve(checkpoints=...)`` saved each shard between two of its
    own messages, so a push in flight was in one shard's state and not the other's ("shards
    hold different pushes"). Several processes push into a 2-shard job while it saves every
    30 pushes; the serving process is SIGKILLed and served again with resume, each process
    goes on from its pushes the checkpoint holds: every checkpoint's shards hold the same
    pushes of every worker, and every item is applied exactly once."""
    workers, n, name = 3, 500, f"cut-{uuid.uuid4().hex[:8]}"
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "pusher.py").write_text(PUSHER)
    ckpts, errs, checked = tmp_path / "ckpt", [], set()

    def check_new():  # each checkpoint as it appears (2 are kept)
        for path in ckpts.glob("ckpt-*"):
            if path.name in checked:
                continue
            try:
                ckpt = checkpoint.load(path)
            except sw.CheckpointError:  # removed meanwhile (or half-written: not named yet)
                continue
            checked.add(path.name)
            for w in range(workers):
                why = budget.off_cut(ckpt.states, w, ckpt.step["pushed"][w], None)
                assert why is None, f"{path.name}: {why}"

    def pushers(tag, starts):
        return [subprocess.Popen([sys.executable, "pusher.py", f"{name}-{tag}", str(w), str(s),
                                  str(workers), str(n)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
                for w, s in enumerate(starts)]  # fmt: skip

    def serve(tag):
        proc = child_procs.start(tmp_path / "server.py", f"{name}-{tag}", ckpts, workers, n,
                                 stdin=True)  # fmt: skip
        assert child_procs.line(proc, TIMEOUT) == ["served"]
        return proc

    first, ps = serve("a"), []
    try:
        ps = pushers("a", [0] * workers)
        deadline = time.monotonic() + TIMEOUT
        while not (checkpoint.exists(ckpts) and checkpoint.load(ckpts).step["pushes"] >= 600):
            assert time.monotonic() < deadline, "no checkpoint at 600 pushes"
            check_new()
            time.sleep(0.01)
        first.kill()  # the serving process: its shards die with it
        first.wait(30)
        errs.append(first.stderr.read())
        for p in ps:
            p.wait(TIMEOUT)  # each fails (its shards are gone) or ended
    finally:
        for p in [first, *ps]:
            child_procs.end(p)
    second = serve("b")
    try:
        resumed = checkpoint.load(ckpts)  # the one the server resumed from
        assert resumed.step["pushes"] >= 600
        ps = pushers("b", resumed.step["pushed"])
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in ps) and time.monotonic() < deadline:
            check_new()
            time.sleep(0.01)
        for p in ps:
            assert p.wait(30) == 0, p.stderr.read()
        second.stdin.write("stop\n")
        second.stdin.flush()
        assert child_procs.line(second, TIMEOUT) == ["closed"]
        second.wait(30)
        errs.append(second.stderr.read())
    finally:
        for p in [second, *ps]:
            child_procs.end(p)
    check_new()
    assert len(checked) >= 6, checked  # taken while pushes were in flight
    assert not any("different pushes" in e for e in errs), errs
    final = checkpoint.load(ckpts)
    assert final.step["pushed"] == [n] * workers, final.step
    items = final.flat().reshape(workers, n)
    twice, skipped = np.argwhere(items > 1.5).tolist(), np.argwhere(items < 0.5).tolist()
    assert not twice and not skipped, f"twice {twice}, skipped {skipped}"


# -- a cut that fails: every shard thaws, its late replies are dropped, no log chain has a gap --

ONES = {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}


def two_shards() -> sw.Job:
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    return sw.Job(params, optimizer=sw.optim.sgd(1.0), shards=2)


def pushes(client, n):
    for _ in range(n):
        client.push(ONES, timeout=10)  # a frozen shard holds it for CUT_LIMIT (60 s)
    assert client.wait(timeout=10).status == "applied"


@contextlib.contextmanager
def stopped(server, k):
    """Shard ``k``'s process stopped (SIGSTOP) in the block, continued however it ends."""
    os.kill(server._procs[k].pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server._procs[k].pid, signal.SIGCONT)


def test_a_cut_given_up_thaws_every_shard_and_the_next_one_is_right(no_leaks):
    """A cut that failed left the shards that froze frozen (their workers' pushes held for
    CUT_LIMIT, 60 s), and its late replies were taken for the next cut's (``state_dicts()``
    returned ``[(0, 0)]``). Now the shards thaw at once and the replies are dropped: shard 1
    stopped while the cut waits, pushes flow again and the next cut holds every push."""
    with LocalServer(two_shards().config, workers=1) as server:
        client = server.client(0)
        pushes(client, 1)
        with contextlib.suppress(TimeoutError):  # its replies come after the call gave up
            server.state_dicts(timeout=0)
        with stopped(server, 1), pytest.raises(TimeoutError, match="shard 1"):
            server.state_dicts(timeout=1)
        pushes(client, 3)
        states, step, _ = server.checkpoint_parts(timeout=30)
        assert [int(s["next_seq"][0]) for s in states] == [4, 4] and step["pushes"] == 4
        np.testing.assert_array_equal(server.pull(timeout=30)["a"], np.full(4, -4.0))
        client.close()


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_cut_failed_between_its_phases_leaves_no_gap_in_a_log_chain(
    tmp_path, monkeypatch, fault, no_leaks
):
    """Shard 1 is killed (or stopped) once the shards froze, before they are aimed: the cut
    fails. Its log number was taken all the same, so each chain went on past a missing
    file and a replay stopped there. Now each shard's state at the first checkpoint and its
    logs replay to its params at the end (shard 1's, killed, has a new chain)."""
    job, folder = two_shards(), str(tmp_path)
    original = delivery.targets

    def between_phases(progress):
        os.kill(server._procs[1].pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        assert fault == "stopped" or connection.wait([server.shard_sentinels()[1]], 10)
        return original(progress)

    with LocalServer(job.config, workers=1) as server:
        client = server.client(0)
        pushes(client, 2)
        first = server.checkpoint_parts(timeout=30, log_dir=folder)
        pushes(client, 2)
        monkeypatch.setattr(delivery, "targets", between_phases)
        try:
            with pytest.raises(sw.ShardError if fault == "killed" else TimeoutError):
                server.checkpoint_parts(timeout=3, log_dir=folder)
        finally:
            monkeypatch.setattr(delivery, "targets", original)
            if fault == "stopped":
                os.kill(server._procs[1].pid, signal.SIGCONT)
        if fault == "killed":
            client.close()
            server.restart_shard(1)
            client = server.client(0)
        pushes(client, 2)
        server.checkpoint_parts(timeout=30, log_dir=folder)
        pushes(client, 2)
        client.close()
        final = server.state_dicts(timeout=30)
    for k in [0] if fault == "killed" else [0, 1]:
        state = first[0][k]
        shard = job.config.build_shard(k, np.array(state["params"]), int(state["workers"]))
        shard.load_state_dict(state)
        chain, n = store.LOG.match(first[1]["logs"][k]).groups()
        read = []
        while (path := tmp_path / f"{chain}-{int(n) + len(read):06d}").exists():
            with open(path, "rb") as f:
                pushlog.replay(shard, pushlog.read(f, max_payload=1 << 20))
            read.append(path.name)
        # the first checkpoint's, the failed cut's (once its targets were sent: a killed
        # shard seen dead before they go out stops them, and the number is not taken), the next's
        assert len(read) in ((2, 3) if fault == "killed" else (3,)), read
        np.testing.assert_array_equal(shard.params, final[k]["params"])


def test_a_shard_that_gave_a_cut_up_says_so_and_begins_its_log_all_the_same(tmp_path, monkeypatch):
    """A shard frozen ``CUT_LIMIT`` seconds thawed and said nothing (a parent that waits
    without a timeout waited forever), and targets reaching it then gave a state of no cut.
    Now it replies an error to both; and a log named to it is begun when the cut ends, as
    when the parent thaws it before its targets are reached (one shard's loop, on a thread)."""
    monkeypatch.setattr(shard_proc, "CUT_LIMIT", 0.0)
    s = ShardThread(1, busy=False)
    try:

        def reply():
            assert s._control.poll(TIMEOUT)
            return wire.decode_reply(s._control.recv_bytes(), trusted=True)

        s._control.send_bytes(wire.cut(7, None))
        assert reply() == ("cut", (7, [(1, 0)], None))  # frozen: worker 0's progress
        assert reply() == ("cut", (7, None, "shard 0: no consistent cut within 0 s"))
        s._control.send_bytes(wire.cut(7, {0: (1, 0)}, str(tmp_path / "a"), False))
        assert reply() == ("cut", (7, None, "shard 0: not frozen for cut 7 (gave it up)"))
        monkeypatch.setattr(shard_proc, "CUT_LIMIT", 60.0)
        s._control.send_bytes(wire.cut(8, None))
        assert reply()[1][0] == 8
        s._control.send_bytes(wire.cut(8, {0: (1, 1)}, str(tmp_path / "b"), False))
        s._control.send_bytes(wire.thaw())  # before worker 0's push 0 arrived
        s.clients[0].push({"w": np.ones(N, np.float32)}, timeout=TIMEOUT)
        assert s.clients[0].wait(timeout=TIMEOUT).status == "applied"
        assert not s._control.poll(0.1)  # the thaw has no reply
        assert (tmp_path / "a").is_file() and (tmp_path / "b").stat().st_size > 0
    finally:
        s._stop.set()
        s._thread.join(10)
        s.proc.end_log()
        s.close()


def test_a_resume_from_the_logs_zeroes_the_residual_of_a_worker_they_add_pushes_of(
    tmp_path, no_leaks
):
    """A codec's error-feedback residual in the checkpoint is of the pushes it holds: a
    worker whose later pushes the logs add would send error already sent, so it starts
    from zero; a worker with none in the logs keeps its saved residual."""
    job = sw.Job({"w": np.zeros(4096, np.float32)}, optimizer=sw.optim.sgd(1.0),
                 codec=sw.codecs.topk(0.1))  # fmt: skip
    ckpts = tmp_path / "ckpt"
    (folder := ckpts / ".ranks").mkdir(0o700, parents=True)
    rng = np.random.default_rng(0)
    with job.serve(workers=2) as server:
        saves = saving.Saves(job, server, str(ckpts), None, False, folder=folder)
        clients = [server.client(w) for w in (0, 1)]
        for c in clients:
            c.push({"w": rng.normal(size=4096).astype(np.float32)}, timeout=10)
            assert c.wait(timeout=10).status == "applied"
        saves.save()  # both residuals non-zero in it
        clients[1].push({"w": rng.normal(size=4096).astype(np.float32)}, timeout=10)
        assert clients[1].wait(timeout=10).status == "applied"  # in the log only
        saved = checkpoint.load(ckpts).residuals
        for c in clients:
            c.close()
    assert all(np.any(r) for r in saved)
    with job.serve(workers=2) as server:
        saving.Saves(job, server, str(ckpts), None, True, folder=folder)
        assert checkpoint.load(ckpts).step["pushed"] == [1, 2]
        residuals = server.residuals()
    np.testing.assert_array_equal(residuals[0], saved[0])
    assert not np.any(residuals[1])


def test_a_resumed_rank_takes_its_state_of_the_pushes_the_shards_hold(tmp_path, caplog):
    """The rule (no processes): of the two states a rank kept (after 6 and 7 of its pushes),
    the one of the count the replayed shards hold; else the nearest below, skipping the
    pushes between (warned unless saved with that skip to go); else the checkpoint's own
    (after 5 of them, taken when the shards held 5)."""
    for n in (6, 7):
        saving.write_rank_state(tmp_path, 0, {"i": n}, pushes=0, pushed=n)
    assert saving._choose(tmp_path, 0, 7, {"i": 5}, 5, 5) == ({"i": 7}, 7)
    assert saving._choose(tmp_path, 0, 6, {"i": 5}, 5, 5) == ({"i": 6}, 6)
    assert saving._choose(tmp_path, 0, 5, {"i": 5}, 5, 5) == ({"i": 5}, 5)
    assert not caplog.records
    assert saving._choose(tmp_path, 0, 8, {"i": 5}, 5, 5) == ({"i": 7}, 7)
    assert caplog.records[-1].getMessage() == (
        "resume: rank 0's ctx.state is after 7 of its pushes (saved: [6, 7]), "
        "the shards hold 8: it skips its next 1"
    )
    caplog.clear()
    (tmp_path / "rank-0-1.safetensors").unlink()  # the rank's last: after 6, a skip to go
    saving.write_rank_state(tmp_path, 0, {"i": 6}, pushes=0, pushed=6, skip=1)
    assert saving._choose(tmp_path, 0, 7, {}, 5, 5) == ({"i": 6}, 6)
    assert not caplog.records  # the skip it was saved with
    assert saving._choose(tmp_path, 0, 8, {}, 5, 5) == ({"i": 6}, 6)
    assert caplog.records[-1].getMessage().endswith("the shards hold 8: it skips its next 2")
    caplog.clear()
    (tmp_path / "rank-0-0.safetensors").unlink()  # the checkpoint's, after 4, a skip to go
    assert saving._choose(tmp_path, 0, 5, {"i": 4}, 4, 5) == ({"i": 4}, 4)
    assert not caplog.records


def test_a_checkpoint_carries_a_pending_skip_to_any_resume(tmp_path, caplog, no_leaks):
    """A rank's state saved one push behind the shards (killed before its should_stop):
    the launched resume skips that push, and its start-up checkpoint records the state's
    count, so a resume from that checkpoint alone (the ranks' files gone, or unlaunched)
    skips it too, unwarned; the skipped push leaves a "duplicate" result, not None."""
    job = sw.Job({"w": np.zeros(8, np.float32)}, optimizer=sw.optim.sgd(1.0))
    ckpts = tmp_path / "ckpt"
    (folder := ckpts / ".ranks").mkdir(0o700, parents=True)
    with job.serve(workers=1) as server:
        saving.Saves(job, server, str(ckpts), None, False, folder=folder)
        with contextlib.closing(server.client(0)) as c:
            for i in range(3):  # in the logs only
                c.push({"w": np.ones(8, np.float32)}, timeout=10)
                assert c.wait(timeout=10).status == "applied"
                saving.write_rank_state(folder, 0, {"i": i}, pushes=i, pushed=i)  # one behind
    with job.serve(workers=1) as server:
        saves = saving.Saves(job, server, str(ckpts), None, True, folder=folder)
        assert (saves.ranks, saves.pushed, saves.skips) == ([{"i": 2}], [2], [1])
        assert [r.getMessage()[-16:] for r in caplog.records] == ["skips its next 1"]
    ckpt = checkpoint.load(ckpts)
    assert ckpt.step["pushed"] == [3] and ckpt.step["ranks_pushed"] == [2], ckpt.step
    assert ckpt.ranks == [{"i": 2}]
    caplog.clear()
    for path in folder.iterdir():
        path.unlink()
    with job.serve(workers=1) as server:  # the checkpoint's rank state, launched
        saves = saving.Saves(job, server, str(ckpts), None, True, folder=folder)
        assert (saves.ranks, saves.pushed, saves.skips) == ([{"i": 2}], [2], [1])
    with job.serve(workers=1) as server:  # and unlaunched: sw.init's own
        saves = saving.Saves(job, server, str(ckpts), None, True)
        ctx = sw.Context(0, 1, server.client(0), launched=False)
        saving.InProcess(saves, ctx)
        assert ctx.state == {"i": 2} and ctx.client.wait() is None
        ctx.client.pull()
        ctx.client.push({"w": np.ones(8, np.float32)}, timeout=10)  # skipped
        result = ctx.client.wait(timeout=10)
        assert result.status == "duplicate" and ctx.client.pushed == 3, result
        ctx.state["i"] = 3
        ctx.client.pull()
        ctx.client.push({"w": np.ones(8, np.float32)}, timeout=10)
        assert ctx.client.wait(timeout=10).status == "applied" and ctx.client.pushed == 4
        ctx._ckpt.close(ctx)
        ctx.client.close()
        params = server.pull()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    ckpt = checkpoint.load(ckpts)
    assert (
        ckpt.step["pushed"] == [4] and ckpt.step["ranks_pushed"] == [4] and ckpt.ranks == [{"i": 3}]
    )
    np.testing.assert_array_equal(params["w"], np.full(8, -4.0, np.float32))


def test_a_checkpoint_whose_ranks_pushed_is_not_a_count_per_worker_is_refused_in_one_line(
    tmp_path, no_leaks
):
    job = sw.Job({"w": np.zeros(8, np.float32)}, optimizer=sw.optim.sgd(1.0))
    with job.serve(workers=1) as server:
        saving.Saves(job, server, str(tmp_path), None, False).save()
    (path,) = tmp_path.glob("ckpt-*")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["step"]["ranks_pushed"] = ["x"]
    text = json.dumps(manifest, indent=1)
    (path / "manifest.json").write_text(text)
    (path / "manifest.sha256").write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")
    with job.serve(workers=1) as server, pytest.raises(saving.LaunchError) as got:
        saving.Saves(job, server, str(tmp_path), None, True)
    assert "step.ranks_pushed is ['x'], not a count per worker" in str(got.value)
    assert "\n" not in str(got.value)
