"""Checkpoints of a loop you own (issue #29 item 4): ``stalewise run --checkpoint-dir DIR
[--checkpoint-every N] [--resume]`` and ``sw.init(job, checkpoints=...)``.

The launcher is SIGKILLed mid-run once a checkpoint exists, started again with
``--resume``, and the run goes on from that checkpoint and its push logs (the job's pushes,
each rank's ``ctx.state``) to a loss within the noise of an uninterrupted run. Every
launcher runs in its own session and its process group is killed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import child_procs
import numpy as np
import pytest

from stalewise import checkpoint

STALEWISE = [sys.executable, "-m", "stalewise"]
TIMEOUT = 240  # seconds for one launch (a loaded machine)

# least squares with a known optimum (loss 0 at w_true); each rank draws its batches
# from its own RNG, kept in ctx.state with its count of steps (the data position)
SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import stalewise as sw

    if __name__ == "__main__":
        out, delay = sys.argv[1], float(sys.argv[2])
        data = np.random.default_rng(0)
        A = data.normal(size=(256, 8))
        b = A @ data.normal(size=8)
        job = sw.Job({"w": np.zeros(8, np.float32)}, optimizer=sw.optim.sgd(0.05))
        ctx = sw.init(job)
        state = ctx.state
        rng = np.random.default_rng(100 + ctx.rank)
        if "rng" in state:
            rng.bit_generator.state = state["rng"]
        with open(f"{out}-start-{ctx.rank}-{time.time_ns()}.json", "w") as f:
            json.dump({"steps": state.get("steps", 0), "pushes": ctx.client.job_pushes,
                       "seen": np.asarray(state.get("seen", [])).tolist()}, f)
        while not ctx.should_stop():
            w = ctx.client.pull()["w"]
            i = rng.integers(0, len(b), 16)
            g = A[i].T @ (A[i] @ w - b[i]) / len(i)
            ctx.client.push({"w": g.astype(np.float32)})
            state["steps"] = state.get("steps", 0) + 1
            state["rng"] = rng.bit_generator.state
            state["seen"] = np.asarray([state["steps"], ctx.rank], np.int64)
            time.sleep(delay)
        w = ctx.client.pull()["w"]
        ctx.close()
        with open(f"{out}-end-{ctx.rank}.json", "w") as f:
            json.dump({"loss": float(np.mean((A @ w - b) ** 2)), "steps": state.get("steps", 0)}, f)
    """
)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _launcher(tmp_path: Path, *args: str):
    """``stalewise run ARGS`` in its own session; its group is SIGKILLed at the end."""
    return child_procs.launched(tmp_path, *args)


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    with _launcher(tmp_path, *args) as proc:
        out, err = proc.communicate(timeout=TIMEOUT)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _losses(out: Path, ranks: int) -> list[float]:
    return [json.loads(Path(f"{out}-end-{r}.json").read_text())["loss"] for r in range(ranks)]


