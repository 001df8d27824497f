"""``stalewise run`` and ``sw.init``: a script you own, run once per worker process.

Real launches in subprocesses: the launcher runs the script up to ``sw.init``,
serves its job and runs the script again in each worker process.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import child_procs
import mp_helpers
import numpy as np
import pytest

import stalewise as sw
from stalewise.launch import RENDEZVOUS_TIMEOUT, STOP_GRACE

STALEWISE = [sys.executable, "-m", "stalewise"]
TIMEOUT = 240

# A plain least-squares loop made a launched job: the lines marked "# sw" are the change.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import stalewise as sw

    rng = np.random.default_rng(0)
    A = rng.normal(size=(256, 16)).astype(np.float32)
    x_star = rng.normal(size=16).astype(np.float32)
    b = A @ x_star

    def loss(x):
        return float(0.5 * ((A @ x - b) ** 2).mean())

    if __name__ == "__main__":
        out = sys.argv[1]
        params = {"x": np.zeros(16, np.float32)}
        job = sw.Job(params, optimizer=sw.optim.sgd(0.1))  # sw
        ctx = sw.init(job, steps=int(sys.argv[2]) if len(sys.argv) > 2 else None)  # sw
        if "RAISE" in out and ctx.rank == 1:
            raise ValueError("rank 1 cannot train")
        gen = np.random.default_rng(ctx.rank)
        pushes = 0
        while not ctx.should_stop():  # sw
            x = ctx.client.pull()["x"]  # sw
            idx = gen.integers(0, len(A), 32)
            grad = A[idx].T @ (A[idx] @ x - b[idx]) / len(idx)
            ctx.client.push({"x": grad.astype(np.float32)})  # sw
            pushes += 1
        final = ctx.client.pull()["x"]
        ctx.close()
        with open(f"{out}-{ctx.rank}.json", "w") as f:
            json.dump({"rank": ctx.rank, "world": ctx.world_size, "pushes": pushes,
                       "launched": ctx.launched, "loss": loss(final), "start": loss(0 * final)}, f)
    """
)


def _script(tmp_path: Path, text: str = SCRIPT) -> Path:
    path = tmp_path / "train.py"
    path.write_text(text)
    return path


