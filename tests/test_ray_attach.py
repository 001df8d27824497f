"""Loops you own on Ray: ``job.serve(runtime="ray")``, ``sw.attach(name)`` from drivers,
tasks and actors, and ``stalewise run --runtime ray``.

The cluster the Ray test files share (``ray_cluster`` in conftest.py:
``ray.cluster_utils``, two raylets of 2 CPUs each on this machine) serves the module;
it is shut down whatever happens, and every served job is closed by its ``with`` block. Deaths are real:
``ray.kill`` of an attached actor. Every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import child_procs
import numpy as np
import pytest
import ray

import stalewise as sw

TIMEOUT = 60.0  # seconds any one wait may take before the test is declared hung


def _job(consistency=None, shards=2, lr=0.5):
    return sw.Job(
        {"w": np.zeros(4, np.float32)},
        optimizer=sw.optim.sgd(lr),
        consistency=consistency or sw.ASP(),
        shards=shards,
    )


def _until(check, timeout=TIMEOUT, every=0.1):
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(every)


def test_attach_from_the_driver_and_a_task_ids_given_at_attach_and_freed_on_close(ray_cluster):
    with _job().serve(runtime="ray", workers=(1, 3), name="attach-ids") as server:
        me = sw.attach("attach-ids")  # Ray is initialised and no local door: Ray
        assert (me.worker, me.incarnation) == (0, 1)
        assert np.all(me.pull()["w"] == 0)
        me.push({"w": np.ones(4, np.float32)})
        # read-your-writes: a pull after a push includes it (w = -0.5 after sgd(0.5))
        assert np.allclose(me.pull()["w"], -0.5) and me.pull_has_own
        me.push({"w": np.ones(4, np.float32)})
        me.pull(own=False)
        assert not me.pull_has_own  # it did not wait for its push's acks
        assert me.wait().status == "applied"

        @ray.remote(num_cpus=0)
        def worker_task(pushes):
            import numpy as np

            import stalewise as sw

            client = sw.attach("attach-ids")
            who = (client.worker, client.incarnation, client.joined_at)
            for _ in range(pushes):
                client.pull()
                client.push({"w": np.ones(4, np.float32)})
            client.close()
            return who

        w, inc, joined_at = ray.get(worker_task.remote(3), timeout=TIMEOUT)
        assert (w, inc) == (1, 1)  # the lowest free id, its first incarnation
        assert joined_at >= 0
        assert server.attached() == {0}  # its close gave id 1 back
        assert server.job_pushes == me.job_pushes == 5
        # 2 of my pushes and 3 of the task's, each -0.5
        assert np.allclose(server.pull()["w"], -2.5)
        again = sw.attach("attach-ids")
        assert (again.worker, again.incarnation) == (1, 2)  # id 1 again, a new incarnation
        again.close()
        me.push({"w": np.ones(4, np.float32)})
        me.close()  # leaves at once: its last push is on both shards (or neither)
        assert server.attached() == set()
        versions = [s["version"] for s in server.stats()]
        assert versions == [6, 6] and server.job_pushes == 6


def test_a_killed_attached_actor_stops_holding_back_a_bsp_round(ray_cluster):
    with _job(sw.BSP(), lr=1.0).serve(runtime="ray", workers=(0, 2), name="bsp-kill") as server:

        @ray.remote(num_cpus=0)
        class Attached:
            def join(self):
                import stalewise as sw

                self.client = sw.attach("bsp-kill")
                self.client.pull()
                return self.client.worker

        me = sw.attach("bsp-kill")
        holder = Attached.remote()
        assert ray.get(holder.join.remote(), timeout=TIMEOUT) == 1
        assert server.attached() == {0, 1}
        me.pull()
        me.push({"w": np.ones(4, np.float32)})
        me.wait(timeout=TIMEOUT)
        with pytest.raises(TimeoutError):  # the round waits for worker 1's push
            me.pull(timeout=2.0)
        t = time.monotonic()
        ray.kill(holder)
        params = me.pull(timeout=TIMEOUT)  # the round closes over the live worker
        freed = time.monotonic() - t
        assert np.allclose(params["w"], -1.0)  # my push alone made the round
        _until(lambda: server.attached() == {0})
        print(f"a killed attached actor stopped holding the round after {freed:.1f} s")
        assert freed < 30
        late = sw.attach("bsp-kill")  # joins as id 1 again, at the live workers' clock
        assert (late.worker, late.incarnation, late.joined_at) == (1, 2, 1)
        late.pull(timeout=TIMEOUT)
        late.push({"w": np.ones(4, np.float32)})
        me.pull(timeout=TIMEOUT)
        me.push({"w": np.ones(4, np.float32)})
        # a round over both live workers: the mean of their pushes
        assert np.allclose(me.pull(timeout=TIMEOUT)["w"], -2.0)
        late.close()
        me.close()


def test_compressed_pushes_and_the_residual_goes_to_the_ids_next_incarnation(ray_cluster):
    target = np.arange(4096, dtype=np.float32)
    job = sw.Job(
        {"w": np.zeros(4096, np.float32)},
        optimizer=sw.optim.sgd(0.1),
        shards=2,
        codec=sw.codecs.topk(0.25),
    )
    with job.serve(runtime="ray", workers=(0, 2), name="topk") as server:
        client = sw.attach("topk")
        for _ in range(3):
            client.push({"w": client.pull()["w"] - target})
        assert client.wait().status == "applied"
        residual = client.residual.copy()
        assert np.abs(residual).sum() > 0  # top-k held most of each push back
        client.close()
        w = server.pull()["w"]
        assert 0 < np.count_nonzero(w) < 4096  # only the largest entries went through
        again = sw.attach("topk")
        assert (again.worker, again.incarnation) == (0, 2)
        assert np.array_equal(again.residual, residual)  # what it had not sent yet
        again.close()


OTHER_DRIVER = textwrap.dedent(
    """
    import numpy as np
    import stalewise as sw

    client = sw.attach("other-driver")  # RAY_ADDRESS is set: sw.attach connects to Ray
    for _ in range(4):
        client.pull()
        client.push({"w": np.ones(4, np.float32)})
    client.close()
    print("attached as", client.worker, client.incarnation)
    """
)


def test_another_driver_attaches_by_name_through_ray_address(ray_cluster, tmp_path):
    with _job().serve(runtime="ray", workers=(0, 2), name="other-driver") as server:
        env = dict(os.environ, RAY_ADDRESS=ray_cluster.address)
        done = subprocess.run(
            [sys.executable, "-c", OTHER_DRIVER],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "attached as 0 1" in done.stdout
        assert server.job_pushes == 4 and np.allclose(server.pull()["w"], -2.0)
        assert server.attached() == set()


def test_a_process_without_ray_is_told_in_one_line_where_it_looked(tmp_path):
    code = "import stalewise as sw\ntry:\n    sw.attach('nobody-here')\nexcept sw.AttachError as e:\n    print(e)"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "no job named 'nobody-here' is served on this machine" in lines[0]
    assert "not connected to Ray" in lines[0], done.stdout + done.stderr


def test_launch_refuses_an_unknown_runtime_in_one_line(tmp_path):
    from stalewise import launch

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with pytest.raises(
        launch.LaunchError, match=r"^--runtime must be 'local' or 'ray', got 'mars'$"
    ):
        launch.launch(str(script), [], workers=2, runtime="mars")


def test_attach_errors_are_one_line(ray_cluster):
    with pytest.raises(sw.AttachError, match="no job named 'nobody-here' is served on this Ray"):
        sw.attach("nobody-here")
    with pytest.raises(sw.AttachError, match="runtime 'mars'"):
        sw.attach("nobody-here", runtime="mars")
    with _job().serve(runtime="ray", workers=1, name="full") as server:
        one = server.client()
        with pytest.raises(sw.AttachError, match="the job is full") as e:
            sw.attach("full", runtime="ray")
        assert "\n" not in str(e.value)
        with pytest.raises(sw.AttachError, match="worker 0 is held by an attached process"):
            sw.attach("full", worker=0)
        with pytest.raises(ValueError, match="already served"):
            _job().serve(runtime="ray", workers=1, name="full")
        assert not one.stopping and one.may_begin(1) and not one.may_begin(0)
        ray.get([s.stop.remote() for s in server.shards], timeout=TIMEOUT)  # the job ends
        assert one.stopping
        with pytest.raises(ConnectionError, match="the job is stopping"):
            one.pull(timeout=TIMEOUT)
        one.close()


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import stalewise as sw

    PROBED = PROBE_NAMES
    rng = np.random.default_rng(0)
    A = rng.normal(size=(256, 16)).astype(np.float32)
    x_star = rng.normal(size=16).astype(np.float32)
    b = A @ x_star

    def loss(x):
        return float(0.5 * ((A @ x - b) ** 2).mean())

    if __name__ == "__main__":
        out = sys.argv[1]
        params = {"x": np.zeros(16, np.float32)}
        job = sw.Job(params, optimizer=sw.optim.sgd(0.1), shards=2)
        ctx = sw.init(job, steps=int(sys.argv[2]))
        print(f"rank {ctx.rank} starts", flush=True)
        if "RAISE" in out and ctx.rank == 1:
            raise ValueError("rank 1 cannot train")
        gen = np.random.default_rng(ctx.rank)
        pushes = 0
        while not ctx.should_stop():
            x = ctx.client.pull()["x"]
            idx = gen.integers(0, len(A), 32)
            grad = A[idx].T @ (A[idx] @ x - b[idx]) / len(idx)
            ctx.log(loss=loss(x))  # carried by the push: the launcher's progress line shows it
            ctx.client.push({"x": grad.astype(np.float32)})
            pushes += 1
        final = ctx.client.pull()["x"]
        ctx.close()
        import os, ray
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        with open(f"{out}-{ctx.rank}.json", "w") as f:
            json.dump({"rank": ctx.rank, "world": ctx.world_size, "pushes": pushes,
                       "loss": loss(final), "start": loss(0 * final), "node": node,
                       "env": {k: os.environ.get(k) for k in PROBED}}, f)
    """
)