def test_a_killed_launcher_resumes_from_its_last_checkpoint(tmp_path):
    script, ckpts = _script(tmp_path), tmp_path / "ckpt"
    steps, every = 400, 40
    # the reference: the same script, uninterrupted
    ref = tmp_path / "ref"
    done = _run(tmp_path, "--workers", "2", "--steps", str(steps), str(script), str(ref), "0.005")
    assert done.returncode == 0, done.stderr
    reference = _losses(ref, 2)

    out = tmp_path / "run"
    args = ["--workers", "2", "--steps", str(steps), "--checkpoint-dir", str(ckpts)]
    args += ["--checkpoint-every", str(every), str(script), str(out), "0.005"]
    with _launcher(tmp_path, *args) as proc:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if checkpoint.exists(ckpts) and checkpoint.load(ckpts).step["pushes"] >= 2 * every:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read()
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks, at once
    saved = checkpoint.load(ckpts)
    assert every <= saved.step["pushes"] < steps, saved.step
    assert saved.version > 0 and saved.ranks is not None and len(saved.ranks) == 2
    assert all(r.get("steps", 0) > 0 for r in saved.ranks), saved.ranks
    assert not list(tmp_path.glob("run-end-*")), "the killed run ended"

    for f in tmp_path.glob("run-start-*"):
        f.unlink()
    done = _run(tmp_path, *args[:-3], "--resume", *args[-3:])
    assert done.returncode == 0, done.stderr
    assert f"resumed from {saved.path}" in done.stderr, done.stderr
    starts = {}
    for f in tmp_path.glob("run-start-*"):
        starts[int(f.name.split("-")[2])] = json.loads(f.read_text())
    assert sorted(starts) == [0, 1], starts
    for r, start in starts.items():  # ctx.state restored per rank, the job's pushes go on
        # from the checkpoint and the push logs after it (test_one_cut: exactly)
        assert start["steps"] >= saved.ranks[r]["steps"], (start, saved.ranks[r])
        assert start["seen"] == [start["steps"], r], start
        assert start["pushes"] >= saved.step["pushes"], (start, saved.step)
    final = checkpoint.load(ckpts)  # the end's checkpoint: the budget, not more
    assert final.version > saved.version
    assert steps <= final.step["pushes"] <= steps + 1, final.step
    ends = [json.loads(Path(f"{out}-end-{r}.json").read_text()) for r in range(2)]
    # fewer steps this run than a whole run's: it went on from the checkpoint, not from 0
    assert sum(e["steps"] for e in ends) - sum(s["steps"] for s in starts.values()) < steps
    start_loss = float(np.mean((np.random.default_rng(0).normal(size=(256, 8)) @ np.zeros(8)) ** 2))
    losses = _losses(out, 2)
    # within the noise of the uninterrupted run: both near the optimum (loss 0)
    assert max(losses) < 1e-3 * max(start_loss, 1.0), (losses, reference)
    assert max(reference) < 1e-3 * max(start_loss, 1.0), reference


def test_resume_starts_from_the_start_without_a_checkpoint_and_refuses_another_jobs(tmp_path):
    """--resume with no checkpoint in the folder yet starts from the start (the run's end
    saves one); again, its budget spent, it says so; from it, a job of other parameters
    is refused in one line."""
    script, ckpts, out = _script(tmp_path), tmp_path / "ckpt", tmp_path / "run"
    other = tmp_path / "other.py"
    other.write_text(SCRIPT.replace("np.zeros(8, np.float32)", "np.zeros(5, np.float32)")
                     .replace("A @ w - b", "A[:, :5] @ w - b").replace("A[i] @ w", "A[i, :5] @ w")
                     .replace("A[i].T @", "A[i, :5].T @"))  # fmt: skip
    done = _run(tmp_path, "--workers", "2", "--steps", "40", "--checkpoint-dir", str(ckpts),
                "--resume", str(other), str(out), "0")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"no checkpoint in {ckpts} yet; starting from the start" in done.stderr
    assert checkpoint.load(ckpts).step["pushes"] >= 40  # the end's checkpoint
    pushes = checkpoint.load(ckpts).step["pushes"]
    for f in tmp_path.glob("run-start-*"):
        f.unlink()
    done = _run(tmp_path, "--workers", "2", "--steps", "40", "--checkpoint-dir", str(ckpts),
                "--resume", str(other), str(out), "0")  # fmt: skip
    assert done.returncode == 0, done.stderr  # its budget is spent: it says so, starts no rank
    assert f"the job is complete: {pushes} of 40 pushes, as checkpointed in {ckpts}; no rank " \
        "started" in done.stderr, done.stderr  # fmt: skip
    assert not list(tmp_path.glob("run-start-*"))
    done = _run(tmp_path, "--workers", "2", "--steps", "20", "--checkpoint-dir", str(ckpts),
                "--resume", str(script), str(out), "0")  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is of another job" in lines[0], done.stderr


