"""``stalewise run --runtime ray``: a script you own, once per worker, as Ray actors.

The launcher's process runs the script until :func:`stalewise.init`; there it
connects to Ray (:func:`stalewise.runtime.ray.connect`: ``--address``, else
``RAY_ADDRESS``, else a new local instance), says which cluster and which
environment variables each rank gets (:func:`shipped_env`) on lines of stderr,
serves the job on Ray and starts one :class:`ScriptWorker` actor per rank,
spread over the nodes, one CPU each. Each actor attaches to the job as worker
``rank``, enters the launcher's working directory if it exists on its node, sets
torchrun's variables (``RANK``, ``LOCAL_RANK`` counting the ranks on its node,
...) and runs the script as ``__main__``, so its :func:`stalewise.init` returns a
:class:`~stalewise.launch.Context` whose client is a
:class:`~stalewise.runtime.ray.client.RayClient`. The workers start together (a
rendezvous at the job's door); what they print reaches the launcher's stdout,
each line labelled ``(rank R pid=...)``. A script not at the same path on a node
runs from the launcher's copy of its text. ``docs/ray.md`` tells the whole of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from stalewise.launch import context
from stalewise.launch.context import Context
from stalewise.launch.progress import Progress, end_lines, pushes_of
from stalewise.launch.ranks import failure, rank_env, room
from stalewise.runtime.base import THREAD_VARS
from stalewise.runtime.errors import BudgetSpent
from stalewise.runtime.ray import cluster_address, connect, import_ray

log = logging.getLogger(__name__)

#: What a rank on Ray gets from the launcher's environment unless ``--env`` names more
#: (names, and prefixes ending "_"); the thread counts default to 1.
SHIPPED = ("STALEWISE_", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", *THREAD_VARS)
#: What ``--env-all`` leaves out unless named: the launcher's machine, devices and session.
NOT_SHIPPED = (
    "PWD", "OLDPWD", "HOME", "USER", "LOGNAME", "SHELL", "SHLVL", "HOSTNAME", "_", "TERM",
    "DISPLAY", "TMPDIR", "MAIL", "CUDA_VISIBLE_DEVICES", "NVIDIA_", "ROCR_", "HIP_", "SSH_",
    "XDG_", "RAY_", "PYTEST_",
)  # fmt: skip
#: ... and every name that may be a credential's.
SECRET = re.compile(
    r"SECRET|TOKEN|PASSW|CREDENTIAL|(^|_)KEY($|_)|AUTH|COOKIE|KRB5|KUBECONFIG|PRIVATE|NETRC"
    r"|SESSION|CERT"
)


def shipped_env(
    named: list[str] = (), every: bool = False, environ: dict[str, str] | None = None
) -> dict[str, str]:
    """The launcher's environment variables a rank on Ray gets (see the module docstring):
    :data:`SHIPPED`, the ``named`` ones, and with ``every`` (``--env-all``) the rest but
    :data:`NOT_SHIPPED` and :data:`SECRET`.

    Example:
        >>> env = {"OMP_NUM_THREADS": "4", "DATA": "/d", "GITHUB_TOKEN": "t", "PWD": "/x"}
        >>> shipped_env(environ=env), shipped_env(every=True, environ=env)
        ({'OMP_NUM_THREADS': '4'}, {'OMP_NUM_THREADS': '4', 'DATA': '/d'})
        >>> shipped_env(["GITHUB_TOKEN"], environ=env)
        {'OMP_NUM_THREADS': '4', 'GITHUB_TOKEN': 't'}
    """
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


class _Barrier:
    """The launcher's start barrier on Ray: the job's door counts the arrivals."""

    def __init__(self, door: Any, parties: int):
        self.door, self.parties = door, parties

    def wait(self, timeout: float) -> None:
        ray = import_ray()
        if not ray.get(self.door.rendezvous.remote(self.parties, timeout), timeout=timeout + 30):
            raise threading.BrokenBarrierError


def quiet_driver() -> None:
    """Before the launcher imports Ray: every line the workers print reaches its stdout.
    Ray's driver folds lines that differ only in numbers (``rank 0: loss 2.9`` and
    ``rank 1: loss 2.9``) into one by default; ``RAY_DEDUP_LOGS=0`` unless you set it.
    Its ``(rank 0 pid=...)`` prefixes carry no colour codes into a file or pipe
    (``RAY_COLOR_PREFIX=0`` unless set, when stdout or stderr is not a terminal)."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


