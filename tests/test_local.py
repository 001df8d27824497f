"""The local runtime: real processes, real shared memory, clean shutdown."""

import contextlib
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import mp_helpers
import numpy as np
import pytest

import stalewise as sw
from stalewise.runtime.local.shm import leaked_blocks


def quadratic_job(**kw):
    return sw.Job({"x": np.zeros(8, np.float32)}, optimizer=sw.optim.sgd(0.2), **kw)


def test_serve_pull_push_in_this_process(no_leaks):
    job = sw.Job(
        {"a": np.zeros((2, 3), np.float32), "b": np.ones(5, np.float32)},
        optimizer=sw.optim.sgd(1.0),
        shards=2,
    )
    with job.serve(workers=1) as server:
        client = server.client(0)
        params = client.pull()
        assert params["a"].shape == (2, 3)
        client.push({"a": np.ones((2, 3), np.float32), "b": np.full(5, 2.0, np.float32)})
        result = client.wait(timeout=10)
        assert result.status == "applied" and result.versions == (1, 1)
        mine = client.pull()  # read-your-writes: an acknowledged push is in the next pull
        np.testing.assert_array_equal(mine["a"], -np.ones((2, 3)))
        now = server.pull()
        np.testing.assert_array_equal(now["a"], -np.ones((2, 3)))
        np.testing.assert_array_equal(now["b"], -np.ones(5))
        with pytest.raises(
            ValueError, match=r"params\['a'\]: expected shape \(2, 3\), got \(3, 2\)"
        ):
            client.push({"a": np.ones((3, 2), np.float32), "b": np.ones(5, np.float32)})
        with pytest.raises(ValueError, match="unknown worker 1"):
            server.client(1)
        client.push({"a": np.full((2, 3), np.nan, np.float32), "b": np.ones(5, np.float32)})
        result = client.wait(timeout=10)
        assert result.status == "refused" and result.seq == 1
        assert result.reason.startswith("shard 0: not_finite")
        np.testing.assert_array_equal(server.pull()["a"], now["a"])  # the bad push changed nothing
        assert server.stats()[0]["rejected"] == {"not_finite": 1}
        client.close()


def test_a_pull_right_after_a_push_includes_it(no_leaks):
    """Issue 19: a pull made straight after a push (no ``wait()``) includes that push;
    before, it read the snapshot of the moment, which mostly did not. ``own=False``
    keeps the pipelined pull, and ``pull_has_own`` says it may miss the push."""
    job = sw.Job({"x": np.zeros(1000, np.float32)}, optimizer=sw.optim.sgd(1.0), shards=2)
    ones = {"x": np.ones(1000, np.float32)}
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull()
        for i in range(1, 51):
            client.push(ones)
            x = client.pull(copy=False, timeout=10)["x"]
            assert client.pull_has_own
            assert x[0] == x[-1] == -i, f"push {i}: pulled {x[0]}, {x[-1]}"
        client.push(ones)
        client.pull(own=False, timeout=10)
        assert not client.pull_has_own  # its acks were not read: it may be missing
        assert client.wait(timeout=10).status == "applied"
        client.close()


def _plain_sgd_on_least_squares(task, steps: int, lr: float) -> np.ndarray:
    params = task.init_params(0)
    batches = task.batches(0, 1)
    for _ in range(steps):
        _, g = task.loss_and_grad(params, next(batches))
        params = {"x": params["x"] - lr * g["x"]}
    return params["x"]


def test_one_worker_in_a_loop_you_own_matches_the_plain_loop(no_leaks):
    """The own-loop path of the README (pull, step, push; no wait): one worker is the
    plain single-process loop, to float precision. Before read-your-writes each pull
    missed the worker's own last step."""
    from stalewise import tasks

    task = tasks.get("least-squares", n=256, d=32, batch_size=16, noise=0.1)
    steps, lr = 60, 0.05
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(lr))
    with job.serve(workers=1) as server:
        client = server.client(0)
        batches = task.batches(0, 1)
        for _ in range(steps):
            params = client.pull(timeout=10)
            _, grads = task.loss_and_grad(params, next(batches))
            client.push(grads)
        assert client.wait(timeout=10).status == "applied"
        got = server.pull()["x"]
        client.close()
    np.testing.assert_allclose(got, _plain_sgd_on_least_squares(task, steps, lr), rtol=1e-5)