def test_init_checkpoints_and_resumes_in_one_process(tmp_path):
    """Without the launcher, ``sw.init(job, checkpoints=sw.Checkpoints(...))`` serves the
    job here, saves every N pushes and at the end, and resumes from it."""
    text = SCRIPT.replace(
        "ctx = sw.init(job)",
        f"ctx = sw.init(job, steps=60, checkpoints=sw.Checkpoints({str(tmp_path / 'ckpt')!r}, "
        "every=20, resume=True))",
    )
    script, out = tmp_path / "own.py", tmp_path / "own"
    script.write_text(text)
    for want in (60, 60):  # the second run resumes at the budget: nothing left to do
        done = subprocess.run([sys.executable, str(script), str(out), "0"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
        assert done.returncode == 0, done.stderr
        ckpt = checkpoint.load(tmp_path / "ckpt")
        assert ckpt.step["pushes"] == want and ckpt.ranks[0]["steps"] == 60, ckpt.step


def test_a_bsp_job_saved_mid_round_resumes_that_round(tmp_path):
    """Saved while worker 1 still owed a BSP round (worker 0's push waiting in it), the
    resumed job keeps the round: both workers rejoin, worker 1's push closes it with the
    mean of the two, as in the run that was never stopped. (A rejoin that departed the
    old incarnation first closed the round with worker 0's push alone.)"""
    import stalewise as sw

    def serve(resume=False):
        job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.5),
                     consistency=sw.BSP())  # fmt: skip
        return job.serve(workers=2, checkpoints=sw.Checkpoints(tmp_path, every=1000,
                                                               resume=resume))  # fmt: skip

    def push(client, value):
        client.pull(timeout=30)
        client.push({"w": np.full(3, value, np.float32)})
        client.wait()

    with serve() as server:
        first = [server.client(w) for w in range(2)]
        push(first[0], 1.0)
        push(first[1], 2.0)
        push(first[0], 6.0)  # round 2: worker 1's push is still owed
        assert server.stats()[0]["version"] == 1 and server.job_pushes == 3
    with serve(resume=True) as server:
        again = [server.client(w) for w in range(2)]
        assert server.stats()[0]["version"] == 1  # the joins closed no round
        push(again[1], 8.0)
        assert server.stats()[0]["version"] == 2
        # rounds of means 1.5 and 7 at a learning rate of 0.5
        np.testing.assert_allclose(server.pull()["w"], np.full(3, -4.25), rtol=1e-6)
        for c in again:
            c.close()


@pytest.mark.parametrize("args", [["--resume"], ["--checkpoint-every", "5"]])
def test_checkpoint_flags_need_a_directory(tmp_path, args):
    script = _script(tmp_path)
    done = _run(tmp_path, "--workers", "1", *args, str(script), "x", "0")
    assert done.returncode == 2 and "--checkpoint-dir" in done.stderr, done.stderr


# -- job.serve + sw.attach: the same checkpoints, for processes you start yourself ----------

SERVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import stalewise as sw

    name, ckpts = sys.argv[1], sys.argv[2]
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.adam(0.1))
    with job.serve(workers=(0, 1), name=name,
                   checkpoints=sw.Checkpoints(ckpts, every=4, resume=True)) as server:
        version = server.stats()[0]["version"]
        print("served", version, server.job_pushes, *server.pull()["w"].tolist(), flush=True)
        sys.stdin.readline()
    print("closed", flush=True)
    """
)

PUSHER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import stalewise as sw

    client = sw.attach(sys.argv[1])
    for i in range(int(sys.argv[2])):
        client.pull(timeout=60)
        client.push({"w": np.array([1.0, -2.0, 0.5], np.float32) * (1 + i % 3)})
    client.close()
    """
)


def _reference(pushes) -> np.ndarray:
    """The params after PUSHER's pushes numbered ``pushes`` (each attached process counts
    its own from 0), served in this process: what a resumed job must continue."""
    import stalewise as sw

    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.adam(0.1))
    with job.serve(workers=1) as server:
        client = server.client(0)
        for i in pushes:
            client.pull(timeout=60)
            client.push({"w": np.array([1.0, -2.0, 0.5], np.float32) * (1 + i % 3)})
        client.wait()
        client.close()
        return server.pull()["w"]