def _exec(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs ``cmd`` to its end, its output captured (``env``: its whole environment)."""
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _run(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``stalewise ARGS``, to its end."""
    return _exec([*STALEWISE, *args], cwd, env)


def _reports(out: Path, ranks: int) -> list[dict]:
    return [json.loads(Path(f"{out}-{r}.json").read_text()) for r in range(ranks)]


def test_stalewise_run_runs_the_script_once_per_worker_to_the_budget(tmp_path, no_leaks):
    script, out = _script(tmp_path), tmp_path / "report"
    done = _run("run", "--workers", "3", "--steps", "150", str(script), str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    reports = _reports(out, 3)
    assert [(r["rank"], r["world"], r["launched"]) for r in reports] == [
        (0, 3, True),
        (1, 3, True),
        (2, 3, True),
    ]
    total = sum(r["pushes"] for r in reports)
    assert 150 <= total <= 150 + 2, reports  # overshoot: the pushes in flight at the budget
    assert all(r["pushes"] > 0 for r in reports), reports  # every worker trained
    assert all(r["loss"] < 1e-2 * r["start"] for r in reports), reports
    assert done.stderr.strip().splitlines()[-1] == f"stalewise run: 3 workers done, {total} pushes"


def test_the_same_script_without_the_launcher_trains_as_one_worker(tmp_path, no_leaks):
    script, out = _script(tmp_path), tmp_path / "report"
    done = _exec([sys.executable, str(script), str(out), "100"], tmp_path)
    assert done.returncode == 0, done.stderr
    (report,) = _reports(out, 1)
    assert (report["rank"], report["world"], report["launched"]) == (0, 1, False)
    assert report["pushes"] == 100 and report["loss"] < 1e-2 * report["start"]


def test_workers_that_fail_before_or_after_init_make_the_launcher_fail_naming_them(
    tmp_path, no_leaks
):
    """Rank 1 raises after sw.init, rank 2 before it: the start barrier is broken at once
    (rank 2 does not hold the others), the launcher names both, and rank 0 carries on to
    the budget alone."""
    text = SCRIPT.replace(
        "    out = sys.argv[1]\n",
        "    out = sys.argv[1]\n"
        "    if os.environ.get('STALEWISE_RANK') == '2':\n"
        "        raise ImportError('rank 2 lacks a package')\n",
    ).replace("import json, sys", "import json, os, sys")
    script, out = _script(tmp_path, text), tmp_path / "RAISE"
    start = time.monotonic()
    done = _run("run", "--workers", "3", "--steps", "60", str(script), str(out), cwd=tmp_path)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr  # a line each; tracebacks in files
    one = re.search(
        r"stalewise run: rank 1 failed: ValueError: rank 1 cannot train "
        r"\(train.py, line \d+\); traceback in (\S+)\n",
        done.stderr,
    )
    assert one, done.stderr
    assert 'raise ValueError("rank 1 cannot train")' in Path(one.group(1)).read_text()
    assert re.search(
        r"stalewise run: rank 2 failed: ImportError: rank 2 lacks a package \(train.py, line",
        done.stderr,
    ), done.stderr
    assert _reports(out, 1)[0]["pushes"] >= 60  # rank 0 carried on to the budget alone
    assert time.monotonic() - start < 0.5 * RENDEZVOUS_TIMEOUT  # not held at the barrier
    last = done.stderr.strip().splitlines()[-1]  # and the last line counts the failed ranks
    assert re.fullmatch(r"stalewise run: 1 of 3 workers done, 2 failed, \d+ pushes", last), last


LAUNCH_ERRORS = [
    (["--workers", "0", "train.py"], "--workers must be an integer in 1..256, got 0"),
    (["--steps", "0", "train.py"], "--steps must be an integer >= 1, got 0"),
    (["missing.py"], "missing.py: no such script"),
    (["/bin/true"], "/bin/true is not valid Python: source code string cannot contain null"),
    (["typo.py"], "typo.py is not valid Python: '(' was never closed at line 1"),
    (["--timeout", "0", "train.py"], "--timeout must be a number of seconds > 0, got 0.0"),
    (["--rank-timeout", "-1", "train.py"], "--rank-timeout must be a number of seconds >= 0"),
    (
        ["--runtime", "ray", "--rank-timeout", "5", "train.py"],
        "--rank-timeout is for --runtime local",
    ),
    (["--address", "auto", "train.py"], "--address is for --runtime ray"),
    (["--name", "a b", "train.py"], "--name: job name 'a b': use 1-64 letters, digits"),
    (["--env", "DATA", "train.py"], "--env is for --runtime ray"),
    (["--env-all", "train.py"], "--env-all is for --runtime ray"),
    (["noinit.py"], "noinit.py ended without calling sw.init(job)"),  # last: it runs the script
]

# One interpreter runs ``stalewise run ARGS`` of every case above in turn (each refused
# before any job starts, so the cases are independent): the command's exit status, and
# what reached file descriptor 2 while it ran (not just sys.stderr), a JSON line each.
LAUNCH_ERRORS_CHILD = """
import json, os, sys, tempfile
from stalewise.cli import main

for args in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile("w+") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            code = main(["run", *args])
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        print("CASE", json.dumps([code, err.read()]), flush=True)
"""


@pytest.fixture(scope="module")
def launch_errors(tmp_path_factory) -> list[tuple[int, str]]:
    """Each case's (exit status, stderr), from one interpreter."""
    tmp_path = tmp_path_factory.mktemp("errors")
    _script(tmp_path)
    (tmp_path / "noinit.py").write_text("print('training without stalewise')\n")
    (tmp_path / "typo.py").write_text("print('a typo'\n")
    cases = json.dumps([args for args, _ in LAUNCH_ERRORS])
    done = _exec([sys.executable, "-c", LAUNCH_ERRORS_CHILD, cases], tmp_path)
    assert done.returncode == 0, done.stderr
    found = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("CASE ")]
    assert len(found) == len(LAUNCH_ERRORS), done.stdout + done.stderr
    return found


@pytest.mark.parametrize("case", range(len(LAUNCH_ERRORS)), ids=[m for _, m in LAUNCH_ERRORS])
def test_launch_errors_are_one_line(launch_errors, case):
    code, stderr = launch_errors[case]
    message = LAUNCH_ERRORS[case][1]
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"stalewise: run: {message}"), stderr


def test_a_worker_whose_job_differs_from_the_launchers_is_refused(tmp_path, no_leaks):
    text = SCRIPT.replace(
        'params = {"x": np.zeros(16, np.float32)}',
        'params = {"x": np.zeros(16 if "STALEWISE_RANK" not in os.environ else 8, np.float32)}',
    ).replace("import json, sys", "import json, os, sys")
    script, out = _script(tmp_path, text), tmp_path / "report"
    done = _run("run", "--workers", "2", "--steps", "20", str(script), str(out), cwd=tmp_path)
    assert done.returncode == 1
    assert "parameters differ from the launcher's" in done.stderr
    assert "stalewise run: rank 0 failed" in done.stderr


def test_init_checks_its_arguments():
    with pytest.raises(TypeError, match=r"^sw.init\(job\): job must be a sw.Job, got dict$"):
        sw.init({"x": np.zeros(2)})
    job = sw.Job({"x": np.zeros(2, np.float32)}, optimizer=sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"^sw.init: steps must be an integer >= 1 or None"):
        sw.init(job, steps=0)
    assert "STALEWISE_RANK" not in os.environ


