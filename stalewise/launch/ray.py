"""``stalewise run --runtime ray``: a :class:`ScriptWorker` actor per rank (docs/ray.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from stalewise.launch import context
from stalewise.launch.context import Context
from stalewise.launch.progress import Progress, end_lines, pushes_of
from stalewise.launch.ranks import failure, rank_env, room
from stalewise.runtime.base import THREAD_VARS
from stalewise.runtime.errors import BudgetSpent
from stalewise.runtime.logs import child_logging
from stalewise.runtime.ray import cluster_address, connect, import_ray
from stalewise.runtime.ray.client import attach

log = logging.getLogger(__name__)

#: What a rank on Ray gets of the launcher's environment (prefixes end "_"), and ``--env``'s.
SHIPPED = ("STALEWISE_", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", *THREAD_VARS)
#: What ``--env-all`` leaves out unless named: the launcher's machine, devices and session.
NOT_SHIPPED = (
    "PWD", "OLDPWD", "HOME", "USER", "LOGNAME", "SHELL", "SHLVL", "HOSTNAME", "_", "TERM",
    "DISPLAY", "TMPDIR", "MAIL", "CUDA_VISIBLE_DEVICES", "NVIDIA_", "ROCR_", "HIP_", "SSH_",
    "XDG_", "RAY_", "PYTEST_"
)  # fmt: skip
#: ... and every name that may be a credential's.
SECRET = re.compile(
    r"SECRET|TOKEN|PASSW|CREDENTIAL|(^|_)KEY($|_)|AUTH|COOKIE|KRB5|KUBECONFIG|PRIVATE|NETRC"
    r"|SESSION|CERT"
)


def shipped_env(
    named: list[str] = (), every: bool = False, environ: dict[str, str] | None = None
) -> dict[str, str]:
    """The variables of ``environ`` a rank on Ray gets: :data:`SHIPPED`, the ``named`` ones,
    and with ``every`` (``--env-all``) the rest but :data:`NOT_SHIPPED` and :data:`SECRET`."""
    environ = os.environ if environ is None else environ

    def among(name: str, names: tuple) -> bool:
        return name in names or name.startswith(tuple(n for n in names if n.endswith("_")))

    return {
        k: v
        for k, v in environ.items()
        if k in named
        or among(k, SHIPPED)
        or (every and not among(k, NOT_SHIPPED) and not SECRET.search(k))
    }


#: The launcher's reaper (docs/design-notes.md): kills what it started once its stdin closes.
REAPER = r"""
import glob, os, select, signal, sys
root, me, mark = int(sys.argv[1]), os.getpid(), b"\0%s\0" % os.fsencode(sys.argv[2])
def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""
def start(p):
    return read(f"/proc/{p}/stat").rsplit(b")", 1)[-1].split()[19:20]
def tree(roots):
    seen, todo = {}, list(roots)
    while todo:
        if (p := todo.pop()) not in seen and (t := start(p)):
            seen[p] = t
            todo += [int(c) for f in glob.glob(f"/proc/{p}/task/*/children") for c in read(f).split()]
    return seen
known = {}
while not select.select([0], [], [], 0.5)[0]:
    known.update(tree([root]))  # kept: a scan as the launcher dies finds none
alive = [p for p, t in known.items() if start(p) == t]
alive += [int(f.split("/")[2]) for f in glob.glob("/proc/[0-9]*/environ") if mark in b"\0" + read(f)]
for sig in (signal.SIGSTOP, signal.SIGKILL):
    alive = [p for p in tree(alive) if p not in (root, me)]
    for p in alive:
        try:
            os.kill(p, sig)
        except OSError:
            pass