# The launcher's environment in the test below: what its ranks on the shared cluster (whose
# processes never had these values) may see only if the launcher ships it
LAUNCHER_ENV = {
    "OMP_NUM_THREADS": None, "STALEWISE_PROBE": "ours", "SW_MARK": "named", "SW_PLAIN": "p",
    "HF_TOKEN": "named secret", "GITHUB_TOKEN": "g", "AWS_SECRET_ACCESS_KEY": "a",
    "DB_PASSWORD": "d", "KUBECONFIG": "/k", "VIRTUAL_ENV": "/launcher/venv",
    "STALEWISE_PROGRESS": "0.1",
}  # fmt: skip


def _launch(ray_cluster, tmp_path: Path, out: str, steps: int, *flags: str):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("PROBE_NAMES", repr(tuple(LAUNCHER_ENV))))
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.address)
    env.update({k: v for k, v in LAUNCHER_ENV.items() if v is not None})
    env.pop("OMP_NUM_THREADS", None)
    env.pop("RAY_COLOR_PREFIX", None)  # the launcher's default
    cmd = [sys.executable, "-m", "stalewise", "run", "--runtime", "ray", "--workers", "2", *flags]
    return subprocess.run(
        [*cmd, str(script), str(tmp_path / out), str(steps)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_stalewise_run_on_ray_trains_with_workers_on_both_nodes(ray_cluster, tmp_path):
    """... and each rank sees, of the launcher's environment, stalewise's own variables,
    the thread counts (1 unless set) and what --env names, a credential only when named:
    Ray keeps a rank's runtime_env where whoever reaches the cluster reads it."""
    done = _launch(ray_cluster, tmp_path, "out", 200, "--env", "SW_MARK", "--env", "HF_TOKEN")
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "each rank gets" in line]
    assert said == [
        "stalewise run: each rank gets HF_TOKEN, MKL_NUM_THREADS, NUMEXPR_NUM_THREADS, "
        "OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, STALEWISE_PROBE, STALEWISE_PROGRESS, SW_MARK "
        "from this "
        "environment (--env NAME for more)"
    ], done.stderr
    reports = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in reports] == [0, 1] and {r["world"] for r in reports} == {2}
    # the budget, spent by both; the budget rule's overshoot is at most workers - 1
    assert 200 <= sum(r["pushes"] for r in reports) <= 201
    assert min(r["pushes"] for r in reports) > 0
    for r in reports:  # least squares, from 9.0 at the start
        assert r["loss"] < 1e-3 * r["start"], r
        shipped = {"STALEWISE_PROBE", "STALEWISE_PROGRESS", "SW_MARK", "HF_TOKEN"}
        for k, v in LAUNCHER_ENV.items():
            assert (r["env"][k] == v) == (k in shipped), (k, r["env"][k])
        assert r["env"]["OMP_NUM_THREADS"] == "1"  # capped like the local launcher's workers
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {r["node"] for r in reports} == nodes and len(nodes) == 2  # one on each node
    assert "2 workers done on 2 Ray node(s)" in done.stderr
    # progress lines (every 0.1 s) show the ranks' ctx.log(loss=...), as their pushes carried it
    losses = re.findall(r"pushes/s, loss ([-+.e0-9]+), \d of 2 ranks live", done.stderr)
    assert losses and all(0 <= float(x) < 10 for x in losses), done.stderr


