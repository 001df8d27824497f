"""``stalewise run --runtime ray``: a script you own, once per worker, as Ray actors.

The launcher's process runs the script until :func:`stalewise.init`; there it
connects to Ray (:func:`stalewise.runtime.ray.connect`: ``RAY_ADDRESS``, else a
cluster started on this machine, else a new local instance), serves the job on
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
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from stalewise.runtime.base import THREAD_VARS
from stalewise.runtime.ray import connect, import_ray

log = logging.getLogger(__name__)


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
    ``rank 1: loss 2.9``) into one by default; ``RAY_DEDUP_LOGS=0`` unless you set it."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")


class ScriptWorker:
    """One rank of a launched script (made remote by :func:`serve_workers`); Ray labels
    the lines it prints ``(rank R pid=...)``."""

    def __init__(self, rank: int):
        self.rank = rank

    def __repr__(self) -> str:  # Ray's label for the actor's output
        return f"rank {self.rank}"

    def run(
        self,
        script: str,
        source: str,
        argv: list[str],
        name: str,
        rank: int,
        world: int,
        steps: int | None,
    ) -> dict:
        """Runs the script as ``__main__`` with rank ``rank``'s context; returns where it
        ran (``node``) and how many pushes it made."""
        import ray

        from stalewise import launch
        from stalewise.runtime.logs import child_logging
        from stalewise.runtime.ray.client import attach

        child_logging(f"rank {rank}")
        client = attach(name, worker=rank)
        ctx = launch.Context(
            rank, world, client, steps=steps, _barrier=_Barrier(client._door, world)
        )
        launch._WORKER, launch._INITIALISED = ctx, False
        path = Path(script)
        if not path.is_file():  # not on this node: the launcher's copy of its text
            path = Path(tempfile.mkdtemp(prefix="stalewise-run-")) / path.name
            path.write_text(source)
        sys.argv = [str(path), *argv]
        sys.path.insert(0, str(path.resolve().parent))
        os.environ["STALEWISE_RANK"], os.environ["STALEWISE_WORLD_SIZE"] = str(rank), str(world)
        pushes = 0
        try:
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as e:
                if e.code not in (0, None):
                    raise RuntimeError(f"the script exited with status {e.code}") from None
            pushes = client._out.sender.seq
        finally:
            if ctx.client is not None:  # the script did not close it
                ctx.close()
        return {"node": ray.get_runtime_context().get_node_id(), "pushes": pushes}


def serve_workers(job: Any, launch: Any) -> int:
    """The launcher's side on Ray (the ``"ray"`` runtime's ``launch``): serves ``job``,
    runs ``launch.workers`` workers of ``launch.script``, waits; the exit status (1 if a
    worker failed, each named on a line of stderr)."""
    import uuid

    script, argv, workers = launch.script, launch.argv, launch.workers
    steps, timeout = launch.steps, launch.timeout
    quiet_driver()
    ray = import_ray()
    started = connect()
    actors: list = []
    failed: list[str] = []
    try:
        caps = {k: os.environ.get(k, "1") for k in THREAD_VARS}
        source = Path(script).read_text()
        name = f"run-{uuid.uuid4().hex[:8]}"
        with job.serve(runtime="ray", workers=workers, name=name) as server:
            remote = ray.remote(ScriptWorker)
            actors = [
                remote.options(
                    num_cpus=1,
                    max_restarts=0,
                    scheduling_strategy="SPREAD",
                    runtime_env={"env_vars": caps},
                ).remote(rank)
                for rank in range(workers)
            ]
            script = str(Path(script).resolve())
            refs = {
                a.run.remote(script, source, argv, name, rank, workers, steps): rank
                for rank, a in enumerate(actors)
            }
            log.info("stalewise run: %d workers started on Ray (job %r)", workers, name)
            nodes: set[str] = set()
            pending = list(refs)
            deadline = None if timeout is None else _now() + timeout
            while pending:
                left = None if deadline is None else max(deadline - _now(), 0)
                done, pending = ray.wait(pending, num_returns=1, timeout=left)
                if not done:
                    failed.append(f"timed out after {timeout} s")
                    break
                rank = refs[done[0]]
                try:
                    nodes.add(ray.get(done[0])["node"])
                except ray.exceptions.RayError as e:
                    failed.append(f"rank {rank} failed ({_cause(e)})")
                    ray.get(server.door.abort.remote())  # the others start without it
            pushes = server.job_pushes
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        if started:
            ray.shutdown()
    for line in sorted(failed):
        print(f"stalewise run: {line}", file=sys.stderr)
    print(
        f"stalewise run: {workers} workers done on {len(nodes)} Ray node(s), {pushes} pushes",
        file=sys.stderr,
    )
    return 1 if failed else 0


def _now() -> float:
    import time

    return time.monotonic()


def _cause(e: Exception) -> str:
    """One line for a worker's failure: the exception's type and first line."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}".rstrip(": ")