def test_processes_started_while_serving_get_a_share_of_the_cores(no_leaks, monkeypatch):
    """Issue 19: a loop you own starts its workers itself; while the server runs they
    inherit a thread cap of cores // workers (torch's default of one thread per core
    each ran pushes 5.8x slower), which a variable the user set overrides, and the
    parent's environment is as it was once the server closes."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    share = str(max(1, (os.cpu_count() or 1) // 2))
    ctx = mp.get_context("spawn")
    with quadratic_job().serve(workers=2):
        assert os.environ["OMP_NUM_THREADS"] == share
        queue = ctx.Queue()
        proc = ctx.Process(target=mp_helpers.report_torch_threads, args=(queue,))
        proc.start()
        try:
            assert queue.get(timeout=120) == (share, int(share))
        finally:
            proc.join(30)
    assert "OMP_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with quadratic_job().serve(workers=2):
        assert os.environ["OMP_NUM_THREADS"] == "3"  # the user's choice stands
    assert os.environ["OMP_NUM_THREADS"] == "3"


def _math_threads(monkeypatch=None) -> list[int]:
    """Each loaded math library's threads here; with ``monkeypatch``, no thread variable set."""
    from threadpoolctl import threadpool_info

    from stalewise.runtime.base import THREAD_VARS

    for var in THREAD_VARS if monkeypatch is not None else ():
        monkeypatch.delenv(var, raising=False)
    return [lib["num_threads"] for lib in threadpool_info()]