@pytest.mark.slow
def test_a_failed_ray_worker_makes_the_launcher_exit_1_naming_its_rank(ray_cluster, tmp_path):
    done = _launch(ray_cluster, tmp_path, "RAISE", 100)
    assert done.returncode == 1
    one = re.search(  # one line, where it happened, and the traceback in the rank's log
        r"stalewise run: rank 1 failed: ValueError: rank 1 cannot train \(\S+, line \d+\); "
        r"traceback in (\S+)\n",
        done.stderr,
    )
    assert one and "Traceback" not in done.stderr, done.stderr
    log = Path(one.group(1)).read_text()
    assert "rank 1 cannot train" in log
    # Ray's labels of the ranks' lines, in a pipe as in a file: no colour codes anywhere
    assert re.search(r"^\(rank 1 pid=\d+[^)]*\) rank 1 starts$", done.stdout, re.M), done.stdout
    assert "\x1b" not in done.stdout + done.stderr + log
    # rank 0 trained on alone, to the budget
    assert json.loads((tmp_path / "RAISE-0.json").read_text())["pushes"] >= 100


# A launched script whose ranks only poll should_stop(): the budget is spent by others
POLL = """
import time
import numpy as np
import stalewise as sw

if __name__ == "__main__":
    ctx = sw.init(sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1)))
    print(f"rank {ctx.rank} ready", flush=True)
    while not ctx.should_stop():
        time.sleep(0.05)
    ctx.close()
"""


