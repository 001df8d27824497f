"""Shards fork from the local runtime's own forkserver (procs.shard_context): capped like spawned
shards, gone with the training process however it ends, the user's forkserver left alone."""

import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import forkserver
from pathlib import Path

import numpy as np

import stalewise as sw
from stalewise.runtime.local import procs
from stalewise.runtime.local.server import LocalServer

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, os, sys, time
from multiprocessing import forkserver
import numpy as np
import stalewise as sw
from stalewise.runtime.local.server import LocalServer

if __name__ == "__main__":
    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1), replicas=2)
    LocalServer(job.config, 1).close()  # the first server of a process spawns its shards
    with LocalServer(job.config, 1) as server:
        pids = [p.pid for p in server._procs] + [b[0].pid for b in server._backups]
        env = open(f"/proc/{pids[0]}/environ", "rb").read().split(b"\\0")
        print(json.dumps({"pids": pids, "server": int(open(f"/proc/{pids[0]}/stat").read().split()[3]),
                          "omp": [v.decode() for v in env if v.startswith(b"OMP_NUM_THREADS=")],
                          "users": forkserver._forkserver._forkserver_pid}), flush=True)
        if sys.argv[1] == "hang":
            time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _run(tmp_path: Path, how: str) -> tuple[subprocess.Popen, dict]:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    p = subprocess.Popen([sys.executable, str(tmp_path / "train.py"), how], stdout=subprocess.PIPE,
                         text=True, env={**env, "PYTHONPATH": str(REPO)})  # fmt: skip
    line = p.stdout.readline()
    assert line, p.communicate(timeout=60)
    return p, json.loads(line)


def _gone(pids: list[int], within: float) -> list[int]:
    end = time.monotonic() + within
    while time.monotonic() < end and any(map(_alive, pids)):
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


def test_a_killed_training_process_takes_its_forkserver_and_shards_with_it(tmp_path):
    p, seen = _run(tmp_path, "hang")
    try:
        assert seen["server"] != p.pid and _alive(seen["server"])  # forked, not spawned
        assert seen["omp"] == ["OMP_NUM_THREADS=1"]  # the caps a spawned shard had
        assert seen["users"] is None  # multiprocessing's own forkserver was not started
        os.kill(seen["pids"][0], signal.SIGSTOP)  # only the kernel's PDEATHSIG can end it now
        os.kill(p.pid, signal.SIGKILL)
        assert _gone([seen["server"], *seen["pids"]], 5) == []
    finally:
        for pid in [p.pid, seen["server"], *seen["pids"]]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        p.communicate(timeout=60)


def test_the_forkserver_ends_with_a_training_process_that_exits(tmp_path):
    p, seen = _run(tmp_path, "exit")
    p.communicate(timeout=60)
    assert p.returncode == 0
    assert _gone([seen["server"], *seen["pids"]], 5) == []


def test_a_server_made_in_another_thread_first_spawns_its_shards(no_leaks, monkeypatch):
    monkeypatch.setattr(procs, "_warm", None)
    monkeypatch.setattr(procs, "_servers", 1)
    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1))
    made = []
    t = threading.Thread(target=lambda: made.append(LocalServer(job.config, 1)))
    t.start()
    t.join(120)
    with made[0] as server:
        assert server._ctx is mp.get_context("spawn") and procs._warm is None
        client = server.client(0)
        client.push({"x": np.ones(4, np.float32)})
        client.close()
    assert forkserver._forkserver._preload_modules == ["__main__"]  # the user's, untouched


def _join_at(go: threading.Barrier, p) -> None:
    go.wait()
    p.join(10)


def test_threads_joining_a_killed_forked_process_at_once_all_see_how_it_died():
    """Its exit code comes once through the forkserver's pipe: threads that join it at once
    take turns (else the second reads the pipe's end, exit code 255: "shard 1 has died (exit
    code 255)" for a SIGKILL, the server's watcher and a call checking the shards at once)."""
    procs.shard_context()
    ctx = procs.shard_context()  # the second server's: forked from this process's forkserver
    assert procs._warm is not None
    for _ in range(20):  # without the turns, about half the kills read 255
        p = ctx.Process(target=time.sleep, args=(60,), daemon=True)
        p.start()
        go = threading.Barrier(3)
        joins = [threading.Thread(target=_join_at, args=(go, p)) for _ in range(2)]
        for t in joins:
            t.start()
        go.wait()
        os.kill(p.pid, signal.SIGKILL)
        for t in joins:
            t.join(20)
        assert p.exitcode == -signal.SIGKILL


ORPHAN = """
import multiprocessing as mp, sys, time
from stalewise.runtime.local import procs

def child(path, conn):
    procs._parent_gone = lambda sentinel, cleanup: None  # its watcher thread loses the race
    procs.die_with_parent(cleanup=lambda: open(path, "w").close())
    conn.send(mp.current_process().pid)
    try:
        conn.recv()  # the parent's end of the pipe: EOF once it dies, then this exits
    except EOFError:
        pass

if __name__ == "__main__":
    a, b = mp.get_context("spawn").Pipe()
    mp.get_context("spawn").Process(target=child, args=(sys.argv[1], b)).start()
    b.close()
    print(a.recv(), flush=True)
    time.sleep(60)
"""


def test_a_child_that_exits_when_its_parent_dies_still_cleans_up(tmp_path):
    """A shard sees its parent's pipe end and may exit before its watcher thread runs (the
    thread does nothing here): its exit runs the clean-up (a named block's unlink) all the
    same. On the code before, nothing did."""
    marker, script = tmp_path / "cleaned", tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    parent = subprocess.Popen([sys.executable, str(script), str(marker)],
                              stdout=subprocess.PIPE, cwd=REPO)  # fmt: skip
    child = None
    try:
        child = int(parent.stdout.readline())
        assert not marker.exists()
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists()
    finally:
        parent.kill()
        parent.wait(10)
        parent.stdout.close()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