LINES = textwrap.dedent(
    """
    import numpy as np
    import stalewise as sw

    if __name__ == "__main__":
        ctx = sw.init(sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1)))
        for i in range(300):
            print(f"rank {ctx.rank} line {i}")
    """
)


def test_workers_lines_stay_whole_when_python_is_unbuffered(tmp_path, no_leaks):
    """PYTHONUNBUFFERED=1: print's text and newline are two writes; the workers, sharing
    the launcher's stdout, would tear each other's lines without line buffering."""
    script = _script(tmp_path, LINES)
    unbuffered = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = _run("run", "--workers", "3", "--steps", "1", str(script), cwd=tmp_path, env=unbuffered)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    expected = {f"rank {r} line {i}" for r in range(3) for i in range(300)}
    assert len(lines) == len(expected) and set(lines) == expected, done.stdout[-2000:]


# Ranks that poll ctx.should_stop(), sleep in user code, or hang before or after pushing.
TOY = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import stalewise as sw

    if __name__ == "__main__":
        mode = sys.argv[1]
        ctx = sw.init(sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1)))
        print(f"rank {ctx.rank} ready", flush=True)
        if mode == "sleep" or (mode == "hang" and ctx.rank == 1):
            time.sleep(3600)
        if mode == "liveness" and ctx.rank == 2:
            time.sleep(6)  # its first push comes late (as after a long import)
        if mode == "poll":
            while not ctx.should_stop():
                time.sleep(0.05)
        else:  # push, liveness (3 times, then it sleeps: rank 1 of liveness, 2 of hang)
            n = 0
            while not ctx.should_stop():
                ctx.client.pull()
                ctx.client.push({"x": np.ones(4, np.float32)})
                ctx.log(loss=float(ctx.rank))  # the progress line shows the ranks' mean
                n += 1
                if n == 3 and ctx.rank == {"liveness": 1, "hang": 2}.get(mode):
                    time.sleep(3600)
                time.sleep(0.01)
        ctx.close()
    """
)


def _default_sigint() -> None:
    """In the launcher's process before it starts: Ctrl-C at its default, whatever the
    test runner's (a background job of a non-interactive shell starts with it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Launcher:
    """``stalewise run`` as a subprocess in its own session, its processes tagged through
    the environment; reads its stdout lines as they come. On exit, every process of the
    job that is left is killed, whatever the test found."""

    def __init__(self, tmp_path: Path, *args: str):
        self.tag = f"stalewise-launch-{os.getpid()}-{time.time_ns()}"
        self.proc = subprocess.Popen(
            [*STALEWISE, "run", *args],
            cwd=tmp_path,
            env={**os.environ, "STALEWISE_TEST_TAG": self.tag},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its process group: ours to signal and to clean up
            preexec_fn=_default_sigint,
        )
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put)),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err.append)),
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def wait_ready(self, ranks: int, timeout: float = 120) -> None:
        deadline, ready = time.monotonic() + timeout, set()
        while len(ready) < ranks:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ranks ready: {sorted(ready)}; {self.stderr()}") from None
            if line.endswith(" ready"):
                ready.add(line)

    def job(self) -> set[int]:
        """The live processes of the job (the launcher's too)."""
        return set(mp_helpers.tagged_pids(self.tag))

    def stderr(self, timeout: float = 30) -> str:
        for t in self._readers:
            t.join(timeout)
        return "\n".join(self.err)

    def __enter__(self) -> _Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.job():  # a rank that left the group would still hold the tag
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for t in self._readers:
            t.join(10)
        self.proc.stdout.close(), self.proc.stderr.close()


def _shared_files(pids: set[int]) -> set[str]:
    """The files in /dev/shm that ``pids`` have mapped or open (named blocks, semaphores)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            found |= {line.split()[-1] for line in f if "/dev/shm/" in line}
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if (target := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("/dev/shm/"):
                        found.add(target)
    return found


def _children(pid: int) -> set[int]:
    """The children of ``pid`` (from /proc)."""
    kids = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                kids |= {int(c) for c in f.read().split()}
    return kids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_launcher_leaves_no_rank_shard_tracker_or_block(tmp_path, sig):
    """Ranks that only poll ctx.should_stop() end with the launcher: SIGKILL (the ranks'
    and shards' parent-death signal) or SIGTERM (an orderly stop, as Ctrl-C)."""
    script = _script(tmp_path, TOY)
    with _Launcher(tmp_path, "--workers", "2", str(script), "poll") as launcher:
        launcher.wait_ready(2)
        job = launcher.job() - {launcher.proc.pid}
        assert job == _children(launcher.proc.pid)  # found through the environment and /proc
        names = {Path(f"/proc/{pid}/cmdline").read_bytes() for pid in job}
        assert len(job) == 4, names  # 2 ranks, 1 shard, multiprocessing's resource tracker
        assert any(b"resource_tracker" in n for n in names), names
        files = _shared_files(job | {launcher.proc.pid})
        launcher.proc.send_signal(sig)
        launcher.proc.wait(STOP_GRACE + 30)
        left = child_procs.left(job, 5.0)
        assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left]
        assert not [f for f in files if os.path.exists(f)]
        assert not [
            f for f in os.listdir("/dev/shm") if f.startswith(f"stalewise-{launcher.proc.pid}-")
        ]
        if sig == signal.SIGTERM:
            err = launcher.stderr()
            assert launcher.proc.returncode == 143, err
            assert "Traceback" not in err, err
            assert "stalewise: run: terminated (SIGTERM)" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc (Linux)")
