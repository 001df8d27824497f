"""A SIGKILLed ``Job.train`` parent (its shards and workers die with it) loses no
acknowledged push after a resume, and every batch is applied exactly once (issue #45,
bar 3): the resume replays the shards' push logs and each worker's data stream goes on
right after the batches of its last push the replayed shards hold.

The one-hot job: worker ``w``'s ``i``-th batch adds exactly 1 to item ``(w, i)``, so an
item applied twice or skipped shows in the final parameters. The batch function records,
per worker, the highest batch whose computation began: a worker has one push in flight at
most, so every push up to two before that one was acknowledged, and the state the next run
starts from (which its ``evaluate`` writes down) must hold them."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import child_procs
import numpy as np
import pytest

from stalewise import checkpoint
from stalewise.checkpoint import replay, resume, store

STEPS, EVERY, WORKERS, KILLS = 1500, 50, 2, 3
H = {"asp": 1, "bsp": 1, "local_sgd": 3}  # batches per push
ROW = 3 * (STEPS + WORKERS)  # items per worker: up to workers - 1 pushes pass the budget
TIMEOUT = 180  # seconds for one run (a loaded machine)

ONEHOT = textwrap.dedent(
    """
    import itertools, os, struct, time
    import numpy as np
    import stalewise as sw

    def data(worker, workers):
        return ((worker, i) for i in itertools.count())

    class OneHot:
        '''Batch (w, i) adds 1 to item (w, i); the highest i begun is written to begun-A-W.'''

        def __init__(self, folder, attempt, workers, row):
            self.folder, self.attempt, self.workers, self.row = folder, attempt, workers, row
            self.fd, self.top = None, -1

        def __call__(self, params, batch):
            w, i = batch
            if i > self.top:  # before the computation: a kill cannot hide it
                if self.fd is None:
                    path = os.path.join(self.folder, f"begun-{self.attempt}-{w}")
                    self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                self.top = i
                os.pwrite(self.fd, struct.pack("<q", i), 0)
            time.sleep(0.003)
            g = np.zeros((self.workers, self.row), np.float32)
            g[w, i] = -1.0
            return 0.0, {"items": g}

    def job(kind, workers, row):
        # BSP applies a round's mean: a learning rate of `workers` makes each item 1; local
        # SGD (inner sgd(1)) pushes the sum of its 3 steps, 1 on each of their items
        return sw.Job({"items": np.zeros((workers, row), np.float32)}, shards=2,
                      optimizer=sw.optim.sgd(float(workers) if kind == "bsp" else 1.0),
                      consistency=sw.BSP() if kind == "bsp" else sw.ASP(),
                      strategy=sw.strategies.local_sgd(3, sw.optim.sgd(1.0))
                      if kind == "local_sgd" else None)

    class First:
        '''evaluate: writes the parameters the run starts from (its first call).'''

        def __init__(self, path):
            self.path = path

        def __call__(self, params):
            if not os.path.exists(self.path):
                np.save(self.path, params["items"])
            return {}
    """
)

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import stalewise as sw
    from onehot import First, OneHot, data, job

    if __name__ == "__main__":
        attempt, kind, steps, row, every = int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:])
        job(kind, 2, row).train(
            OneHot(os.getcwd(), attempt, 2, row), data=data, workers=2, steps=steps,
            evaluate=First(f"start-{attempt}.npy"), metrics=sw.Metrics(every=0.2),
            checkpoints=sw.Checkpoints("ckpt", every=every, keep=100, resume=attempt > 0),
            timeouts=sw.Timeouts(total=150))
    """
)