def _serve(tmp_path: Path, name: str, ckpts: Path) -> subprocess.Popen:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(script), name, str(ckpts)], cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    proc.lines = queue.Queue()  # its output, line by line, read on a thread ("": it ended)
    threading.Thread(target=lambda: [*map(proc.lines.put, proc.stdout), proc.lines.put("")],
                     daemon=True).start()  # fmt: skip
    return proc


def _line(proc: subprocess.Popen) -> list[str]:
    try:
        return proc.lines.get(timeout=TIMEOUT).split()
    except queue.Empty:
        pytest.fail(f"no line from the server within {TIMEOUT} s")


def _push(tmp_path: Path, name: str, n: int) -> None:
    script = tmp_path / "pusher.py"
    script.write_text(PUSHER)
    done = subprocess.run([sys.executable, str(script), name, str(n)], capture_output=True,
                          text=True, timeout=TIMEOUT)  # fmt: skip
    assert done.returncode == 0, done.stderr


def _served(proc: subprocess.Popen) -> tuple[int, int, np.ndarray]:
    words = _line(proc)
    assert words[:1] == ["served"], words or proc.communicate(timeout=30)[1]
    return int(words[1]), int(words[2]), np.array(words[3:], np.float32)


def _stop(proc: subprocess.Popen, how: str) -> None:
    try:
        if how == "kill":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            assert _line(proc) == ["closed"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()


def test_serve_checkpoints_and_resumes_for_processes_you_attach(tmp_path):
    """``job.serve(checkpoints=sw.Checkpoints(dir, every=, resume=))``: a process attaches and
    pushes; the server saves every 4 pushes; it is SIGKILLed, served again with resume,
    and its versions, push count, params and Adam state go on from the last periodic
    checkpoint; closed in order, it saves a last checkpoint that the next serve resumes."""
    ckpts, tag = tmp_path / "ckpt", uuid.uuid4().hex[:8]
    first = _serve(tmp_path, f"ckpt-{tag}-a", ckpts)
    try:
        assert _served(first)[:2] == (0, 0)  # nothing to resume yet: from the start
        _push(tmp_path, f"ckpt-{tag}-a", 10)
        deadline = time.monotonic() + TIMEOUT
        while not (checkpoint.exists(ckpts) and checkpoint.load(ckpts).step["pushes"] >= 8):
            assert time.monotonic() < deadline, "no periodic checkpoint at 8 pushes"
            time.sleep(0.05)
    finally:
        _stop(first, "kill")
    saved = checkpoint.load(ckpts)
    done = saved.step["pushes"]
    assert 8 <= done <= 10 and saved.version == done, saved.step

    second = _serve(tmp_path, f"ckpt-{tag}-b", ckpts)
    try:
        version, pushes, params = _served(second)
        assert (version, pushes) == (done, done)
        np.testing.assert_allclose(params, _reference(range(done)), rtol=1e-6)
        _push(tmp_path, f"ckpt-{tag}-b", 3)
    finally:
        _stop(second, "close")
    final = checkpoint.load(ckpts)  # the last one, written as the server closed
    assert final.step["pushes"] == done + 3 and final.version == done + 3, final.step

    third = _serve(tmp_path, f"ckpt-{tag}-c", ckpts)
    try:
        version, pushes, params = _served(third)
    finally:
        _stop(third, "close")
    assert (version, pushes) == (done + 3, done + 3)
    # Adam's moments came back too: the params are those of one uninterrupted sequence
    np.testing.assert_allclose(params, _reference([*range(done), 0, 1, 2]), rtol=1e-6)


def test_serve_refuses_checkpoint_settings_that_do_not_fit(tmp_path):
    import stalewise as sw

    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match="checkpoint_dir is for runtime='local'"):
        job.serve(workers=1, runtime="ray", checkpoints=sw.Checkpoints(tmp_path))