def test_ctrl_c_stops_ranks_sleeping_in_user_code_with_a_line_each(tmp_path):
    """Ctrl-C in a terminal reaches every process of its group: ranks asleep in user code
    say so in one line each, no traceback; the launcher stops the job and exits 130."""
    script = _script(tmp_path, TOY)
    with _Launcher(tmp_path, "--workers", "2", str(script), "sleep") as launcher:
        launcher.wait_ready(2)
        job = launcher.job() - {launcher.proc.pid}
        os.killpg(launcher.proc.pid, signal.SIGINT)
        launcher.proc.wait(STOP_GRACE + 30)
        err = launcher.stderr()
        assert launcher.proc.returncode == 130, err
        assert "Traceback" not in err and "ServerClosed" not in err, err
        lines = err.splitlines()
        assert len(lines) <= 2 + 2, err  # a line per rank at most, and the launcher's
        assert "stalewise: interrupted" in lines, err
        assert not child_procs.left(job, 5.0)


# The two launches of TOY that mostly sleep (until --timeout; towards a budget of 10 ms
# steps): each mode's flags and how long the test waits for the launcher to end
SLEEPY = {
    "hang": (["--workers", "3", "--steps", "40", "--timeout", "10"], 10 + STOP_GRACE + 60),
    "liveness": (
        ["--workers", "3", "--steps", "800", "--timeout", "120", "--rank-timeout", "3"],
        180,
    ),
}


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory) -> dict[str, tuple[int, str, float]]:
    """SLEEPY's launches, the two at once, each in a folder of its own: per mode the
    launcher's exit code, its stderr and the seconds from its start to its end."""
    started, ended, launchers = {}, {}, {}
    with contextlib.ExitStack() as stack:
        for mode, (flags, _) in SLEEPY.items():
            script = _script(tmp_path_factory.mktemp(mode), TOY)
            started[mode] = time.monotonic()
            launchers[mode] = stack.enter_context(
                _Launcher(script.parent, *flags, str(script), mode)
            )
        waiting = set(SLEEPY)
        while waiting:  # each one's end, as it comes (None: still running after its wait)
            for mode in list(waiting):
                now = time.monotonic()
                if launchers[mode].proc.poll() is not None or now > started[mode] + SLEEPY[mode][1]:
                    ended[mode] = now
                    waiting.remove(mode)
            time.sleep(0.05)
        return {
            mode: (launcher.proc.returncode, launcher.stderr(), ended[mode] - started[mode])
            for mode, launcher in launchers.items()
        }


def test_hung_ranks_end_the_run_at_timeout_naming_them(sleepy):
    """Rank 1 sleeps forever in user code before its first push, rank 2 after three; rank 0
    reaches the budget and ends. --timeout 10 ends the run with exit 1 naming ranks 1 and 2."""
    code, err, took = sleepy["hang"]
    assert code == 1, err
    assert "stalewise run: timed out after 10 s (--timeout): still running: rank 1 (" in err
    assert "rank 1 (no push yet); rank 2 (3 pushes, the last " in err, err
    assert "rank 0 (" not in err, err  # it had ended, at the budget
    assert "Traceback" not in err, err
    assert 10 <= took < 10 + STOP_GRACE + 60, took


def test_a_rank_that_stops_pushing_is_killed_and_one_slow_to_push_first_is_not(sleepy):
    """The liveness rule: rank 1 pushes 3 times and sleeps; rank 2 pushes first 6 s after
    the start (its liveness clock starts at its first push); rank 0 pushes on (a push every
    10 ms or more, towards a budget of 800: 8 s at the least). With --rank-timeout 3, rank 1
    is named and killed after 3 s of silence, rank 2 is not taken for hung, and the others
    carry on to the budget."""
    code, err, took = sleepy["liveness"]
    assert code == 1, err
    assert "stalewise run: rank 1 hung: no push for 3." in err, err
    assert "(--rank-timeout 3); killed it" in err, err
    hung = [line for line in err.splitlines() if "hung" in line]
    assert len(hung) == 1 and "rank 1 hung" in hung[0], err  # not rank 2, slow to start
    assert "timed out" not in err and "Traceback" not in err, err
    done = err.strip().splitlines()[-1]
    assert done.startswith("stalewise run: 2 of 3 workers done, 1 failed, "), err
    assert int(done.split(", ")[2].split()[0]) >= 800  # the budget, without rank 1
    assert took < 120, took


