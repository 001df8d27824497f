"""The README's nanoGPT-style walkthrough: examples/gpt/train.py made a 4-worker job.

train_launched.py is train.py with at most 10 changed lines (model.py and data.py
shared, unchanged); launched with ``stalewise run --workers 4``, on local processes
and on the two-node Ray cluster the Ray test files share (``ray.cluster_utils``: two
raylets of 2 CPUs each on this machine), every rank reports a validation loss well
below the initial model's and writes its own output file (``OUT_DIR``, named after
torchrun's ``RANK``); run as a plain script it trains as train.py does; and a launch
with ``--checkpoint-dir`` killed with SIGKILL goes on from its last checkpoint when
started again with ``--resume`` (the server's state, and each rank's batches through
``ctx.state``).
"""

import contextlib
import difflib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalewise import checkpoint

# the launcher and Ray start processes while JAX (imported by other tests) has threads

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt"
RAY = r"(?:\S*\(rank \d+ pid=\d+[^)]*\)\S* )?"  # Ray's label of a worker's line, colours and all
INIT_LINE = re.compile(rf"^{RAY}val loss (\d+\.\d+) at init$", re.MULTILINE)
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


def test_the_launched_script_changes_at_most_ten_lines_with_checkpoints():
    body = gpt_diff()[2:]  # past the ---/+++ header
    added = [line for line in body if line.startswith("+") and line[1:].strip()]
    removed = [line for line in body if line.startswith("-") and line[1:].strip()]
    assert 0 < len(added) + len(removed) <= 10, "\n".join(body)  # the bar, with resume
    assert "--resume" in "\n".join(added)  # ctx.state restored