"""
_reapers: list[subprocess.Popen] = []  # held: the pipe closes when this process ends


def reap_with_me() -> None:
    """Starts :data:`REAPER` (Linux): what this process starts dies with it, however it ends."""
    if sys.platform.startswith("linux") and not _reapers:
        os.environ["STALEWISE_REAPED_WITH"] = f"{os.getpid()}-{time.time_ns()}"
        mark = f"STALEWISE_REAPED_WITH={os.environ['STALEWISE_REAPED_WITH']}"
        _reapers.append(
            subprocess.Popen(
                [sys.executable, "-I", "-c", REAPER, str(os.getpid()), mark],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # not in the launcher's group: a Ctrl-C there spares it
            )
        )


class _Barrier:
    """The launcher's start barrier on Ray (the door's rendezvous)."""

    def __init__(self, door: Any, parties: int):
        self.door, self.parties = door, parties

    def wait(self, timeout: float) -> None:
        ray = import_ray()
        if not ray.get(self.door.rendezvous.remote(self.parties, timeout), timeout=timeout + 30):
            raise threading.BrokenBarrierError


class ScriptWorker:
    def __init__(self, rank: int):
        self.rank = rank

    def __repr__(self) -> str:  # Ray's label for the actor's output
        return f"rank {self.rank}"

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(
        self,
        script: str,
        source: str,
        argv: list[str],
        name: str,
        rank: int,
        world: int,
        steps: int | None,
        local: tuple[int, int] = (0, 1),
        cwd: str | None = None,
    ) -> dict:
        """Runs the script as ``__main__`` as rank ``rank``; returns ``node``, ``refused``
        (pushes past the budget) and ``failed`` (its error's line, or None)."""
        child_logging(f"rank {rank}")
        client = attach(name, worker=rank)
        ctx = Context(rank, world, client, steps=steps, _barrier=_Barrier(client._door, world))
        context.become(ctx)
        path = Path(script)
        if not path.is_file():  # not on this node: the launcher's copy of its text
            path = Path(tempfile.mkdtemp(prefix="stalewise-run-")) / path.name
            path.write_text(source)
        if cwd is not None:
            if Path(cwd).is_dir():
                os.chdir(cwd)
            else:
                log.warning("rank %d: the launcher's directory %s is not on this node", rank, cwd)
        os.environ.update(rank_env(rank, world, *local))
        failed = None  # the error's line, as the local runtime's (ranks.failure)
        try:
            try:
                context.run_script(path, argv)
            except BudgetSpent:  # the loop did not ask should_stop(): the launcher says so
                pass
            except SystemExit as e:
                if e.code not in (0, None):
                    raise RuntimeError(f"the script exited with status {e.code}") from None
            except Exception as e:
                failed = failure(e, str(path), rank, tempfile.mkdtemp(prefix="stalewise-run-"))
        finally:
            if ctx.client is not None:  # the script did not close it
                with contextlib.suppress(Exception):
                    ctx.close()
        return {"node": self.node(), "refused": ctx.refused, "failed": failed}


def serve_workers(job: Any, launch: Any) -> int:
    """Serves ``job`` on Ray, runs ``launch.workers`` ranks of ``launch.script``; exit status."""
    script, argv, workers = launch.script, launch.argv, launch.workers
    steps, timeout = launch.steps, launch.timeout
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # Ray folds lines that differ in numbers
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # no colour codes into files
    ray = import_ray()
    address = cluster_address(launch.address)
    env = {**{k: "1" for k in THREAD_VARS}, **shipped_env(launch.env, launch.env_all)}
    if address == "local":  # Ray's processes, started here, die with the launcher
        reap_with_me()
    started = connect(address)
    if not started:
        what = "the instance this process was already connected to"
    elif address == "local":
        what = "a new local instance; --address or RAY_ADDRESS to join a cluster"
    else:
        what = f"an existing cluster, --address/RAY_ADDRESS {address}"
    at = getattr(ray.get_runtime_context(), "gcs_address", address)  # older Ray: as asked
    print(f"stalewise run: Ray cluster at {at} ({what})", file=sys.stderr, flush=True)
    print(f"stalewise run: each rank gets {', '.join(sorted(env))} from this environment "
          "(--env NAME for more)", file=sys.stderr, flush=True)  # fmt: skip
    actors: list = []
    failed: list[str] = []
    lost = 0  # ranks that failed or were still running at the timeout
    refused = 0
    try:
        source = Path(script).read_text()
        name = launch.name or f"run-{uuid.uuid4().hex[:8]}"
        with job.serve(runtime="ray", workers=room(launch), name=name) as server:
            spread = {"num_cpus": 1, "max_restarts": 0, "scheduling_strategy": "SPREAD"}
            remote = ray.remote(ScriptWorker).options(runtime_env={"env_vars": env}, **spread)
            actors = [remote.remote(rank) for rank in range(workers)]
            where = ray.get([a.node.remote() for a in actors])
            script, cwd = str(Path(script).resolve()), os.getcwd()
            refs = {}
            for rank, (a, node) in enumerate(zip(actors, where, strict=True)):
                local = (where[:rank].count(node), where.count(node))  # LOCAL_RANK, ..._WORLD_SIZE
                args = (script, source, argv, name, rank, workers, steps, local, cwd)
                refs[a.run.remote(*args)] = rank
            log.info("stalewise run: %d workers started on Ray (job %r)", workers, name)
            nodes = set(where)
            pending = list(refs)
            deadline = None if timeout is None else time.monotonic() + timeout
            progress = Progress(workers, server)
            while pending:
                left = None if deadline is None else max(deadline - time.monotonic(), 0)
                if progress.every:
                    left = progress.every if left is None else min(left, progress.every)
                done, pending = ray.wait(pending, num_returns=1, timeout=left)
                if not done and deadline is not None and time.monotonic() >= deadline:
                    failed.append(f"timed out after {timeout} s")
                    lost += len(pending)
                    break
                for ref in done:
                    try:
                        got = ray.get(ref)
                        refused += got["refused"]
                        why = got["failed"]
                    except ray.exceptions.RayError as e:
                        cause = getattr(e, "cause", None) or e  # in one line:
                        text = str(cause).strip().splitlines()
                        one = f"{type(cause).__name__}: {text[-1] if text else ''}".rstrip(": ")
                        why = f"rank {refs[ref]} failed ({one})"
                    if why is not None:
                        failed.append(why)
                        lost += 1
                        ray.get(server.door.abort.remote())  # the others start without it
                progress.tick(time.monotonic(), len(pending))
            pushes = pushes_of(server)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        if started:
            ray.shutdown()
    for line in sorted(failed):
        print(f"stalewise run: {line}", file=sys.stderr)
    end_lines(workers, lost, pushes, steps, refused, where=f" on {len(nodes)} Ray node(s)")
    return 1 if failed else 0
