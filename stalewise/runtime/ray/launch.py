"""``stalewise run --runtime ray``: a script you own, once per worker, as Ray actors.

The launcher's process runs the script until :func:`stalewise.init`; there it
connects to Ray (:func:`ray_address`: ``--address``, else ``RAY_ADDRESS``, else a
new local instance) and says which cluster on a line of stderr, serves the job on
Ray (:class:`~stalewise.runtime.ray.server.RayServer`, under a new name) and
starts one :class:`ScriptWorker` actor per rank, spread over the nodes
(``num_cpus=1`` each; ``OMP_NUM_THREADS`` and friends 1 unless the launcher's
environment sets them). Each actor attaches to the job as worker ``rank``
(:func:`stalewise.runtime.ray.client.attach`), runs the script as
``__main__`` with that context set, so its :func:`stalewise.init` returns a
:class:`~stalewise.launch.Context` whose client is a
:class:`~stalewise.runtime.ray.client.RayClient`, and closes the client when the
script ends. The workers start together (a rendezvous at the job's door). What
they print reaches the launcher's stdout through Ray, each line labelled
``(rank R pid=...)``, none folded into another (``RAY_DEDUP_LOGS=0`` unless set).

The script must be at the same path on every node, or self-contained: an actor
that does not find it there runs the launcher's copy of its text (modules beside
it must then be importable on the nodes, e.g. through Ray's ``runtime_env``).

Each rank gets the launcher's environment and working directory, as a local rank
does, without shipping files: its actor's ``runtime_env`` holds the launcher's
environment variables (``env_vars``) except those that describe the launcher's
own machine, terminal or Ray session (:data:`NOT_SHIPPED`: ``PWD``, ``HOME``,
``SSH_*``, ``RAY_*``, ...), and the actor changes to the launcher's working
directory (``os.chdir``) when that path exists on its node (else it stays in
Ray's and logs a warning). Ray's ``working_dir`` would upload the directory to
every node at each run; a cluster with a shared file system needs no copy, and
one without should set it through ``RAY_RUNTIME_ENV``-style configuration of its
own. Before the script runs, the rank's environment also holds ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``STALEWISE_RANK`` /
``STALEWISE_WORLD_SIZE`` (:mod:`stalewise.launch`), ``LOCAL_RANK`` counting the
ranks on the actor's node in rank order.

Which cluster (:func:`ray_address`): ``stalewise run --address ADDR`` (``auto``:
the cluster this machine is part of, started with ``ray start``; ``HOST:PORT``
of a head node), else ``RAY_ADDRESS``, else a new local instance, shut down at
the end. Never Ray's own default (``ray.init()`` with no address), which joins
the cluster last started on this machine, found through the file
``/tmp/ray/ray_current_cluster`` that every user of the machine shares, so a run
would join another user's cluster, and read its environment, without a word.
The launcher prints ``stalewise run: Ray cluster at ADDR (a new local
instance; ...)``, ``(an existing cluster, ...)`` with the address asked for, or
``(the instance this process was already connected to)`` when the script called
``ray.init`` itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from stalewise.runtime.base import THREAD_VARS
from stalewise.runtime.ray import connect, import_ray

log = logging.getLogger(__name__)

#: Environment variables a rank on Ray does not take from the launcher: they describe the
#: launcher's machine, terminal, session or Ray instance (names, and prefixes ending "_").
NOT_SHIPPED = (
    "PWD", "OLDPWD", "HOME", "USER", "LOGNAME", "SHELL", "SHLVL", "HOSTNAME", "_",
    "TERM", "COLORTERM", "DISPLAY", "LS_COLORS", "PS1", "TMUX", "STY", "WINDOW",
    "TMPDIR", "MAIL", "CUDA_VISIBLE_DEVICES", "SSH_", "XDG_", "RAY_", "TERM_",
    "PYTEST_", "STALEWISE_PROGRESS", "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "STALEWISE_RANK", "STALEWISE_WORLD_SIZE",
)  # fmt: skip


def shipped_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment variables a rank on Ray gets (see :data:`NOT_SHIPPED`).

    Example:
        >>> shipped_env({"DATA": "/d", "PWD": "/x", "RAY_ADDRESS": "a:1", "SSH_TTY": "t"})
        {'DATA': '/d'}
    """
    environ = dict(os.environ if environ is None else environ)
    names = {n for n in NOT_SHIPPED if not n.endswith("_") or n == "_"}
    prefixes = tuple(n for n in NOT_SHIPPED if n.endswith("_") and n != "_")
    return {k: v for k, v in environ.items() if k not in names and not k.startswith(prefixes)}


def ray_address(address: str | None, environ: dict[str, str] | None = None) -> str:
    """The Ray cluster ``stalewise run --runtime ray`` connects to: ``address`` (its
    ``--address``), else ``RAY_ADDRESS``, else ``"local"``: a new local instance, never
    the cluster Ray's own default would pick up on this machine (see the module docstring).

    Example:
        >>> ray_address(None, {}), ray_address(None, {"RAY_ADDRESS": "h:6379"})
        ('local', 'h:6379')
        >>> ray_address("auto", {"RAY_ADDRESS": "h:6379"})
        'auto'
    """
    environ = os.environ if environ is None else environ
    return address or environ.get("RAY_ADDRESS") or "local"


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
        line (``failed``, :func:`~stalewise.launch.ranks.failure`; None). ``local``: its ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``;
        ``cwd``: the launcher's working directory, entered if it exists here."""
        import ray

        from stalewise.launch import BudgetSpent, Context, context, rank_env
        from stalewise.launch.ranks import failure
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

    from stalewise.launch.progress import Progress, end_lines, pushes_of
    from stalewise.launch.ranks import room

    script, argv, workers = launch.script, launch.argv, launch.workers
    steps, timeout = launch.steps, launch.timeout
    quiet_driver()
    ray = import_ray()
    address = ray_address(getattr(launch, "address", None))
    started = connect(address)
    _say_cluster(ray, address, started)
    actors: list = []
    failed: list[str] = []
    lost = 0  # ranks that failed or were still running at the timeout
    refused = 0
    try:
        env = {**shipped_env(), **{k: os.environ.get(k, "1") for k in THREAD_VARS}}
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
