"""``job.serve()`` with ``replicas=2``: a SIGKILLed primary comes back from its backup and
the workers carry on (issue #45), attached by name or made by ``server.client(w)``: each
resends what the dead primary did not answer, over the new pipe the server sends on its
socket or rejoin pipe, and every one of its pushes counts once.

Worker ``w``'s ``i``-th push adds 1 to item ``(w, i)`` (``benchmarks/faults.py``'s
``ATTACHED``, case (i), or :func:`one_hot_pushes`), so a push applied twice or lost shows in
the final parameters. Every worker process is killed at the end, whatever happens."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import test_serve_kill_resume
from test_shard_log_restart import wait_for

import stalewise as sw

N = 1000  # pushes of each worker (kills after 100 and 200: the restarts come well before 1000)
faults = test_serve_kill_resume.faults  # the fixture: benchmarks/faults.py


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
def test_attached_workers_carry_on_when_each_primary_is_killed(
    tmp_path, caplog, consistency, faults, no_leaks
):
    (tmp_path / "worker.py").write_text(faults.ATTACHED)
    acks = [tmp_path / f"acked-{w}" for w in range(2)]
    bsp = consistency == "bsp"
    job = sw.Job({"items": np.zeros((2, 2 * N), np.float32)}, shards=2, replicas=2,
                 optimizer=sw.optim.sgd(2.0 if bsp else 1.0),  # BSP applies a round's mean
                 consistency=sw.BSP() if bsp else sw.ASP())  # fmt: skip
    name = f"serve-replicas-{os.getpid()}-{consistency}"
    procs = []
    with caplog.at_level(logging.INFO), job.serve(workers=2, name=name) as server:
        try:
            for w in range(2):
                args = [sys.executable, "worker.py", name, str(w), str(N), str(2 * N)]
                procs.append(subprocess.Popen(args, cwd=tmp_path, stderr=subprocess.PIPE,
                                              text=True, start_new_session=True))  # fmt: skip
            for k, at in ((0, N // 10), (1, N // 5)):
                wait_for(lambda at=at: min(faults._last_acked(acks)) >= at,
                         f"{at} pushes acknowledged", 60)  # fmt: skip
                assert any(p.poll() is None for p in procs), [
                    p.stderr.read()[-3000:] for p in procs
                ]
                primary, backup = server._procs[k], server._backups[k][0]
                os.kill(primary.pid, signal.SIGKILL)
                wait_for(lambda k=k, p=primary, b=backup: server._procs[k] is not p
                         and server._backups[k] and server._backups[k][0] is not b,
                         f"shard {k} back, with a new backup", 60)  # fmt: skip
            errs = [p.communicate(timeout=120)[1] for p in procs]
            assert [p.returncode for p in procs] == [0, 0], errs
            items = server.pull()["items"]
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert faults._last_acked(acks) == [N, N]
    assert (items[:, :N] == 1.0).all() and not items[:, N:].any(), np.argwhere(items[:, :N] != 1)
    for k in range(2):
        assert f"shard {k} restarted from its backup; workers [0, 1] carry on" in caplog.text


def one_hot_pushes(client, n: int, acked: str) -> None:
    """A worker process's body: ``ATTACHED``'s loop on a client of ``server.client(w)``."""
    w, steps = client.worker, 2 * n
    with open(acked, "a") as f:
        while (i := client.pushed) < n:
            client.pull(timeout=60)
            g = np.zeros((2, steps), np.float32)
            g[w, i] = -1.0
            client.push({"items": g}, timeout=60)
            client.wait(timeout=60)
            f.write(f"{client.pushed} {time.time()}\n")
            f.flush()
            time.sleep(0.004)
    client.close()


def test_own_loop_workers_carry_on_when_each_primary_is_killed(tmp_path, caplog, faults, no_leaks):
    """The README's own loop: the test hands ``server.client(w)`` to worker processes it
    starts; each primary is killed once while they push, and the server brings it back from
    its backup and sends each client its new pipe."""
    acks = [tmp_path / f"acked-{w}" for w in range(2)]
    job = sw.Job({"items": np.zeros((2, 2 * N), np.float32)}, shards=2, replicas=2,
                 optimizer=sw.optim.sgd(1.0))  # fmt: skip
    ctx, procs = mp.get_context("spawn"), []
    with caplog.at_level(logging.INFO), job.serve(workers=2) as server:
        try:
            for w in range(2):
                args = (server.client(w), N, str(acks[w]))
                procs.append(ctx.Process(target=one_hot_pushes, args=args, daemon=True))
                procs[-1].start()
                server.release(w)
            for k, at in ((0, N // 10), (1, N // 5)):
                wait_for(lambda at=at: min(faults._last_acked(acks)) >= at,
                         f"{at} pushes acknowledged", 60)  # fmt: skip
                assert all(p.is_alive() for p in procs), [p.exitcode for p in procs]
                primary, backup = server._procs[k], server._backups[k][0]
                os.kill(primary.pid, signal.SIGKILL)
                wait_for(lambda k=k, p=primary, b=backup: server._procs[k] is not p
                         and server._backups[k] and server._backups[k][0] is not b,
                         f"shard {k} back, with a new backup", 60)  # fmt: skip
            for p in procs:
                p.join(120)
            assert [p.exitcode for p in procs] == [0, 0]
            items = server.pull()["items"]
            stats = server.stats()
        finally:
            for p in procs:
                p.kill()
                p.join()
    assert faults._last_acked(acks) == [N, N]
    assert (items[:, :N] == 1.0).all() and not items[:, N:].any(), np.argwhere(items[:, :N] != 1)
    assert [s["applied"] for s in stats] == [2 * N, 2 * N], stats
    for k in range(2):
        assert f"shard {k} restarted from its backup; workers [0, 1] carry on" in caplog.text
