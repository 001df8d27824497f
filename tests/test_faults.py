"""Faults in the local runtime, for real: processes are killed, stopped and orphaned.

Every test is bounded (timeouts), and whatever it starts is killed in a ``finally``.
"""

import contextlib
import functools
import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import mp_helpers
import numpy as np
import pytest

import stalewise as sw
from stalewise import checkpoint
from stalewise import config as config_lib
from stalewise.protocol import liveness
from stalewise.runtime.errors import DivergedError, ShardError
from stalewise.runtime.local.shm import held_blocks, leaked_blocks
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed

TARGET = np.arange(8, dtype=np.float32)


# -- functions the worker processes import (module level, picklable) ----------------------


def paced_loss_and_grad(params, batch):
    """0.5 * ||x - TARGET||^2, taking 10 ms, so a run lasts long enough to be hit."""
    time.sleep(0.01)
    diff = params["x"] - TARGET
    return float(0.5 * (diff**2).sum()), {"x": diff}


def nan_loss_and_grad(params, batch):
    return float("nan"), {"x": np.full(8, np.nan, np.float32)}


def tagged_data(worker, workers):
    return ((worker, i) for i in range(10**9))


def fails_once(params, batch, marker):
    """Worker 1 raises on its batch 5, once in the run (``marker``: a file that says it did)."""
    w, i = batch
    if w == 1 and i == 5 and not os.path.exists(marker):
        open(marker, "w").close()
        raise ValueError("boom at batch 5")
    return paced_loss_and_grad(params, i)


def bad_batch_5(params, batch):
    """Worker 1's batch 5 always raises."""
    w, i = batch
    if w == 1 and i == 5:
        raise ValueError("worker 1's batch 5 is bad")
    return paced_loss_and_grad(params, i)


def recording_loss(params, batch):
    """Appends ``"worker index"`` to the file $SEEN_LOG, then as paced_loss_and_grad."""
    with open(os.environ["SEEN_LOG"], "a") as f:
        f.write(f"{batch[0]} {batch[1]}\n")
    return paced_loss_and_grad(params, batch)


# -- helpers -------------------------------------------------------------------------------


def job(**kw):
    return sw.Job({"x": np.zeros(8, np.float32)}, optimizer=sw.optim.sgd(0.1), **kw)


def child(name):
    """The live child process called ``name`` (e.g. ``stalewise-worker-1``)."""
    found = [p for p in mp.active_children() if p.name == name]
    assert len(found) == 1, [p.name for p in mp.active_children()]
    return found[0]


class Once:
    """An ``on_record`` that sends ``sig`` to a child once the run has made ``after`` pushes
    (and run for ``seconds``)."""

    def __init__(self, name, sig=signal.SIGKILL, after=30, seconds=0.0):
        self.name, self.sig, self.after, self.seconds = name, sig, after, seconds
        self.pid = self.at = None

    def __call__(self, rec):
        if self.pid is None and rec["pushes"] >= self.after and rec["time"] >= self.seconds:
            self.pid, self.at = child(self.name).pid, rec["time"]
            os.kill(self.pid, self.sig)


def train(job_, *, on_record=None, timeout=60, **kw):
    kw = {
        "data": mp_helpers.counting_data,
        "workers": 2,
        "steps": 200,
        "metrics": sw.Metrics(every=0.05, on_record=on_record),
        "timeouts": sw.Timeouts(total=timeout),
        **kw,
    }
    return job_.train(kw.pop("loss", paced_loss_and_grad), **kw)


# -- the failure policy --------------------------------------------------------------------


def test_restart_completes_the_job_after_a_sigkill(no_leaks, caplog):
    kill = Once("stalewise-worker-1")
    result = train(job(consistency=sw.BSP()), on_record=kill)
    assert kill.pid is not None
    # the BSP budget is 100 whole rounds of the 2 workers; worker 1 misses some while
    # it restarts (the rounds go on over the live one)
    assert result.stats["version"] == 100 and 100 < result.pushes < 200
    assert result.stop_reason.startswith("the budget") and result.ended == "budget"
    assert result.restarts == 1
    (event,) = result.failures
    assert event["worker"] == 1 and event["action"] == "restarted"
    assert event["cause"] == "died without a word (killed by SIGKILL)"
    assert event["recovered"] > event["time"]  # the new incarnation joined the run
    assert "worker 1 failed (died without a word (killed by SIGKILL)); restarting it" in caplog.text
    np.testing.assert_allclose(result.params["x"], TARGET, atol=0.05)