# -- issue 29 items 5-7: torchrun's variables, the budget without should_stop(), progress

GREEDY = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import stalewise as sw

    if __name__ == "__main__":
        out, mode = sys.argv[1], sys.argv[2]
        if "RANK" in os.environ:  # a rank, before sw.init: torchrun's variables are set
            names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                     "STALEWISE_RANK", "STALEWISE_WORLD_SIZE", "SW_MARK")
            with open(f"{out}-env-{os.environ['RANK']}.json", "w") as f:
                json.dump({**{k: os.environ.get(k) for k in names}, "cwd": os.getcwd()}, f)
        steps = int(sys.argv[3]) if len(sys.argv) > 3 else None
        ctx = sw.init(sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1)),
                      steps=steps)
        n = 0
        try:
            while True:  # never asks ctx.should_stop()
                ctx.client.pull()
                ctx.client.push({"x": np.ones(4, np.float32)})
                n += 1
        except sw.ServerClosed as e:  # BudgetSpent is one
            if mode == "catch":
                print(f"rank {ctx.rank}: {type(e).__name__} after {n} pushes", flush=True)
            else:
                raise
        ctx.close()
    """
)


@pytest.mark.parametrize("mode", ["catch", "raise"])
def test_a_loop_that_never_asks_should_stop_is_refused_past_the_budget(tmp_path, mode, no_leaks):
    """With --steps 50 a loop that never asks ends: its push past the budget raises
    BudgetSpent (caught as sw.ServerClosed, or let through: the rank ends with status 0),
    the job's pushes stay within the documented overshoot (workers - 1), and the
    launcher says so once. Each rank had torchrun's variables before sw.init."""
    script, out = _script(tmp_path, GREEDY), tmp_path / "r"
    done = _run(
        "run",
        "--workers",
        "3",
        "--steps",
        "50",
        "--timeout",
        "120",
        str(script),
        str(out),
        mode,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "timed out" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    spent = [line for line in lines if "budget" in line]
    assert len(spent) == 1, done.stderr
    assert re.fullmatch(
        r"stalewise run: the budget of 50 pushes is spent; [1-9]\d* pushes past it were refused",
        spent[0],
    ), spent
    m = re.fullmatch(r"stalewise run: 3 workers done, (\d+) pushes", lines[-1])
    assert m and 50 <= int(m.group(1)) <= 50 + 2, lines[-1]
    if mode == "catch":
        assert done.stdout.count("BudgetSpent after") == 3, done.stdout
    for rank in range(3):
        env = json.loads(Path(f"{out}-env-{rank}.json").read_text())
        assert env == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
            "STALEWISE_RANK": str(rank),
            "STALEWISE_WORLD_SIZE": "3",
            "SW_MARK": None,
            "cwd": str(tmp_path),
        }, env


