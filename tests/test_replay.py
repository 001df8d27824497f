"""Push logs of the local runtime, for real: a run's checkpoint and the logs after it
replay to the run's final parameters bit for bit (``stalewise replay``), a worker killed
mid-run included, and past the last checkpoint of a launcher killed mid-run; a garbled or
foreign log is one line. Every launcher's process group is killed at the end."""

import os
import signal
import time

import child_procs
import mp_helpers
import numpy as np
import pytest
from test_cli import LS_CONFIG, write
from test_faults import Once, paced_loss_and_grad
from test_own_checkpoint import SCRIPT, TIMEOUT

import stalewise as sw
from stalewise.checkpoint import replay, store
from stalewise.cli import main
from stalewise.protocol import pushlog

CASES = {  # consistency, strategy, optimizer, shards, codec, kill worker 1
    "asp-adam": (sw.ASP(), None, sw.optim.adam(0.05), 2, None, False),
    "bsp-lamb-killed": (sw.BSP(), None, sw.optim.lamb(0.05, weight_decay=0.01), 1, None, True),
    "asp-diloco-int8-killed": (
        sw.ASP(),
        sw.strategies.diloco(4, sw.optim.adam(0.01), asynchronous=True, every=2),
        None,
        2,
        sw.codecs.int8(),
        True,
    ),
    "bsp-diloco": (sw.BSP(), sw.strategies.diloco(4, sw.optim.adam(0.01)), None, 1, None, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_checkpoint_and_the_logs_after_it_replay_to_the_final_params(case, tmp_path, no_leaks):
    consistency, strategy, optimizer, shards, codec, kill = CASES[case]
    params = {"x": np.zeros(8, np.float32), "b": np.ones(300, np.float32)}
    job = sw.Job(
        params,
        optimizer=optimizer,
        strategy=strategy,
        consistency=consistency,
        shards=shards,
        codec=codec,
    )
    killer = Once("stalewise-worker-1", after=60) if kill else None
    result = job.train(
        paced_loss_and_grad_b,
        data=mp_helpers.counting_data,
        workers=2,
        steps=160,
        checkpoints=sw.Checkpoints(tmp_path, every=20, keep=20, fsync=case == "asp-adam"),
        metrics=sw.Metrics(every=0.05, on_record=killer),
        timeouts=sw.Timeouts(total=120),
    )
    if kill:
        assert killer.pid is not None and result.restarts == 1
    kept = [p.name for p in store._complete(tmp_path)]
    assert len(kept) >= 3, kept
    final = store.load(tmp_path)
    assert np.array_equal(final.flat(), result.flat)  # the final checkpoint is the run's end
    for name in kept:
        flat, _, logs = replay.replay(tmp_path, job.config, name)
        assert flat.tobytes() == result.flat.tobytes(), (name, logs)
        assert replay.first_difference(flat, final) is None


def paced_loss_and_grad_b(params, batch):
    """paced_loss_and_grad, and a gradient for ``b`` as well."""
    loss, grads = paced_loss_and_grad({"x": params["x"]}, batch)
    return loss, {**grads, "b": params["b"] * np.float32(0.01 * (batch % 7))}


def pushes_in(log):
    with open(log, "rb") as f:
        return sum(op == "push" for op, _, _ in pushlog.read(f, max_payload=1 << 30, where="t"))


def test_stalewise_replay_checks_a_run_and_names_a_bad_log_in_one_line(
    tmp_path, capsys, caplog, no_leaks
):
    cfg = write(tmp_path, LS_CONFIG.replace("total = 300", "total = 3000"))  # lr > 0 at the end
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "-q", "--checkpoint-every", "60"]) == 0
    kept = [p.name for p in store._complete(run / "checkpoints")]
    oldest, out = kept[-1], tmp_path / "params.safetensors"
    capsys.readouterr()
    argv = ["replay", str(cfg), str(run), "--from", oldest, "--check"]
    assert main([*argv, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"replayed {oldest} and " in said and f"identical to {kept[0]}" in said
    from safetensors.numpy import load_file

    leaves = load_file(str(out))
    assert np.concatenate([a.ravel() for a in leaves.values()]).tobytes() == (
        store.load(run / "checkpoints").flat().tobytes()
    )

    logs = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("log-"))
    for name in store.load(run / "checkpoints" / oldest).step["logs"]:  # pruned before it
        assert min(p.name for p in logs if p.name[:-6] == name[:-6]) == name, logs
    newest = store.load(run / "checkpoints").step["logs"]  # begun at the final params
    before = [p for p in logs if any(p.name[:-6] == n[:-6] and p.name < n for n in newest)]
    log = max(before, key=pushes_in)  # the most pushes (a log may hold pulls and leaves only)
    assert pushes_in(log) > 0
    later = {p: p.read_bytes() for p in logs if p.name[:-6] == log.name[:-6] and p > log}
    data = log.read_bytes()
    log.write_bytes(data[:5])  # torn in its first entry: none of its pushes replays
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{log}: entry " in err and "torn, though a later log follows it" in err
    for p in later:  # as if the run had been killed while it wrote that log
        p.unlink()
    assert main(argv) == 1  # the entries before the torn one replay
    assert "differs from" in capsys.readouterr().out
    assert f"{log}: entry " in caplog.text and "torn (a crash" in caplog.text
    for p, b in later.items():
        p.write_bytes(b)
    garbled = bytearray(data)
    garbled[len(data) // 2] ^= 0xFF
    log.write_bytes(bytes(garbled))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{log}: entry " in err and "(garbled)" in err
    log.write_bytes(data)
    os.chmod(log, 0o666)
    assert main(argv) == 2
    assert f"{log}: writable by others (mode 0666)" in capsys.readouterr().err
    os.chmod(log, 0o644)
    assert main(argv) == 0


def test_a_run_without_logs_is_said_in_one_line(tmp_path, capsys):
    cfg = write(tmp_path, LS_CONFIG)
    assert main(["replay", str(cfg), str(tmp_path)]) == 2
    assert "no checkpoint in" in capsys.readouterr().err


def test_a_killed_launchers_logs_replay_past_its_last_checkpoint(tmp_path):
    """``stalewise run --checkpoint-dir`` (a loop you own), its process group SIGKILLed
    mid-run: each checkpoint and the logs after it replay to the same parameters, past
    the newest checkpoint's (the pushes the shards applied after it)."""
    script, ckpts = tmp_path / "train.py", tmp_path / "ckpt"
    script.write_text(SCRIPT.replace("sw.optim.sgd(0.05)", "sw.optim.adam(0.05)"))
    args = ["--workers", "2", "--steps", "5000", "--checkpoint-dir", str(ckpts)]
    args += ["--checkpoint-every", "30", str(script), str(tmp_path / "run"), "0.005"]
    with child_procs.launched(tmp_path, *args) as proc:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if ckpts.is_dir() and len(store._complete(ckpts)) >= 2:
                break
            time.sleep(0.05)
        logs = store.load(ckpts).step["logs"]
        while time.monotonic() < deadline and (ckpts / logs[0]).stat().st_size < 4000:
            time.sleep(0.01)  # pushes after the newest checkpoint (one is 200 bytes)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    config = sw.Job({"w": np.zeros(8, np.float32)}, optimizer=sw.optim.adam(0.05)).config
    flat, ckpt, logs = replay.replay(ckpts, config)  # from the one `latest` names
    assert logs and flat.tobytes() != ckpt.flat().tobytes()  # the log holds pushes after it
    for name in [p.name for p in store._complete(ckpts)]:
        assert replay.replay(ckpts, config, name)[0].tobytes() == flat.tobytes()


class Logged:
    """Two shards of a job as a run's would be, a checkpoint of them in ``folder`` naming the
    logs their journals write: the calls a test makes are what each shard logged before the
    processes died; :meth:`logged` is what a resume reads."""

    def __init__(self, folder, consistency=None, optimizer=None, residuals=None):
        job = sw.Job({"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)},
                     optimizer=optimizer or sw.optim.sgd(0.1), shards=2,
                     consistency=consistency)  # fmt: skip
        self.config, self.folder = job.config, folder
        self.live, self.want = self.shards(), self.shards()  # want: as if nothing was torn
        names = [f"log-shard-{k}-0000000{k}-000000" for k in range(2)]
        info = sw.checkpoint.config_info(self.config, workers=2)
        step = {"pushes": 0, "pushed": [0, 0], "logs": names, "time": 0.0}
        store.save(folder, [s.state_dict() for s in self.live], spec=self.config.spec,
                   config_info=info, step_info=step, residuals=residuals)  # fmt: skip
        self.files = [open(folder / n, "wb") for n in names]  # noqa: SIM115
        for s, f in zip(self.live, self.files, strict=True):
            s.journal = lambda buffers, f=f: f.write(b"".join(buffers))

    def shards(self):
        c = self.config
        made = [c.build_shard(k, c.init[lo:hi].copy(), workers=2)
                for k, (lo, hi) in enumerate(c.ranges)]  # fmt: skip
        for s in made:
            for w in range(2):
                s.join(w, 1)
        return made

    def push(self, w, seq, g, only=None):
        """Worker ``w``'s push ``seq`` of ``g``, based on the version it saw of each shard;
        ``only``: the one shard that logged it (torn), which ``want`` leaves out."""
        for k in range(2):
            part = g[3 * k : 3 * k + 3].copy()
            if only in (None, k):
                self.live[k].push(sw.protocol.PushHeader(w, seq, self.live[k].version, 1), part)
            if only is None:
                self.want[k].push(sw.protocol.PushHeader(w, seq, self.want[k].version, 1), part)

    def logged(self):
        for f in self.files:
            f.close()
        return store.load(self.folder), replay.logged(store.load(self.folder), self.config)


def test_a_resume_replays_the_logs_less_a_push_torn_across_shards(tmp_path):
    """``replay.logged``: a checkpoint advanced by its shards' logs holds every push both
    shards logged, and leaves out the one only shard 0 logged (the processes died while it
    was applied: never acknowledged), as if it had never been made; its counts follow."""
    run, rng = Logged(tmp_path, optimizer=sw.optim.adam(0.1)), np.random.default_rng(0)
    for w, seq in [(0, 0), (1, 0), (0, 1), (1, 1), (1, 2), (0, 2), (0, 3)]:
        run.push(
            w, seq, rng.normal(size=6).astype(np.float32), only=0 if (w, seq) == (1, 2) else None
        )
    ckpt, got = run.logged()
    assert got.step["torn"] == [[1, 1, 2]]
    assert got.step["pushed"] == [4, 2] and got.step["pushes"] == got.step["replayed"] == 6
    assert all(type(n) is int for n in got.step["pushed"])  # as a checkpoint's are
    for k in range(2):
        assert got.states[k]["params"].tobytes() == run.want[k].params.tobytes()
        assert list(got.states[k]["next_seq"]) == [4, 2]
    assert ckpt.step["pushes"] == 0


def test_a_push_based_on_a_torn_one_is_applied_all_the_same(tmp_path):
    """Worker 0 pulled shard 0 after worker 1's torn push was applied there, so its pushes
    name a version the replay without it does not reach: they are applied, not refused.
    Worker 0's error-feedback residual is of fewer of its pushes: zero; worker 1's stays."""
    run = Logged(tmp_path, residuals=[np.ones(6, np.float32), np.full(6, 2, np.float32)])
    run.push(1, 0, np.ones(6, np.float32), only=0)
    run.push(0, 0, np.ones(6, np.float32))
    run.push(0, 1, np.ones(6, np.float32))
    _, got = run.logged()
    assert got.step["torn"] == [[1, 1, 0]] and got.step["pushed"] == [2, 0]
    assert [r.tolist() for r in got.residuals] == [[0.0] * 6, [2.0] * 6]
    for k in range(2):
        assert list(got.states[k]["next_seq"]) == [2, 0] and got.states[k]["version"] == 2
        assert got.states[k]["params"].tobytes() == run.want[k].params.tobytes()


def test_a_departure_one_shard_logged_is_left_out_and_its_push_delivered(tmp_path):
    """BSP: shard 0 logged worker 1's departure (delivering its committed push, which
    shard 1 had as a push) and closed the round; shard 1 died first. The replay delivers
    the push without the departure: both shards close the round with both workers live."""
    run = Logged(tmp_path, consistency=sw.BSP())
    g = np.ones(6, np.float32)
    run.push(0, 0, g)
    header = sw.protocol.PushHeader(1, 0, 0, 1)
    run.live[0].depart(1, 1, (header, g[:3].copy(), sw.protocol.commit.Verdict(0, 0)))
    run.live[1].push(header, g[3:].copy())
    run.push(0, 1, g, only=0)  # the next round, begun on shard 0 alone
    _, got = run.logged()
    assert got.step["torn"] == [[0, 1, 1]] and got.step["pushed"] == [1, 1]
    for k in range(2):
        assert got.states[k]["version"] == 1 and list(got.states[k]["live"]) == [True, True]
        assert list(got.states[k]["next_seq"]) == [1, 1]


def test_logs_of_a_shard_that_could_not_write_its_own_are_not_used(tmp_path, caplog):
    """A shard whose log failed (removed, the shard went on acknowledging): the other's
    pushes would all look torn. The checkpoint alone is used, in one warning line."""
    run = Logged(tmp_path)
    for seq in range(3):
        run.push(0, seq, np.ones(6, np.float32))
    run.files[1].close()
    (tmp_path / "log-shard-1-00000001-000000").unlink()
    ckpt, got = run.logged()
    assert got.step == ckpt.step and got.states[0]["version"] == 0
    assert "log-shard-1-00000001-000000 is missing" in caplog.text


def test_logs_where_no_entry_is_common_replay_to_the_checkpoint(tmp_path):
    """The first push after the checkpoint torn (in shard 0's log only): nothing every shard
    logged, so the resume is the checkpoint's state, the push named torn."""
    run = Logged(tmp_path)
    run.push(0, 0, np.ones(6, np.float32), only=0)
    _, got = run.logged()
    assert got.step["torn"] == [[0, 1, 0]] and got.step["replayed"] == 0
    assert [int(s["version"]) for s in got.states] == [0, 0]


def test_a_garbled_log_costs_its_pushes_not_the_resume(tmp_path, caplog):
    """A log whose entry fails its checksum (not a torn end: a later entry follows) is not
    used: the checkpoint alone is, named in one warning line, as a refused checkpoint is."""
    run = Logged(tmp_path)
    for seq in range(3):
        run.push(0, seq, np.ones(6, np.float32))
    run.files[0].flush()
    path = tmp_path / "log-shard-0-00000000-000000"
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF  # in the first entry's JSON header
    path.write_bytes(bytes(data))
    ckpt, got = run.logged()
    assert got is not None and got.step == ckpt.step and got.states[0]["version"] == 0
    assert "log-shard-0-00000000-000000" in caplog.text and "not used" in caplog.text