def test_drop_lets_the_others_spend_the_budget(no_leaks):
    kill = Once("stalewise-worker-1")
    result = train(job(), on_record=kill, failures=sw.Failures("drop"))
    assert result.pushes >= 200 and result.restarts == 0
    assert [(e["worker"], e["action"]) for e in result.failures] == [(1, "dropped")]
    np.testing.assert_allclose(result.params["x"], TARGET, atol=0.05)


def test_fail_stops_the_job_naming_the_worker_and_how_it_died(no_leaks):
    with pytest.raises(sw.WorkerError, match=r"^worker 1 failed: died without a word \(killed"):
        train(job(), on_record=Once("stalewise-worker-1"), failures=sw.Failures("fail"))


def test_an_error_in_user_code_is_restarted_up_to_the_budget_then_fails_with_its_traceback(
    no_leaks,
):
    with pytest.raises(
        sw.WorkerError,
        match=r"(?s)worker \d failed 2 times, more than max_restarts=1 allows; the last time: "
        r"raised ValueError: boom at batch 4\nTraceback.*ValueError: boom at batch 4",
    ):  # every batch from 3 on raises; the restarted incarnation goes on at batch 4
        train(job(), loss=mp_helpers.failing_loss_and_grad, failures=sw.Failures(max_restarts=1))


def test_a_batch_that_always_raises_costs_one_restart_not_the_job(no_leaks):
    result = train(job(), loss=bad_batch_5, data=tagged_data, failures=sw.Failures(max_restarts=1))
    assert [(e["worker"], e["action"]) for e in result.failures] == [(1, "restarted")]
    assert result.failures[0]["cause"] == "raised ValueError: worker 1's batch 5 is bad"
    assert result.pushes >= 200 and result.stop_reason.startswith("the budget")


def test_a_resumed_run_continues_each_workers_data_stream(no_leaks, tmp_path, monkeypatch):
    log, ckpt = tmp_path / "seen", tmp_path / "ckpt"
    monkeypatch.setenv("SEEN_LOG", str(log))
    kw = dict(loss=recording_loss, data=tagged_data)
    train(job(), steps=60, checkpoints=sw.Checkpoints(ckpt), **kw)
    drawn = checkpoint.load(ckpt).step["drawn"]
    before = mp_helpers.read_records(log)
    assert drawn == [max(before[w]) + 1 for w in (0, 1)], (drawn, before)
    log.unlink()
    train(job(), steps=120, checkpoints=sw.Checkpoints(ckpt, resume=True), **kw)
    after = mp_helpers.read_records(log)
    assert [min(after[w]) for w in (0, 1)] == drawn  # each stream goes on where it stopped


@pytest.mark.parametrize(
    "drawn, message",
    [
        ([5], r"'drawn' must list the batches each of this run's 2 workers drew, got \[5\]"),
        ([5, -1], r"worker 1's count of batches drawn is -1, not an integer >= 0"),
        ([5, 2.5], r"worker 1's count of batches drawn is 2.5, not an integer >= 0"),
    ],
)
def test_a_checkpoint_with_bad_batch_counts_is_refused(tmp_path, drawn, message):
    """A manifest that fails its checksum is refused before this; this is the check that
    resume_point runs, before anything starts, on one that passes it."""
    config = job().config
    shard = config.build_shard(0, config.init.copy(), workers=2)
    checkpoint.save(
        tmp_path,
        [shard.state_dict()],
        spec=config.spec,
        config_info=checkpoint.config_info(config),
        step_info={"pushes": 0, "drawn": [5, 3]},
    )
    saved = checkpoint.load(tmp_path)
    checkpoint.resume.check_compatible(saved, config, 2)  # as written, it is accepted
    assert checkpoint.drawn_of(saved, 2) == [5, 3]
    saved.manifest["step"]["drawn"] = drawn
    with pytest.raises(sw.CheckpointError, match=message):
        checkpoint.resume.check_compatible(saved, job().config, 2)