@pytest.mark.parametrize("user_set", [False, True])
def test_the_parents_evaluation_runs_on_a_workers_share_of_the_threads(
    no_leaks, monkeypatch, user_set
):
    """Beside the workers, the parent runs ``evaluate`` on cores // workers math-library
    threads (on all of them it took both cores at once and halved a run); a thread variable
    the user set leaves it as it is, and the parent's libraries are as they were after."""
    before, seen = max(_math_threads(monkeypatch)), []
    if user_set:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")

    def evaluate(params):
        seen.append(max(_math_threads()))
        return {"x0": float(params["x"][0])}

    quadratic_job().train(
        mp_helpers.quadratic_loss_and_grad, data=mp_helpers.quadratic_data, workers=2,
        steps=80, evaluate=evaluate, emulation=sw.Emulation(delays={0: 0.002, 1: 0.002}),
        metrics=sw.Metrics(every=0.02),
    )  # fmt: skip
    assert len(seen) >= 3, seen
    share = max(1, (os.cpu_count() or 1) // 2)
    assert set(seen) == ({before} if user_set else {min(before, share)}), (before, seen)
    assert max(_math_threads()) == before


def test_a_capped_evaluation_is_capped_at_every_call_and_lifted_after(monkeypatch):
    """The first call caps the libraries loaded then; the later ones, those it loaded too."""
    from stalewise.runtime.local.procs import Capped

    before, seen = _math_threads(monkeypatch), []
    capped = Capped(lambda p: seen.append(_math_threads()) or {"loss": float(p)}, 1)
    assert [capped(2.0), capped(3.0)] == [{"loss": 2.0}, {"loss": 3.0}]
    assert len(seen) == 2 and all(n == 1 for call in seen for n in call), seen
    assert _math_threads() == before


def test_read_your_writes_after_every_ack(no_leaks):
    job = sw.Job({"x": np.zeros(1000, np.float32)}, optimizer=sw.optim.sgd(1.0), shards=2)
    with job.serve(workers=1) as server:
        client = server.client(0)
        for i in range(1, 60):
            client.push({"x": np.ones(1000, np.float32)})
            client.wait(timeout=10)
            x = client.pull(copy=False)["x"]
            assert x[0] == x[-1] == -i
        client.close()


@pytest.mark.parametrize("consistency", [sw.BSP(), sw.SSP(1)], ids=str)
def test_a_worker_too_far_ahead_waits_for_the_slowest(no_leaks, consistency):
    """The pull of a worker ahead of the gate blocks (and survives its timeout) until the slowest pushes."""
    job = sw.Job(
        {"x": np.zeros(4, np.float32)},
        optimizer=sw.optim.sgd(1.0),
        consistency=consistency,
        shards=2,
    )
    ones = {"x": np.ones(4, np.float32)}
    with job.serve(workers=2) as server:
        fast, slow = server.client(0), server.client(1)
        fast.pull(), slow.pull()
        for _ in range(int(consistency.bound) + 1):  # BSP: 1 push ahead; SSP(1): 2 pushes ahead
            fast.push(ones)
            fast.wait(timeout=10)
            if consistency.kind == "ssp" and _ == 0:
                fast.pull(timeout=10)  # one clock ahead is still allowed
        with pytest.raises(TimeoutError):
            fast.pull(timeout=0.3)
        with pytest.raises(TimeoutError):  # asking again does not send a second request
            fast.pull(timeout=0.2)
        slow.push(ones)
        slow.wait(timeout=10)
        x = fast.pull(timeout=10)["x"]
        expected = -1.0 if consistency.kind == "bsp" else -3.0  # BSP: one averaged round
        np.testing.assert_array_equal(x, np.full(4, expected, np.float32))
        fast.push(ones)  # the client is still in step with the shards
        assert fast.wait(timeout=10).status == "applied"
        fast.close(), slow.close()


@pytest.mark.parametrize("shards", [1, 2])
def test_pulls_are_consistent_snapshots(no_leaks, shards):
    """A pusher moves all parameters together; a torn pull would mix two values within a shard."""
    job = sw.Job({"x": np.zeros(200_000, np.float32)}, optimizer=sw.optim.sgd(1.0), shards=shards)
    ctx = mp.get_context("spawn")
    with job.serve(workers=2) as server:
        pusher = ctx.Process(target=mp_helpers.uniform_pusher, args=(server.client(0), 300))
        pusher.start()
        observer = server.client(1)
        seen = set()
        ranges = job.config.ranges
        while pusher.is_alive():
            x = observer.pull(copy=False)["x"]
            for lo, hi in ranges:
                part = x[lo:hi]
                assert part.min() == part.max(), "torn pull"
                seen.add(float(part[0]))
        pusher.join()
        assert pusher.exitcode == 0
        assert len(seen) > 3  # we really pulled while it pushed
        observer.close()
        assert float(server.pull()["x"][0]) == -300.0


@pytest.mark.parametrize("consistency", [sw.ASP(), sw.SSP(2), sw.BSP()], ids=str)
def test_train_converges_and_leaves_nothing_behind(no_leaks, consistency):
    job = quadratic_job(consistency=consistency, staleness=sw.staleness.inverse(), shards=2)
    result = job.train(
        mp_helpers.quadratic_loss_and_grad,
        data=mp_helpers.quadratic_data,
        workers=3,
        steps=240,
        emulation=sw.Emulation(stragglers={2: 2.0}, delays={0: 0.001, 1: 0.001, 2: 0.001}),
        metrics=sw.Metrics(every=0.05),
    )
    np.testing.assert_allclose(result.params["x"], np.arange(8), atol=0.05)
    assert 240 <= result.pushes < 240 + 3
    assert result.records and result.records[-1]["pushes"] == result.pushes
    if consistency.kind == "bsp":
        assert result.stats["staleness_max"] == 0
        assert result.stats["version"] <= result.pushes / 3 + 1  # one averaged update per round
    else:
        assert result.stats["version"] == result.stats["applied"] == result.pushes


def test_records_are_taken_on_the_evaluation_grid(no_leaks):
    # the driver's cadence (a record at once, then at k * eval_interval), as the simulator
    # keeps it: the local host waits no longer than the next record's time (it used to
    # wait a fixed 50 ms, so the first record came at 0.05 s and the others up to 50 ms late)
    every = 0.07
    result = quadratic_job().train(
        mp_helpers.quadratic_loss_and_grad, data=mp_helpers.quadratic_data, workers=2,
        steps=300, emulation=sw.Emulation(delays={0: 0.002, 1: 0.002}),
        metrics=sw.Metrics(every=every),
    )  # fmt: skip
    times = [r["time"] for r in result.records[:-1]]  # the last is the end's, off the grid
    assert len(times) >= 5, times
    lags = [t - math.floor(t / every + 1e-9) * every for t in times]
    assert times[0] < 0.03, times
    assert float(np.median(lags)) < 0.01, lags


def test_error_in_user_code_shows_traceback_and_cleans_up(no_leaks):
    job = quadratic_job()
    with pytest.raises(sw.WorkerError, match=r"(?s)worker \d failed.*ValueError: boom at batch 3"):
        job.train(
            mp_helpers.failing_loss_and_grad,
            data=mp_helpers.counting_data,
            workers=2,
            steps=100,
            failures=sw.Failures("fail"),  # the default restarts it first: see test_faults.py
        )


def test_unpicklable_loss_is_refused_with_a_clear_error(no_leaks):
    with pytest.raises(TypeError, match="loss_and_grad must be picklable"):
        quadratic_job().train(
            lambda p, b: (0.0, p), data=mp_helpers.quadratic_data, workers=1, steps=1
        )
    with pytest.raises(ValueError, match=r"stragglers\[5\]|unknown worker 5"):
        quadratic_job().train(
            mp_helpers.quadratic_loss_and_grad,
            data=mp_helpers.quadratic_data,
            workers=2,
            steps=1,
            emulation=sw.Emulation(stragglers={5: 2.0}),
        )


def test_ctrl_c_stops_every_process_and_frees_shared_memory(tmp_path):
    tag = f"stalewise-test-{os.getpid()}-{time.time_ns()}"
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            import numpy as np, stalewise as sw, mp_helpers

            def on_record(rec):
                print("training", flush=True)

            if __name__ == "__main__":
                job = sw.Job({{"x": np.zeros(8, np.float32)}}, optimizer=sw.optim.sgd(0.1))
                job.train(mp_helpers.slow_loss_and_grad, data=mp_helpers.counting_data, workers=2,
                          steps=10**6, metrics=sw.Metrics(every=0.1, on_record=on_record))
            """
        )
    )
    env = dict(os.environ, STALEWISE_TEST_TAG=tag)
    # The job starts with Ctrl-C at its default, however pytest was started: a background
    # job of a non-interactive shell (`pytest &` in a script) inherits SIGINT ignored, and
    # so would the job, which then never sees the signal. Ignored here for a moment, as
    # there, so that this test always checks that it is reset for the job.
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        assert proc.stdout.readline().strip() == b"training"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:  # on a failure too: no process, pipe or worker left behind for later tests
        proc.kill()
        proc.wait(10)
        proc.stdout.close(), proc.stderr.close()
        if proc.returncode == -signal.SIGKILL:  # the job did not stop: its workers are ours
            for pid in mp_helpers.tagged_pids(tag):
                os.kill(pid, signal.SIGKILL)
    assert b"KeyboardInterrupt" in err
    deadline = time.time() + 10
    while time.time() < deadline and mp_helpers.tagged_pids(tag):
        time.sleep(0.1)
    assert mp_helpers.tagged_pids(tag) == []
    assert [b for b in leaked_blocks() if b.startswith(f"stalewise-{proc.pid}-")] == []


def test_a_push_refused_by_one_shard_is_applied_by_none(no_leaks):
    job = sw.Job(
        {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)},
        optimizer=sw.optim.sgd(1.0),
        shards=2,
    )
    assert job.config.ranges == [(0, 4), (4, 8)]
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull()
        client.push({"a": np.full(4, np.nan, np.float32), "b": np.ones(4, np.float32)})
        result = client.wait(timeout=10)
        assert result.status == "refused" and result.kind == "not_finite"
        assert "shard 1: not_finite" in result.reason and "leaf 'a'" in result.reason
        np.testing.assert_array_equal(server.pull()["b"], np.zeros(4))
        assert [s["version"] for s in server.stats()] == [0, 0]
        client.push(
            {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}
        )  # the worker goes on
        assert client.wait(timeout=10).status == "applied"
        client.close()


def test_bsp_pulls_never_see_the_previous_round(no_leaks):
    """The published clock never runs ahead of the published params."""
    n = 1_000_000  # big enough that publishing a snapshot takes a while
    job = sw.Job({"x": np.zeros(n, np.float32)}, optimizer=sw.optim.sgd(1.0), consistency=sw.BSP())
    ones = {"x": np.ones(n, np.float32)}
    with job.serve(workers=2) as server:
        a, b = server.client(0), server.client(1)
        for r in range(1, 16):
            a.pull(timeout=10), b.pull(timeout=10)
            a.push(ones), a.wait(timeout=10)
            b.push(ones), b.wait(timeout=10)  # closes the round
            x = a.pull(copy=False, timeout=10)["x"]
            assert x[0] == x[-1] == -r, f"round {r}: pulled {x[0]}"
        a.close(), b.close()


def test_closing_a_client_whose_gated_pull_timed_out(no_leaks):
    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(1.0), consistency=sw.BSP())
    ones = {"x": np.ones(4, np.float32)}
    with job.serve(workers=2) as server:
        c0, c1 = server.client(0), server.client(1)
        c0.pull(), c1.pull()
        c0.push(ones)
        with pytest.raises(TimeoutError):
            c0.pull(timeout=0.2)
        c0.close()  # leaves with its pull still queued at the shard
        c1.push(ones)
        assert c1.wait(timeout=10).status == "applied"  # the shard is alive
        c1.pull(timeout=10)  # and does not wait for the worker that left
        c1.close()


def test_a_worker_that_dies_without_leaving_does_not_block_the_others(no_leaks):
    job = sw.Job({"x": np.zeros(8, np.float32)}, optimizer=sw.optim.sgd(1.0), consistency=sw.BSP())
    ctx = mp.get_context("spawn")
    with job.serve(workers=2) as server:
        c0 = server.client(0)
        p = ctx.Process(target=mp_helpers.push_once_and_die, args=(server.client(1),))
        p.start()
        server.release(1)
        p.join(60)
        assert p.exitcode == 1
        c0.pull(timeout=10)
        c0.push({"x": np.ones(8, np.float32)})
        c0.wait(timeout=10)
        c0.pull(timeout=10)  # worker 1 is gone: the round closed without it
        c0.close()


def test_one_bad_batch_does_not_end_an_asynchronous_job(no_leaks):
    result = quadratic_job().train(
        mp_helpers.nan_once_loss_and_grad, data=mp_helpers.counting_data, workers=2, steps=40
    )
    assert result.stats["rejected"] == {"not_finite": 2}  # batch 3 of each worker
    assert np.isfinite(result.params["x"]).all()


def test_a_worker_process_that_vanishes_is_reported(no_leaks):
    with pytest.raises(sw.WorkerError, match=r"died without a word \(exit code 3\)"):
        quadratic_job().train(
            mp_helpers.dying_loss_and_grad, data=mp_helpers.counting_data, workers=2, steps=100
        )


def test_observer_stays_in_step_after_a_timed_out_pull(no_leaks):
    job = sw.Job({"x": np.zeros(300_000, np.float32)}, optimizer=sw.optim.sgd(1.0), shards=2)
    with job.serve(workers=1) as server:
        with contextlib.suppress(TimeoutError):
            server.pull(timeout=0)
        stats = server.stats()
        assert all(isinstance(s, dict) and s["version"] == 0 for s in stats)
        assert server.pull(timeout=10)["x"].shape == (300_000,)