def test_unlaunched_the_push_past_the_budget_raises_budget_spent(tmp_path, no_leaks):
    script, out = _script(tmp_path, GREEDY), tmp_path / "r"
    done = _exec([sys.executable, str(script), str(out), "catch", "7"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rank 0: BudgetSpent after 7 pushes", done.stdout


def test_the_launcher_prints_progress_lines(tmp_path, no_leaks):
    script = _script(tmp_path, TOY)
    every = {**os.environ, "STALEWISE_PROGRESS": "0.5"}
    done = _run(
        "run", "--workers", "2", "--steps", "300", str(script), "push", cwd=tmp_path, env=every
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    rows = [
        m
        for line in lines
        if (
            m := re.fullmatch(
                r"stalewise run: (\d+) pushes \((\d+) applied, 0 refused\), ([\d.]+) "
                r"pushes/s(, loss [\d.]+)?, (\d) of 2 ranks live",
                line,
            )
        )
    ]
    assert rows, done.stderr  # 300 pushes, one each 10 ms or more a rank: 1.5 s at least
    assert all(int(m.group(5)) <= 2 and int(m.group(2)) <= int(m.group(1)) for m in rows)
    assert ", loss 0.5, " in done.stderr  # ranks 0 and 1 log 0.0 and 1.0
    assert re.fullmatch(r"stalewise run: 2 workers done, 30[01] pushes", lines[-1]), lines


# A loop you own: "nan" pushes a NaN in leaf "b"; "nopull" never pulls. Its AdamW
# excludes "bias" from weight decay, which no leaf is called. Before sw.init it makes
# a folder named after RANK (the launcher's own run of the script sees rank 0's).
OWN = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import stalewise as sw

    if __name__ == "__main__":
        mode = sys.argv[1]
        os.makedirs(f"out-{os.environ.get('RANK', 'solo')}", exist_ok=True)
        params = {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}
        opt = sw.optim.adamw(0.01, weight_decay=0.1, exclude_from_weight_decay=["bias"])
        ctx = sw.init(sw.Job(params, optimizer=opt), steps=int(sys.argv[2]))
        while not ctx.should_stop():
            if mode != "nopull":
                ctx.client.pull()
            b = np.array([1.0, np.nan if mode == "nan" else 1.0], np.float32)
            ctx.client.push({"w": np.ones(4, np.float32), "b": b})
        ctx.close()
    """
)


def test_refused_pushes_warn_at_once_and_ranks_that_keep_being_refused_end_the_run(
    tmp_path, no_leaks
):
    """Job.train's rule (diverge_after=20 numerical refusals in a row) ends each rank's
    loop; each says so on one line, and the run exits 1 long before its budget."""
    script = _script(tmp_path, OWN)
    done = _run("run", "--workers", "2", str(script), "nan", "5000", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    err = done.stderr
    for r in (0, 1):
        first = f"rank {r}: WARNING: worker {r}: push 0 refused: shard 0: not_finite: "
        assert err.count(first) == 1, err
        assert f"{first}payload has NaN or Inf (first at element 1, leaf 'b')" in err, err
        assert re.search(
            rf"\nstalewise run: rank {r} failed: Diverged: worker {r} diverged: its last 20 "
            r"pushes were refused as NaN/Inf", err
        ), err  # fmt: skip
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(r"stalewise run: 0 of 2 workers done, 2 failed, (\d+) pushes \((\d+) "
                     r"not_finite refused\)", last)  # fmt: skip
    assert m and m.group(1) == m.group(2) and int(m.group(1)) <= 42, last


def test_a_loop_that_never_pulls_and_an_exclusion_that_matches_nothing_warn_once(
    tmp_path, no_leaks
):
    script = _script(tmp_path, OWN)
    done = _run("run", "--workers", "2", str(script), "nopull", "40", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for r in (0, 1):
        assert done.stderr.count(f"worker {r} pushed before its first pull") == 1, done.stderr
    assert "pull before each step (ctx.client.pull(into=model))" in done.stderr
    unmatched = "exclude_from_weight_decay pattern 'bias' matches no parameter of the job"
    assert done.stderr.count(unmatched) == 1, done.stderr  # the launcher's, not each rank's
    assert sorted(p.name for p in tmp_path.glob("out-*")) == ["out-0", "out-1"]  # no out-solo
    alone = _exec([sys.executable, str(script), "nopull", "5"], tmp_path)
    assert alone.returncode == 0, alone.stderr
    assert alone.stderr.count("worker 0 pushed before its first pull") == 1, alone.stderr
    assert alone.stderr.count(unmatched) == 1, alone.stderr


def test_a_script_that_never_calls_init_is_told_early_and_stopped(tmp_path, monkeypatch, capsys):
    """The launcher runs the script up to sw.init: one that trains without it (here 10 s
    of sleeps) hears so at INIT_NOTE seconds and is stopped at INIT_TIMEOUT."""
    import stalewise.launch as launch_lib

    script = tmp_path / "forgot.py"
    script.write_text("import time\nfor _ in range(200):\n    time.sleep(0.05)\n")
    monkeypatch.setattr(launch_lib, "INIT_NOTE", 0.5)
    monkeypatch.setattr(launch_lib, "INIT_TIMEOUT", 2.0)
    start, rank = time.monotonic(), os.environ.get("RANK")
    with pytest.raises(launch_lib.LaunchError, match=r"did not call sw.init\(job\) within 2 s"):
        launch_lib.launch(str(script), [], workers=2)
    assert time.monotonic() - start < 5
    assert f"{script} has not called sw.init(job) after 0.5 s" in capsys.readouterr().err
    assert os.environ.get("RANK") == rank  # rank 0's variables were the script's only


def test_the_progress_rate_leaves_out_the_pushes_before_it_started(capsys):
    """After a resume the job's restored pushes are not counted as pushed meanwhile."""
    from stalewise.launch.progress import Progress

    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1))
    with job.serve(workers=1) as server:
        client = server.client(0)
        for _ in range(5):
            client.push({"x": np.ones(4, np.float32)})
        client.wait()
        progress = Progress(1, server)  # as the launcher makes it after a resume
        progress.every, progress.last = 1.0, 0.0
        progress.tick(2.0, 1)
        client.close()
    line = capsys.readouterr().err.strip()
    assert line == "stalewise run: 5 pushes (5 applied, 0 refused), 0.0 pushes/s, 1 of 1 ranks live"


def test_a_named_launch_is_joined_with_sw_attach(tmp_path, no_leaks):
    """``--name``: the ranks only poll should_stop(); the budget is spent by a process
    that joined by the job's name, after which the ranks end and the launch with them."""
    name = f"run-{os.getpid()}-{time.time_ns()}"
    script = _script(tmp_path, TOY)
    with _Launcher(
        tmp_path, "--workers", "2", "--steps", "5", "--name", name, str(script), "poll"
    ) as run:
        run.wait_ready(2)
        client = sw.attach(name)
        assert client.worker == 2  # the ids after the ranks'
        for _ in range(5):
            client.pull()
            client.push({"x": np.ones(4, np.float32)})
        client.close()
        assert run.proc.wait(TIMEOUT) == 0, run.stderr()
        assert run.stderr().splitlines()[-1] == "stalewise run: 2 workers done, 5 pushes"


def test_ctx_loop_pulls_before_each_step_and_once_at_the_end(tmp_path, no_leaks):
    text = textwrap.dedent(
        """
        import numpy as np
        import stalewise as sw

        params = {"x": np.zeros(4, np.float32)}
        ctx = sw.init(sw.Job(params, optimizer=sw.optim.sgd(1.0)), steps=3)
        seen = []
        for step in ctx.loop(into=params):
            seen.append((step, float(params["x"][0])))
            ctx.client.push({"x": np.ones(4, np.float32)})
        print(seen, float(params["x"][0]))
        """
    )
    done = _exec([sys.executable, str(_script(tmp_path, text))], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[(0, 0.0), (1, -1.0), (2, -2.0)] -3.0", done.stdout
    assert "pushed before its first pull" not in done.stderr


def test_the_local_server_counts_the_job_pushes():
    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1))
    with job.serve(workers=2) as server:
        assert server.job_pushes == 0
        for w in range(2):
            client = server.client(w)
            for _ in range(3):
                client.push({"x": np.ones(4, np.float32)})
            client.wait()
            client.close()
        assert server.job_pushes == 6