@contextlib.contextmanager
def _poll_launch(tmp_path: Path, env: dict, *flags: str):
    """``stalewise run --runtime ray --workers 2 FLAGS poll.py`` in its own session, once
    both ranks said they are ready; at the end it and every process it started are killed."""
    script = tmp_path / "poll.py"
    script.write_text(POLL)
    cmd = [sys.executable, "-m", "stalewise", "run", "--runtime", "ray", "--workers", "2"]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [*cmd, *flags, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
            stderr=err, text=True, start_new_session=True,
        )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    started: set[int] = set()
    try:
        ready, deadline = 0, time.monotonic() + 180
        while ready < 2:
            try:
                ready += lines.get(timeout=max(deadline - time.monotonic(), 0)).endswith(" ready\n")
            except queue.Empty:
                raise AssertionError(f"no 2 ranks ready within 180 s: {_err(tmp_path)}") from None
        started = child_procs.descendants(proc.pid)
        yield proc, started
    finally:
        for pid in {proc.pid} | started | child_procs.descendants(proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        proc.stdout.close()


def _err(tmp_path: Path) -> str:
    return (tmp_path / "stderr.txt").read_text()


@pytest.mark.slow
def test_a_named_ray_launch_is_joined_with_sw_attach_from_another_process(ray_cluster, tmp_path):
    """``stalewise run --runtime ray --name N``: this process (a driver of the cluster, not
    the launcher) attaches by the name and spends the budget; the ranks end, the launch too."""
    name = f"ray-run-{os.getpid()}-{time.time_ns()}"
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.address)
    with _poll_launch(tmp_path, env, "--steps", "5", "--name", name) as (proc, _):
        client = sw.attach(name, runtime="ray")
        assert client.worker == 2  # the ids after the ranks'
        for _ in range(5):
            client.pull()
            client.push({"x": np.ones(4, np.float32)})
        client.close()
        assert proc.wait(120) == 0, _err(tmp_path)
        err = _err(tmp_path)
        assert re.search(r"stalewise run: 2 workers done on \d Ray node\(s\), 5 pushes$", err), err


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc (Linux)")
def test_a_killed_ray_launcher_leaves_no_process_it_started(tmp_path):
    """The launcher's own Ray instance (no RAY_ADDRESS): after ``kill -9`` of the launcher,
    every process it started (Ray's GCS, raylet, agents, the ranks' and shards' actors)
    is gone within 10 s. Ray's agents lived on for about a minute before."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with _poll_launch(tmp_path, env) as (proc, started):
        names = [_name(pid) for pid in started]
        assert names.count("ray::ScriptWorker.run") == 2, names  # Ray's processes are found
        proc.kill()
        proc.wait(30)
        left = child_procs.left(started, 10.0)
        assert not left, [_name(pid) for pid in left]


def _name(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()[:80]
    return "(gone)"


# Each Ray entry point of the library, in one interpreter that is connected to no cluster:
# where Job.train's driver, job.serve and calibrate's connection ran, and what sw.attach said
ENTRY_POINTS = """
import json
import ray
import stalewise as sw
from stalewise import calibrate, tasks