def test_a_stopped_worker_is_detected_within_worker_timeout_and_restarted(no_leaks):
    stop = Once("stalewise-worker-1", signal.SIGSTOP)
    try:
        result = train(
            job(consistency=sw.BSP()),
            on_record=stop,
            failures=sw.Failures(worker_timeout=1.0),
            steps=300,
        )
    finally:
        if stop.pid is not None:  # the runtime kills it; never leave a stopped process behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(stop.pid, signal.SIGKILL)
    (event,) = result.failures
    assert event["worker"] == 1 and event["action"] == "restarted"
    # found by the worker_timeout rule (not by its rhythm, nor by its exit), after the stop,
    # once the silence had reached worker_timeout: what the events say, not the wall clock
    silence = re.search(
        r"no heartbeat for (\d+\.\d) s \(worker_timeout=1 s\): hung or stopped", event["cause"]
    )
    assert silence is not None, event["cause"]
    assert float(silence[1]) >= 1.0 and event["time"] > stop.at
    # BSP went on without it (its missed rounds have one push), then with its new
    # incarnation, for the budget's 150 whole rounds
    assert result.stats["version"] == 150 and 150 < result.pushes < 300


def test_a_stopped_worker_is_found_by_its_own_rhythm_long_before_worker_timeout(no_leaks):
    """worker_timeout stays at its default (60 s): the worker's beats, about one a second,
    make a silence of 10 s (liveness.FLOOR) a hang, once it has beaten for a few seconds
    (liveness.MIN_SAMPLES intervals: it is stopped 7 s into the run). The budget's 800
    BSP rounds of 10 ms steps or more (8 s at the least) outlast that stop, and the rounds
    after the restart end it."""
    stop = Once("stalewise-worker-1", signal.SIGSTOP, seconds=7.0)
    try:
        result = train(job(consistency=sw.BSP()), on_record=stop, steps=1600, timeout=120)
    finally:
        if stop.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stop.pid, signal.SIGKILL)
    (event,) = result.failures
    assert event["worker"] == 1 and event["action"] == "restarted"
    assert "its usual interval" in event["cause"] and "hung or stopped" in event["cause"]
    # the floor after its last beat (at most 1 s before the stop), far below worker_timeout
    assert liveness.FLOOR - 1.0 <= event["time"] - stop.at < liveness.FLOOR + 10.0
    assert result.stats["version"] == 800 and 800 < result.pushes < 1600  # whole rounds


def test_every_worker_diverging_stops_the_job_with_a_clear_error(no_leaks):
    with pytest.raises(DivergedError, match=r"training diverged: worker\(s\) 0, 1 stopped"):
        train(job(), loss=nan_loss_and_grad, steps=10_000)


def test_diverge_after_sets_how_many_refusals_in_a_row_make_a_worker_diverge(no_leaks):
    # each worker stops at its 3rd refusal in a row (the message's count), long before the budget
    with pytest.raises(
        DivergedError,
        match=r"training diverged: worker\(s\) 0, 1 stopped because their pushes kept being "
        r"refused \(worker \d diverged: its last 3 pushes were refused",
    ):
        train(job(), loss=nan_loss_and_grad, steps=10_000, failures=sw.Failures(diverge_after=3))


def test_diverge_after_none_runs_to_the_budget_and_says_no_push_was_applied(no_leaks, caplog):
    with caplog.at_level(logging.WARNING):
        result = train(
            job(), loss=nan_loss_and_grad, steps=60, failures=sw.Failures(diverge_after=None)
        )
    assert result.pushes >= 60 and not result.failures
    assert result.stats["applied"] == 0 and result.stats["rejected"]["not_finite"] >= 60
    assert result.stop_reason.startswith(
        "the budget of 60 pushes is spent; no push was applied, every one was refused "
        "({'not_finite': "
    )
    assert "no push was applied" in caplog.text
    np.testing.assert_array_equal(result.params["x"], np.zeros(8, np.float32))


@pytest.mark.parametrize("runtime", ["local", "sim"])
def test_an_error_in_user_code_is_handled_alike_by_both_runtimes(no_leaks, tmp_path, runtime):
    loss = functools.partial(fails_once, marker=str(tmp_path / "failed"))
    # in the simulator: 10 ms steps, back 0.1 s after the failure, well before the budget ends
    if runtime == "sim":
        runtime = sw.Simulation(SimConfig(compute=Fixed(0.01), restart_delay=0.1))
    result = train(job(), loss=loss, data=tagged_data, steps=60, runtime=runtime)
    (event,) = result.failures
    assert (event["worker"], event["action"], event["cause"]) == (
        1,
        "restarted",
        "raised ValueError: boom at batch 5",
    )
    assert event["recovered"] > event["time"]  # the new incarnation joined the run
    assert result.restarts == 1 and result.pushes >= 60
    assert result.stop_reason == "the budget of 60 pushes is spent"
    np.testing.assert_allclose(result.params["x"], TARGET, atol=0.05)