@contextlib.contextmanager
def started(cwd, attempt: int, kind: str):
    """The child job in its own session (:func:`child_procs.session`)."""
    args = [str(attempt), kind, str(STEPS // H[kind]), str(ROW), str(EVERY)]
    with (
        open(cwd / f"stderr-{attempt}", "w") as err,
        child_procs.session(
            [sys.executable, "job.py", *args], cwd, stderr=err, stdout=subprocess.DEVNULL
        ) as proc,
    ):
        yield proc


def begun(folder, attempt: int) -> list[int]:
    """Each worker's highest batch whose computation began in run ``attempt`` (-1: none)."""
    out = []
    for w in range(WORKERS):
        path = folder / f"begun-{attempt}-{w}"
        data = path.read_bytes()[:8] if path.exists() else b""
        out.append(int.from_bytes(data, "little", signed=True) if len(data) == 8 else -1)
    return out


def check_once(items: np.ndarray, what: str) -> list[int]:
    """Each worker's items are 1 up to some count, then 0; returns the counts."""
    counts = []
    for w in range(WORKERS):
        n = int(np.count_nonzero(items[w]))
        twice = np.flatnonzero(items[w] > 1.5).tolist()
        skipped = np.flatnonzero(items[w, :n] < 0.5).tolist()
        assert not twice and not skipped, f"{what}: worker {w}: twice {twice}, skipped {skipped}"
        np.testing.assert_array_equal(items[w, :n], 1.0)
        counts.append(n)
    return counts


@pytest.mark.parametrize("kind", ["asp", "bsp", "local_sgd"])
def test_a_killed_parent_resumes_with_every_acknowledged_push_and_each_batch_once(tmp_path, kind):
    (tmp_path / "onehot.py").write_text(ONEHOT)
    (tmp_path / "job.py").write_text(SCRIPT)
    rng, h = random.Random(f"{kind}-45"), H[kind]
    ckpts, acked, before = tmp_path / "ckpt", [0] * WORKERS, {}
    for attempt in range(KILLS + 1):
        if attempt == KILLS:  # the last run's checkpoints: each replays to the end
            before = {p.name: p.stat().st_mtime_ns for p in ckpts.glob("ckpt-*")}
        with started(tmp_path, attempt, kind) as proc:
            if attempt < KILLS:  # killed at a random moment once it has gone on a while
                deadline = time.monotonic() + TIMEOUT
                goal = [b + rng.randint(30, 120) for b in begun(tmp_path, attempt - 1)]
                while proc.poll() is None and time.monotonic() < deadline:
                    if any(b >= g for b, g in zip(begun(tmp_path, attempt), goal, strict=True)):
                        break
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, 0.3))
                if proc.poll() is None:  # (if it ended first, the returncode check fails)
                    kids = child_procs.descendants(proc.pid)
                    proc.send_signal(signal.SIGKILL)  # the parent alone: the rest die with it
                    assert not child_procs.left(kids, 30), "a process outlived the parent"
            proc.wait(timeout=TIMEOUT)
        err = (tmp_path / f"stderr-{attempt}").read_text()
        assert proc.returncode == (0 if attempt == KILLS else -signal.SIGKILL), err
        assert "no data position" not in err, err
        if (tmp_path / f"start-{attempt}.npy").exists():  # else killed before it started
            # the state this run started from holds every push acknowledged before
            held = check_once(np.load(tmp_path / f"start-{attempt}.npy"), f"run {attempt}")
            for w in range(WORKERS):
                assert held[w] >= acked[w], (
                    f"run {attempt} started from {held[w]} items of worker {w}; the pushes "
                    f"of {acked[w]} were acknowledged before the kill"
                )
        # a batch of push m begun: pushes up to m - 2 were acknowledged (one in flight)
        done = begun(tmp_path, attempt)
        acked = [max(h * (b // h - 1), a) for b, a in zip(done, acked, strict=True)]
    final = checkpoint.load(ckpts)
    counts = check_once(final.flat().reshape(WORKERS, ROW), "the end")
    assert sum(counts) == h * final.step["pushes"] >= h * (STEPS // h), (counts, final.step)
    sys.path.insert(0, str(tmp_path))
    try:
        import onehot

        config = onehot.job(kind, WORKERS, ROW).config
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("onehot", None)
    new = [p.name for p in ckpts.glob("ckpt-*") if before.get(p.name) != p.stat().st_mtime_ns]
    assert new, "the last run wrote no checkpoint"
    for name in new:  # the log chains of the last run's checkpoints reach its end
        flat, _, _ = replay.replay(ckpts, config, name)
        assert flat.tobytes() == final.flat().tobytes(), name


def test_positions_keep_a_predecessors_last_two_and_read_only_a_trusted_file(tmp_path, caplog):
    """The file the resume reads each worker's position from (no processes): a successor's
    first entries leave its predecessor's last two, a symlink is neither read nor written."""
    first = resume.Positions(tmp_path, 0, 1)
    for seq, drawn in [(-1, 5), (0, 10), (1, 11), (2, 12), (3, 13)]:
        first.write(seq, drawn)
    second = resume.Positions(tmp_path, 0, 2)
    second.write(-1, 13)
    second.write(0, 20)
    at = [resume._position(tmp_path, 0, 1, s) for s in (1, 2, 3)]
    assert at == [None, 12, 13]
    assert [resume._position(tmp_path, 0, 2, s) for s in (-1, 0)] == [13, 20]
    (tmp_path / "drawn-worker-1").symlink_to(tmp_path / "drawn-worker-0")
    assert resume._position(tmp_path, 1, 2, 0) is None
    with pytest.raises(OSError):
        resume.Positions(tmp_path, 1, 3)
    seats = {"incarnation": np.array([2, 2]), "next_seq": np.array([1, 1])}
    ckpt = store.Checkpoint([seats], {"step": {"drawn": [7, 8], "replayed": 3}}, tmp_path / "c")
    with caplog.at_level("WARNING"):
        assert resume.drawn_of(ckpt, 2) == [20, 8]  # worker 1's file is a symlink: not read
    assert "no data position of worker(s) [1]" in caplog.text


def test_a_checkpoint_folder_others_can_write_costs_the_positions_not_the_run(tmp_path, caplog):
    """A folder made group-writable (mkdir under umask 002): the workers write no data
    positions there, say so, and train; the run ends as without a folder."""
    import stalewise as sw

    folder = tmp_path / "ckpt"
    folder.mkdir(0o775)
    os.chmod(folder, 0o775)
    job = sw.Job({"w": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1))
    result = job.train(_ones, data=[[0], [0]],
                       workers=2, steps=20, checkpoints=sw.Checkpoints(folder, every=10))  # fmt: skip
    assert result.stats["applied"] >= 20
    assert not list(folder.glob("drawn-worker-*"))


def _ones(params, batch):
    return 0.0, {"w": np.ones(4, np.float32)}
