"""The README's nanoGPT-style walkthrough: examples/gpt/train.py made a 4-worker job.

train_launched.py is train.py with at most 10 changed lines (model.py and data.py
shared, unchanged); launched with ``stalewise run --workers 4``, on local processes
and on a two-node Ray cluster (``ray.cluster_utils``: two raylets of 2 CPUs each on
this machine), every rank reports a validation loss well below the initial model's,
and run as a plain script it trains as train.py does.
"""

import contextlib
import difflib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray_helpers

# the launcher and Ray start processes while JAX (imported by other tests) has threads
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt"
RAY = r"(?:\S*\(rank \d+ pid=\d+[^)]*\)\S* )?"  # Ray's label of a worker's line, colours and all
INIT_LINE = re.compile(rf"^{RAY}val loss (\d+\.\d+) at init$", re.MULTILINE)
PLAIN_LINE = re.compile(r"^val loss (\d+\.\d+)$", re.MULTILINE)
RANK_LINE = re.compile(rf"^{RAY}rank (\d+): val loss (\d+\.\d+)$", re.MULTILINE)
TIMEOUT = 300  # seconds for one run of a script; a run killed at this fails its test


def gpt_diff() -> list[str]:
    """``diff -u train.py train_launched.py``, without the timestamps."""
    plain = (GPT / "train.py").read_text().splitlines()
    launched = (GPT / "train_launched.py").read_text().splitlines()
    return list(
        difflib.unified_diff(
            plain, launched, "train.py", "train_launched.py", lineterm="", n=3
        )
    )  # fmt: skip


def test_the_launched_script_changes_at_most_ten_lines():
    body = gpt_diff()[2:]  # past the ---/+++ header
    added = [line for line in body if line.startswith("+")]
    removed = [line for line in body if line.startswith("-")]
    assert 0 < len(added) <= 10, "\n".join(body)  # the bar
    assert len(removed) <= len(added), "\n".join(body)


def test_the_readme_shows_the_true_diff():
    shown = re.findall(r"```diff\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert "\n".join(gpt_diff()) + "\n" in shown


@pytest.fixture
def two_nodes():
    """A two-node Ray cluster, 2 CPUs a node (a worker needs one): the environment that
    points ``stalewise run --runtime ray`` at it. Shut down whatever happens."""
    with ray_helpers.two_nodes() as nodes:
        yield {"RAY_ADDRESS": nodes.address}


def launch_command(runtime: str, workers: int, steps: int) -> list[str]:
    """The ``stalewise run`` command line for ``runtime`` ("local"; "ray" adds its flag)."""
    flags = [] if runtime == "local" else ["--runtime", runtime]
    return [sys.executable, "-m", "stalewise", "run", *flags, "--workers", str(workers),
            "--steps", str(steps), str(GPT / "train_launched.py")]  # fmt: skip


def run(cmd: list[str], env: dict | None = None) -> tuple[str, str]:
    """Runs ``cmd`` in its own session; kills the whole session (the launcher, its
    shards and workers) if it is still there after :data:`TIMEOUT` s or the test fails.
    Returns stdout and stderr, after asserting a zero exit status."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):  # anything of the run's still alive
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    return out, err


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_the_launched_gpt_trains_on_four_workers(runtime, request, no_leaks):
    """200 pushes in all, exactly (50 BSP rounds of 4 batches: the budget is whole
    rounds): every rank reports a validation loss at least 2 nats below the initial
    model's (ln 256 = 5.55 is a uniform guess; byte frequencies alone give about 3.4).
    On Ray the workers run on both nodes of the cluster."""
    env = request.getfixturevalue("two_nodes") if runtime == "ray" else None
    out, err = run(launch_command(runtime, workers=4, steps=200), env=env)
    log = f"stdout:\n{out}\nstderr:\n{err}"
    inits = {float(v) for v in INIT_LINE.findall(out)}
    assert len(inits) == 1, log  # the same initial model in every process
    (init,) = inits
    found = sorted((int(r), float(v)) for r, v in RANK_LINE.findall(out))
    assert [r for r, _ in found] == [0, 1, 2, 3], log
    assert all(v < init - 2.0 for _, v in found), log
    last = err.strip().splitlines()[-1]
    where = " on 2 Ray node(s)" if runtime == "ray" else ""  # the nodes the ranks ran on
    assert last == f"stalewise run: 4 workers done{where}, 200 pushes", log


@pytest.mark.slow
def test_unlaunched_the_script_trains_as_train_py_does(no_leaks):
    """``python train_launched.py``: one worker, the optimizer on the server, the same
    batches as train.py: the same validation loss (stalewise's AdamW is torch's)."""
    one = {"OMP_NUM_THREADS": "1"}  # a single process: torch's threads fight other jobs' on CI
    out, _ = run([sys.executable, str(GPT / "train_launched.py")], env=one)
    (rank, launched), = RANK_LINE.findall(out)  # fmt: skip
    assert rank == "0", out
    plain_out, _ = run([sys.executable, str(GPT / "train.py")], env=one)
    (plain,) = PLAIN_LINE.findall(plain_out)
    assert float(plain) < float(INIT_LINE.findall(plain_out)[0]) - 2.5, plain_out
    assert abs(float(launched) - float(plain)) <= 0.01, (out, plain_out)