# -- shards --------------------------------------------------------------------------------


def test_a_dead_shard_is_restarted_and_the_workers_rejoin(no_leaks, caplog):
    kill = Once("stalewise-shard-1")
    result = train(job(shards=2), on_record=kill)
    assert result.pushes >= 200
    (event,) = result.failures
    assert event["shard"] == 1 and event["action"] == "restarted"
    assert event["cause"] == "killed by SIGKILL" and event["lost"] >= 0
    assert event["recovered"] > event["time"]
    assert "disagree" not in caplog.text  # the restarted shard is in step with shard 0
    np.testing.assert_allclose(result.params["x"], TARGET, atol=0.05)


def test_a_dead_shard_under_fail_names_it_and_the_run_resumes_from_its_checkpoint(
    no_leaks, tmp_path
):
    kill = Once("stalewise-shard-1")
    with pytest.raises(ShardError, match=r"(?s)shard 1 failed: killed by SIGKILL.*resume=True"):
        train(
            job(shards=2),
            on_record=kill,
            failures=sw.Failures("fail"),
            checkpoints=sw.Checkpoints(tmp_path, every=10),
        )
    result = train(job(shards=2), checkpoints=sw.Checkpoints(tmp_path, resume=True))
    assert result.pushes >= 200 and result.records[0]["updates"] >= 10
    np.testing.assert_allclose(result.params["x"], TARGET, atol=0.05)


def test_serve_names_a_dead_shard_and_can_restart_it(no_leaks):
    with job(shards=2).serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=10)
        client.push({"x": np.ones(8, np.float32)})
        client.wait(timeout=10)
        deadline = time.monotonic() + 10
        while server.published_version(1) < 1:  # published: the parent can recover it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(child("stalewise-shard-1").pid, signal.SIGKILL)
        with pytest.raises(ShardError, match=r"shard 1 has died \(killed by SIGKILL\)"):
            server.stats()
        client.close()
        info = server.restart_shard(1)
        assert info["version"] == 1 and info["lost"] == 0
        again = server.client(0)
        again.pull(timeout=10)
        again.push({"x": np.ones(8, np.float32)})
        assert again.wait(timeout=10).status == "applied"
        assert [s["version"] for s in server.stats()] == [2, 2]
        np.testing.assert_allclose(server.pull()["x"], np.full(8, -0.2), atol=1e-6)
        again.close()


# -- the parent dies -----------------------------------------------------------------------

SCRIPT = """
import multiprocessing as mp, os, sys, time
sys.path.insert(0, {tests!r})
import numpy as np, stalewise as sw, test_faults
from stalewise.runtime.local import shm

def on_record(rec):
    if rec["pushes"] > 20:
        workers = [p.pid for p in mp.active_children() if "worker" in p.name]
        print("running", *workers, flush=True)

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.endswith("named"):
        shm.USE_MEMFD = False  # the fallback: a named block the shards unlink if we die
    job = sw.Job({{"x": np.zeros(8, np.float32)}}, optimizer=sw.optim.sgd(0.1), shards=2)
    if mode == "serve":
        with job.serve(workers=2) as server:
            print("running", flush=True)
            time.sleep(120)
    print("starting", flush=True)
    job.train(test_faults.paced_loss_and_grad, data=test_faults.mp_helpers.counting_data,
              workers=2, steps=10**6, metrics=sw.Metrics(every=0.05, on_record=on_record))
"""


def _memfd_holders(prefix):
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and any(
        b.startswith(prefix) for b in held_blocks(int(d)))]  # fmt: skip