class ScriptWorker:
    """One rank of a launched script (made remote by :func:`serve_workers`); Ray labels
    the lines it prints ``(rank R pid=...)``."""

    def __init__(self, rank: int):
        self.rank = rank

    def __repr__(self) -> str:  # Ray's label for the actor's output
        return f"rank {self.rank}"

    def node(self) -> str:
        """The id of the node this actor runs on (the launcher numbers ``LOCAL_RANK``)."""
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
        """Runs the script as ``__main__`` with rank ``rank``'s context; returns where it
        ran (``node``), the pushes refused past the budget (``refused``) and its error's
        line (``failed``, :func:`~stalewise.launch.ranks.failure`; None). ``local``: its
        ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; ``cwd``: the launcher's working directory,
        entered if it exists here."""
        import ray

        from stalewise.runtime.logs import child_logging
        from stalewise.runtime.ray.client import attach

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
        node = ray.get_runtime_context().get_node_id()
        return {"node": node, "refused": ctx.refused, "failed": failed}


def serve_workers(job: Any, launch: Any) -> int:
    """The launcher's side on Ray (the ``"ray"`` runtime's ``launch``): serves ``job``,
    runs ``launch.workers`` workers of ``launch.script``, waits; the exit status (1 if a
    worker failed, each named on a line of stderr)."""
    import uuid

    script, argv, workers = launch.script, launch.argv, launch.workers
    steps, timeout = launch.steps, launch.timeout
    quiet_driver()
    ray = import_ray()
    address = cluster_address(launch.address)
    started = connect(address)
    _say_cluster(ray, address, started)
    env = {**{k: "1" for k in THREAD_VARS}, **shipped_env(launch.env, launch.env_all)}
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
            remote = ray.remote(ScriptWorker)
            actors = [
                remote.options(
                    num_cpus=1,
                    max_restarts=0,
                    scheduling_strategy="SPREAD",
                    runtime_env={"env_vars": env},
                ).remote(rank)
                for rank in range(workers)
            ]
            where = ray.get([a.node.remote() for a in actors])
            local = [
                (where[:rank].count(node), where.count(node)) for rank, node in enumerate(where)
            ]
            script, cwd = str(Path(script).resolve()), os.getcwd()
            refs = {
                a.run.remote(
                    script, source, argv, name, rank, workers, steps, local[rank], cwd
                ): rank
                for rank, a in enumerate(actors)
            }
            log.info("stalewise run: %d workers started on Ray (job %r)", workers, name)
            nodes = set(where)
            pending = list(refs)
            deadline = None if timeout is None else _now() + timeout
            progress = Progress(workers, server)
            while pending:
                left = None if deadline is None else max(deadline - _now(), 0)
                if progress.every:
                    left = progress.every if left is None else min(left, progress.every)
                done, pending = ray.wait(pending, num_returns=1, timeout=left)
                if not done:
                    if deadline is not None and _now() >= deadline:
                        failed.append(f"timed out after {timeout} s")
                        lost += len(pending)
                        break
                    progress.tick(_now(), server.job_pushes, len(pending))
                    continue
                rank = refs[done[0]]
                try:
                    got = ray.get(done[0])
                    refused += got["refused"]
                    why = got["failed"]
                except ray.exceptions.RayError as e:
                    why = f"rank {rank} failed ({_cause(e)})"
                if why is not None:
                    failed.append(why)
                    lost += 1
                    ray.get(server.door.abort.remote())  # the others start without it
                progress.tick(_now(), server.job_pushes, len(pending))
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


def _say_cluster(ray: Any, address: str, started: bool) -> None:
    """One line of stderr: the Ray cluster the launcher connected to, and whether it is a
    new local instance (see the module docstring)."""
    try:
        at = ray.get_runtime_context().gcs_address
    except Exception:  # an older Ray: the address asked for
        at = address
    if not started:
        what = "the instance this process was already connected to"
    elif address == "local":
        what = "a new local instance; --address or RAY_ADDRESS to join a cluster"
    else:
        what = f"an existing cluster, --address/RAY_ADDRESS {address}"
    print(f"stalewise run: Ray cluster at {at} ({what})", file=sys.stderr, flush=True)


def _now() -> float:
    import time

    return time.monotonic()


def _cause(e: Exception) -> str:
    """One line for a worker's failure: the exception's type and first line."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}".rstrip(": ")