def test_ray_joins_the_cluster_asked_for_and_auto_only_a_cluster_recorded_by_this_user(
    tmp_path, monkeypatch
):
    """Every Ray entry point connects through cluster_address: the address given, else
    RAY_ADDRESS, else a new local instance ("local", not Ray's default, the cluster
    recorded in the machine's shared temporary folder); "auto" reads that record only
    from a regular file of this user's, else says why in one line."""
    from stalewise.runtime.ray import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    record = tmp_path / "ray" / "ray_current_cluster"
    assert cluster_address() == "local" and cluster_address("h:1") == "h:1"
    with pytest.raises(ConnectionError, match=rf"^address 'auto': {record}: No such file"):
        cluster_address("auto")
    record.parent.mkdir()
    record.write_text("10.0.0.7:6379\n")
    assert cluster_address() == "local"  # a record is never used unless asked for
    assert cluster_address("auto") == "10.0.0.7:6379"
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert cluster_address() == "10.0.0.7:6379" and cluster_address("h:1") == "h:1"
    monkeypatch.setenv("RAY_ADDRESS", "h:2")
    assert cluster_address() == "h:2"
    if os.getuid() == 0:  # another user's record (root can make one)
        os.chown(record, 65534, 65534)
        with pytest.raises(ConnectionError) as e:
            cluster_address("auto")
        assert str(e.value) == (
            f"address 'auto': {record} is not a file of yours (its owner is uid 65534, you "
            "are uid 0): give HOST:PORT of your cluster"
        )
    mine = tmp_path / "mine"
    mine.write_text("10.0.0.8:6379")
    record.unlink()
    record.symlink_to(mine)
    with pytest.raises(ConnectionError, match=r": a symlink; give HOST:PORT$"):
        cluster_address("auto")


def test_a_rank_on_ray_is_shipped_what_it_needs_and_credentials_only_when_named():
    from stalewise.launch.ray import shipped_env

    env = {
        "STALEWISE_PROGRESS": "0", "MASTER_ADDR": "h", "OMP_NUM_THREADS": "3", "DATA": "/d",
        "PATH": "/bin", "PYTHONPATH": "/p", "LD_PRELOAD": "x.so", "VIRTUAL_ENV": "/v",
        "HIP_VISIBLE_DEVICES": "0", "PWD": "/x", "RAY_ADDRESS": "h:1", "SSH_TTY": "t",
        "AWS_SECRET_ACCESS_KEY": "s", "AWS_ACCESS_KEY_ID": "i", "GITHUB_TOKEN": "g",
        "DB_PASSWORD": "p", "GOOGLE_APPLICATION_CREDENTIALS": "c", "KRB5CCNAME": "k",
        "KUBECONFIG": "k", "WANDB_API_KEY": "w",
    }  # fmt: skip
    own = {"STALEWISE_PROGRESS": "0", "MASTER_ADDR": "h", "OMP_NUM_THREADS": "3"}
    assert shipped_env(environ=env) == own
    named = shipped_env(["DATA", "GITHUB_TOKEN", "NOT_SET"], environ=env)
    assert named == own | {"DATA": "/d", "GITHUB_TOKEN": "g"}
    machine = {"DATA", "PATH", "PYTHONPATH", "LD_PRELOAD", "VIRTUAL_ENV"}  # and no devices
    assert shipped_env(every=True, environ=env) == own | {k: env[k] for k in machine}
    assert shipped_env(["KUBECONFIG"], every=True, environ=env)["KUBECONFIG"] == "k"