@pytest.mark.parametrize(
    "mode, line, delay, stop_a_worker",
    [
        ("serve", "running", 0.0, False),
        ("startup", "starting", 0.1, False),  # while the shards start
        ("startup", "starting", 0.9, False),  # while the workers start
        ("train", "running", 0.0, True),  # mid-run, with one worker stopped (SIGSTOP)
        ("train-named", "running", 0.0, False),  # mid-run, named shared memory
    ],
)
def test_nothing_survives_a_sigkill_of_the_parent(tmp_path, mode, line, delay, stop_a_worker):
    tag = f"stalewise-faults-{os.getpid()}-{time.time_ns()}"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, STALEWISE_TEST_TAG=tag)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        deadline = time.monotonic() + 60
        while not (said := proc.stdout.readline().decode().split()) or said[0] != line:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(delay)
        if stop_a_worker:
            os.kill(int(said[-1]), signal.SIGSTOP)  # a worker
        proc.kill()
        proc.wait(10)
        # A running child exits within ~0.1 s; one still starting (importing) when the
        # parent died exits when its start-up ends, which takes seconds on a loaded machine.
        deadline = time.monotonic() + (5 if line == "running" else 30)
        while mp_helpers.tagged_pids(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mp_helpers.tagged_pids(tag) == []
        mine = f"stalewise-{proc.pid}-"
        assert [b for b in leaked_blocks() if b.startswith(mine)] == []
        assert _memfd_holders(mine) == []
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close(), proc.stderr.close()
        for pid in mp_helpers.tagged_pids(tag):
            os.kill(pid, signal.SIGKILL)


HEAD = """
[task]
name = "least-squares"
[optimizer]
name = "sgd"
lr = 0.1
"""

# -- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"policy": "retry"}, "Failures.policy must be one of 'restart', 'drop'"),
        ({"max_restarts": -1}, "Failures.max_restarts must be an integer >= 0 or None, got -1"),
        ({"max_restarts": 1.5}, "Failures.max_restarts must be an integer"),
        ({"worker_timeout": 0}, "Failures.worker_timeout must be a finite number of seconds > 0"),
        ({"worker_timeout": float("inf")}, "Failures.worker_timeout must be a finite number"),
    ],
)
def test_bad_failure_options_are_refused_before_anything_starts(no_leaks, kw, message):
    with pytest.raises(ValueError, match=message):
        train(job(), failures=sw.Failures(**kw))


DOCS = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"


def test_the_docs_python_snippet_runs_as_pasted(tmp_path):
    (snippet,) = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    (tmp_path / "snippet.py").write_text(snippet)
    proc = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "1 died without a word (exit code 9)",
        "budget | the budget of 400 pushes is spent",
    ], proc.stdout + proc.stderr


def test_failure_options_in_a_config():
    (run_table,) = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.S)  # the docs' example
    cfg = config_lib.parse(tomllib.loads(HEAD + run_table))
    assert cfg.train["failures"] == sw.Failures("restart", max_restarts=3, worker_timeout=60.0)
    text = HEAD + textwrap.dedent(
        """
        [run]
        workers = 2
        steps = 10
        on_worker_failure = "drop"
        max_restarts = 5
        worker_timeout = 30
        """
    )
    cfg = config_lib.parse(tomllib.loads(text))
    assert cfg.train["failures"] == sw.Failures("drop", max_restarts=5, worker_timeout=30.0)
    for bad, key in (
        ('on_worker_failure = "drop"', 'on_worker_failure = "ignore"'),
        ("max_restarts = 5", "max_restarts = -2"),
        ("worker_timeout = 30", "worker_timeout = 0"),
    ):
        raw = tomllib.loads(text.replace(bad, key))
        with pytest.raises(config_lib.ConfigError, match=rf"run\.{key.split()[0]}: "):
            config_lib.parse(raw)
    off = tomllib.loads(text.replace("30", "false"))
    assert config_lib.parse(off).train["failures"].worker_timeout is None


def test_diverge_after_in_a_config():
    (run_table,) = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.S)  # the docs' example
    assert config_lib.parse(tomllib.loads(HEAD + run_table)).train["failures"].diverge_after == 20
    text = HEAD + "[run]\nworkers = 2\nsteps = 10\n"
    assert (
        config_lib.parse(tomllib.loads(text)).train["failures"].diverge_after == 20
    )  # the default
    assert (
        config_lib.parse(tomllib.loads(text + "diverge_after = 3")).train["failures"].diverge_after
        == 3
    )
    off = tomllib.loads(text + "diverge_after = false")
    assert config_lib.parse(off).train["failures"].diverge_after is None
    for bad in ("0", "-1", "2.5", "true", '"3"'):
        raw = tomllib.loads(text + f"diverge_after = {bad}")
        with pytest.raises(config_lib.ConfigError, match=r"^run\.diverge_after: "):
            config_lib.parse(raw)
