"""``stalewise run`` and ``sw.init``: a script you own, run once per worker process.

Real launches in subprocesses: the launcher runs the script up to ``sw.init``,
serves its job and runs the script again in each worker process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import stalewise as sw
from stalewise.launch import RENDEZVOUS_TIMEOUT

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


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*STALEWISE, *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT
    )


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
    done = subprocess.run(
        [sys.executable, str(script), str(out), "100"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    (report,) = _reports(out, 1)
    assert (report["rank"], report["world"], report["launched"]) == (0, 1, False)
    assert report["pushes"] == 100 and report["loss"] < 1e-2 * report["start"]


def test_a_worker_that_raises_makes_the_launcher_fail_naming_its_rank(tmp_path, no_leaks):
    script, out = _script(tmp_path), tmp_path / "RAISE"
    done = _run("run", "--workers", "2", "--steps", "60", str(script), str(out), cwd=tmp_path)
    assert done.returncode == 1
    assert "ValueError: rank 1 cannot train" in done.stderr  # its traceback, on stderr
    assert "stalewise run: rank 1 failed (exit code 1)" in done.stderr
    assert _reports(out, 1)[0]["pushes"] >= 60  # rank 0 carried on to the budget alone


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0", "train.py"], "--workers must be an integer in 1..256, got 0"),
        (["--steps", "0", "train.py"], "--steps must be an integer >= 1, got 0"),
        (["missing.py"], "missing.py: no such script"),
        (["noinit.py"], "noinit.py ended without calling sw.init(job)"),
    ],
)
def test_launch_errors_are_one_line(tmp_path, args, message):
    _script(tmp_path)
    (tmp_path / "noinit.py").write_text("print('training without stalewise')\n")
    done = _run("run", *args, cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"stalewise: run: {message}"), done.stderr


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


def test_a_worker_that_dies_before_init_does_not_hold_the_others(tmp_path, no_leaks):
    """The start barrier is broken at once when a worker fails before reaching it."""
    text = SCRIPT.replace(
        "    out = sys.argv[1]\n",
        "    out = sys.argv[1]\n"
        "    if os.environ.get('STALEWISE_RANK') == '1':\n"
        "        raise ImportError('rank 1 lacks a package')\n",
    ).replace("import json, sys", "import json, os, sys")
    script, out = _script(tmp_path, text), tmp_path / "report"
    start = time.monotonic()
    done = _run("run", "--workers", "2", "--steps", "40", str(script), str(out), cwd=tmp_path)
    assert done.returncode == 1 and "stalewise run: rank 1 failed" in done.stderr
    assert _reports(out, 1)[0]["pushes"] >= 40
    assert time.monotonic() - start < 0.5 * RENDEZVOUS_TIMEOUT  # not held at the barrier


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
    done = subprocess.run(
        [*STALEWISE, "run", "--workers", "3", "--steps", "1", str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    expected = {f"rank {r} line {i}" for r in range(3) for i in range(300)}
    assert len(lines) == len(expected) and set(lines) == expected, done.stdout[-2000:]