@pytest.mark.slow
def test_on_ray_ranks_get_the_launchers_env_cwd_variables_and_budget(tmp_path):
    """stalewise run --runtime ray without RAY_ADDRESS: a new local instance, said on a
    line; each rank has the launcher's environment and working directory, torchrun's
    variables before sw.init, and a loop that never asks is refused past the budget."""
    pytest.importorskip("ray")
    script, out = _script(tmp_path, GREEDY), tmp_path / "r"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["SW_MARK"] = "from the launcher"
    flags = ["--runtime", "ray", "--workers", "2", "--steps", "30", "--timeout", "150"]
    done = _run("run", *flags, str(script), str(out), "raise", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    said = [line for line in lines if line.startswith("stalewise run: Ray cluster at ")]
    assert len(said) == 1 and "(a new local instance;" in said[0], lines
    for rank in range(2):
        got = json.loads(Path(f"{out}-env-{rank}.json").read_text())
        assert got == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),  # one node: every rank is local
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "STALEWISE_RANK": str(rank),
            "STALEWISE_WORLD_SIZE": "2",
            "SW_MARK": "from the launcher",
            "cwd": str(tmp_path),
        }, got
    assert sum("the budget of 30 pushes is spent; " in line for line in lines) == 1, lines
    m = re.fullmatch(r"stalewise run: 2 workers done on 1 Ray node\(s\), (\d+) pushes", lines[-1])
    assert m and 30 <= int(m.group(1)) <= 31, lines[-1]


# -- who runs the script (issue #29 item 2) -------------------------------------------------

# Module-level code that leaves a line per process that runs it (or imports it as a module).
MARKED = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import stalewise as sw

    with open(os.environ["MARK"], "a") as f:
        f.write(f"{os.getpid()} {__name__}\\n")

    SCHEDULE
    if __name__ == "__main__":
        job = sw.Job({"x": np.zeros(8, np.float32)}, optimizer=sw.optim.sgd(LR), shards=2)
        if sys.argv[1] == "serve":
            with job.serve(workers=1) as server:
                client = server.client(0)
                for _ in range(5):
                    client.pull()
                    client.push({"x": np.ones(8, np.float32)})
                client.wait()
                client.close()
        else:
            ctx = sw.init(job, steps=10)
            while not ctx.should_stop():
                ctx.client.pull()
                ctx.client.push({"x": np.ones(8, np.float32)})
            ctx.close()
    """
)


def _marked(tmp_path: Path, schedule: bool = False) -> Path:
    text = MARKED.replace("SCHEDULE", "def lr(step):\n    return 0.1\n" if schedule else "")
    return _script(tmp_path, text.replace("LR", "lr" if schedule else "0.1"))


def _marks(path: Path) -> list[tuple[int, str]]:
    return [(int(a), b) for a, b in (line.split() for line in path.read_text().splitlines())]


def test_a_launched_script_runs_once_per_rank_and_never_in_a_shard(tmp_path, no_leaks):
    script, mark = _marked(tmp_path), tmp_path / "mark"
    done = _run("run", "--workers", "2", "--steps", "10", str(script), "init", cwd=tmp_path,
                env={**os.environ, "MARK": str(mark)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    marks = _marks(mark)
    # the launcher and 2 ranks, each once as __main__: no shard, no import as __mp_main__
    assert len(marks) == 3 and len({pid for pid, _ in marks}) == 3, marks
    assert {name for _, name in marks} == {"__main__"}, marks


def test_the_shards_of_a_plain_scripts_serve_do_not_import_it(tmp_path, no_leaks):
    script, mark = _marked(tmp_path), tmp_path / "mark"
    done = _exec(
        [sys.executable, str(script), "serve"], tmp_path, {**os.environ, "MARK": str(mark)}
    )
    assert done.returncode == 0, done.stderr
    assert [name for _, name in _marks(mark)] == ["__main__"]  # 2 shards, neither ran it


@pytest.mark.parametrize("how", ["serve", "run"])
def test_a_schedule_written_in_the_script_still_reaches_the_shards(tmp_path, how, no_leaks):
    """A config that refers to ``__main__`` (a schedule defined in the script) is started
    the old way: the shards (and ranks) import the script to unpickle it."""
    script, mark = _marked(tmp_path, schedule=True), tmp_path / "mark"
    cmd = (
        [sys.executable, str(script), "serve"]
        if how == "serve"
        else [*STALEWISE, "run", "--workers", "2", "--steps", "10", str(script), "init"]
    )
    done = _exec(cmd, tmp_path, {**os.environ, "MARK": str(mark)})
    assert done.returncode == 0, done.stderr
    assert "__mp_main__" in {name for _, name in _marks(mark)}  # the shards imported it