def test_the_readme_shows_the_true_diff():
    shown = re.findall(r"```diff\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert "\n".join(gpt_diff()) + "\n" in shown


def launch_command(runtime: str, workers: int, steps: int, *flags: str) -> list[str]:
    """The ``stalewise run`` command line for ``runtime`` ("local"; "ray" adds its flag, and
    ships ``OUT_DIR``, which a rank on Ray gets only when named)."""
    if runtime != "local":
        flags = ("--runtime", runtime, "--env", "OUT_DIR", *flags)
    return [sys.executable, "-m", "stalewise", "run", *flags, "--workers", str(workers),
            "--steps", str(steps), str(GPT / "train_launched.py")]  # fmt: skip


def outputs(out_dir: Path) -> list[str]:
    """The per-rank files the scripts wrote in ``out_dir`` (their ``OUT_DIR``)."""
    return sorted(p.name for p in out_dir.glob("*")) if out_dir.is_dir() else []


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """Starts ``cmd`` in its own session (the launcher, its shards and workers)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def run(*runs: tuple[list[str], dict | None]) -> list[tuple[str, str]]:
    """Runs each ``(cmd, env)`` at once, each in its own session; kills every session
    (the launchers, their shards and workers) still there after :data:`TIMEOUT` s or
    if the test fails. Returns their stdout and stderr, after asserting zero exit statuses."""
    procs = []
    try:
        procs += [start(cmd, env) for cmd, env in runs]
        outs = [proc.communicate(timeout=TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):  # anything of the run's still alive
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["local", pytest.param("ray", marks=pytest.mark.shared_ray)])
def test_the_launched_gpt_trains_on_four_workers(runtime, request, tmp_path, no_leaks):
    """200 pushes in all, exactly (50 BSP rounds of 4 batches: the budget is whole
    rounds): every rank reports a validation loss at least 2 nats below the initial
    model's (ln 256 = 5.55 is a uniform guess; byte frequencies alone give about 3.4)
    and writes its own model file. On Ray the workers run on both nodes of the cluster."""
    env = {"OUT_DIR": str(tmp_path / "out")}
    if runtime == "ray":  # the cluster the Ray test files share (conftest.py)
        env["RAY_ADDRESS"] = request.getfixturevalue("ray_address")
    ((out, err),) = run((launch_command(runtime, workers=4, steps=200), env))
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
    assert outputs(tmp_path / "out") == [f"model_rank{r}.pt" for r in range(4)], log


@pytest.mark.slow
def test_unlaunched_the_script_trains_as_train_py_does(tmp_path, no_leaks):
    """``python train_launched.py``: one worker, the optimizer on the server, the same
    batches as train.py: the same validation loss (stalewise's AdamW is torch's), and
    the same output file (rank 0: ``RANK`` is unset)."""
    one = {"OMP_NUM_THREADS": "1"}  # a single process: torch's threads fight other jobs' on CI
    (out, _), (plain_out, _) = run(  # the two at once, a thread each
        *(
            ([sys.executable, str(GPT / script)], {**one, "OUT_DIR": str(tmp_path / name)})
            for script, name in (("train_launched.py", "launched"), ("train.py", "plain"))
        )
    )
    (rank, launched), = RANK_LINE.findall(out)  # fmt: skip
    assert rank == "0", out
    assert outputs(tmp_path / "launched") == ["model_rank0.pt"], out
    ((rank, plain),) = RANK_LINE.findall(plain_out)
    assert rank == "0", plain_out
    assert outputs(tmp_path / "plain") == ["model_rank0.pt"], plain_out
    assert float(plain) < float(INIT_LINE.findall(plain_out)[0]) - 2.5, plain_out
    assert abs(float(launched) - float(plain)) <= 0.01, (out, plain_out)


@pytest.mark.slow
def test_a_killed_launch_resumes_from_its_checkpoint(tmp_path, no_leaks):
    """The same command twice, ``--checkpoint-dir DIR --resume``: the first (no
    checkpoint yet: it starts from the start) is killed with SIGKILL, its whole process
    group, once its first checkpoint is written; the second goes on from it, to the
    budget (160 pushes; 161 if the checkpoint fell mid-round), and every rank reports a
    validation loss at least 2 nats below the initial model's and writes its file.
    The checkpoint holds each rank's batch generator (``ctx.state["gen"]``)."""
    ckpt, out_dir = tmp_path / "ckpt", tmp_path / "out"
    flags = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "40", "--resume",
             "--timeout", "200")  # fmt: skip
    cmd = launch_command("local", 2, 160, *flags)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT_DIR": str(out_dir)}
    with open(tmp_path / "first.log", "w+") as log:
        first = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )  # fmt: skip
        try:
            deadline = time.monotonic() + TIMEOUT
            while first.poll() is None and not (  # the first after the start's
                checkpoint.exists(ckpt) and checkpoint.load(ckpt).step["pushes"] > 0
            ):
                assert time.monotonic() < deadline, "no checkpoint in time"
                time.sleep(0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        log.seek(0)
        first_log = log.read()
    assert first.returncode == -signal.SIGKILL, first_log  # killed, not done
    assert "no checkpoint in" in first_log and not outputs(out_dir), first_log
    saved = checkpoint.load(ckpt)
    gens = [rank["gen"] for rank in saved.ranks]
    assert len(gens) == 2 and all(g.dtype.name == "uint8" and g.size for g in gens), first_log
    assert not (gens[0] == gens[1]).all(), first_log  # each rank its own batches

    ((out, err),) = run((cmd, {"OUT_DIR": str(out_dir)}))
    log = f"first run:\n{first_log}\nstdout:\n{out}\nstderr:\n{err}"
    resumed = re.search(r"^stalewise: resumed from \S+ \(version \d+, (\d+) pushes\)$",
                        err, re.MULTILINE)  # fmt: skip
    assert resumed and 0 < int(resumed[1]) < 160, log
    (init,) = {float(v) for v in INIT_LINE.findall(out)}
    found = sorted((int(r), float(v)) for r, v in RANK_LINE.findall(out))
    assert [r for r, _ in found] == [0, 1], log
    assert all(v < init - 2.0 for _, v in found), log
    done = re.fullmatch(
        r"stalewise run: 2 workers done, (\d+) pushes", err.strip().splitlines()[-1]
    )
    assert done and 160 <= int(done[1]) <= 161, log  # the budget, + at most workers - 1
    assert outputs(out_dir) == ["model_rank0.pt", "model_rank1.pt"], log