where = {}

def evaluate(params):
    where["Job.train"] = ray.get_runtime_context().gcs_address
    return {"loss": 0.0}

task = tasks.get("least-squares", n=64, d=4)
job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05))
job.train(task.loss_and_grad, data=task.batches, workers=1, steps=20, runtime="ray",
          evaluate=evaluate)
with job.serve(runtime="ray", workers=1):
    where["job.serve"] = ray.get_runtime_context().gcs_address
with calibrate._connected("ray"):
    where["calibrate"] = ray.get_runtime_context().gcs_address
try:
    sw.attach("anyone", runtime="ray")
except sw.AttachError as e:
    where["sw.attach"] = str(e)
print(json.dumps(where))
"""

TOML = """
[task]
name = "least-squares"
args = { n = 64, d = 4 }
[optimizer]
name = "sgd"
lr = 0.05
[run]
workers = 1
steps = 20
runtime = "ray"
"""


@pytest.mark.slow
def test_no_entry_point_joins_the_cluster_another_user_recorded(ray_address, tmp_path):
    """Ray's default (ray.init() with no address) joins the cluster recorded in
    RAY_TMPDIR/ray/ray_current_cluster, whoever wrote it. Here the record names a real
    cluster (the shared one) and belongs to uid 65534: Job.train, job.serve, calibrate,
    stalewise train and stalewise run each start a new local instance instead, and
    sw.attach (whose default is "auto") refuses in one line. The cluster's own table of
    drivers shows that none of them joined it."""
    import tempfile

    import ray_helpers

    if os.getuid() != 0:
        pytest.skip("making a file of another user's needs root")
    drivers = ray_helpers.shared().global_state.job_table
    before = len(drivers())
    base = Path(tempfile.mkdtemp(prefix="swr", dir="/tmp"))  # short: Ray's socket paths
    try:
        record = base / "ray" / "ray_current_cluster"
        record.parent.mkdir()
        record.write_text(ray_address)
        os.chown(record, 65534, 65534)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["RAY_TMPDIR"] = str(base)

        (tmp_path / "ls.toml").write_text(TOML)
        (tmp_path / "train.py").write_text(SCRIPT.replace("PROBE_NAMES", "()"))
        commands = {
            "entry points": ["-c", ENTRY_POINTS],
            "train": ["-m", "stalewise", "train", "ls.toml", "--out", "out", "-q"],
            "run": ["-m", "stalewise", "run", "--runtime", "ray", "--workers", "1", "train.py",
                    str(tmp_path / "r"), "20"],
        }  # fmt: skip
        with contextlib.ExitStack() as stack:  # the three at once, each in its own session
            pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs = {
                what: stack.enter_context(
                    child_procs.session([sys.executable, *cmd], tmp_path, env=env, **pipes)
                )
                for what, cmd in commands.items()
            }
            deadline = time.monotonic() + 300
            done = {
                what: p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
                for what, p in procs.items()
            }
        for what, (out, err) in done.items():
            assert procs[what].returncode == 0, (what, err[-3000:])
            assert ray_address not in out + err, (what, err[-3000:])
        where = json.loads(done["entry points"][0].strip().splitlines()[-1])
        assert set(where) == {"Job.train", "job.serve", "calibrate", "sw.attach"}, where
        assert ray_address not in where.values()
        assert where["sw.attach"] == (
            f"job 'anyone': this process cannot reach a Ray cluster (address 'auto': {record} "
            "is not a file of yours (its owner is uid 65534, you are uid 0): give HOST:PORT "
            "of your cluster)"
        )
        assert "(a new local instance;" in done["run"][1]
        assert len(drivers()) == before
    finally:
        shutil.rmtree(base, ignore_errors=True)
