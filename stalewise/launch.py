"""Run a training script you own once per worker: ``stalewise run`` and :func:`init`.

A script written for one process becomes an asynchronous job in the manner of
``torchrun``: it builds its model and a :class:`~stalewise.Job` as before, calls
``ctx = sw.init(job)`` once, and trains with ``ctx.client`` (pull the global
parameters, push gradients or pseudo-gradients) while ``not ctx.should_stop()``.

``stalewise run --workers N [--steps S] script.py args...`` runs the script in
the launcher's process until it calls :func:`init`; there :func:`init` starts
the job's shards (:meth:`stalewise.Job.serve`), starts ``N`` worker processes
that each run ``script.py args...`` again as ``__main__``, waits for them, and
ends the launcher's run of the script (``SystemExit``: 0, or 1 if a worker
failed). In each worker, :func:`init` returns its :class:`Context`: ``rank``,
``world_size``, its ``client``, and ``should_stop()``, true once the job's
workers have pushed ``S`` times in all (or the launcher stops the job). The
workers' math libraries are capped at ``cores // N`` threads each (unless you
set ``OMP_NUM_THREADS`` and friends yourself).

Run without the launcher (``python script.py``), :func:`init` serves the job
in this process with one worker and returns its context: the same script still
trains, as one worker, and ``ctx.close()`` (or the end of the process) stops
the shards. ``steps`` then comes from ``init(job, steps=...)``, if given.

``stalewise run --runtime ray`` runs each worker as a Ray actor across the
cluster instead (one CPU each; see :mod:`stalewise.runtime.ray.launch`): the
same script, the same :class:`Context`, with a client of the job's shard actors.

Rank and world size come from the launcher, and so does each worker's client:
a worker id of the job for each rank. A worker that dies is reported by the
launcher, which exits with status 1; the others carry on to the budget.

Example (``train.py``; ``stalewise run --workers 4 --steps 2000 train.py``):

.. code-block:: python

    import stalewise as sw

    if __name__ == "__main__":
        model = make_model()
        job = sw.Job(model, optimizer=sw.optim.adam(1e-3))
        ctx = sw.init(job)                        # rank, world size, client
        for batch in batches(ctx.rank, ctx.world_size):
            if ctx.should_stop():
                break
            ctx.client.pull(into=model)
            loss = loss_fn(model, batch)
            loss.backward()
            ctx.client.push({n: p.grad for n, p in model.named_parameters()})
        ctx.close()
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import runpy
import sys
import threading
import time
from multiprocessing import connection
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["Context", "LaunchError", "init", "launch"]

#: The most worker processes ``stalewise run`` starts on one machine.
MAX_WORKERS = 256


class LaunchError(RuntimeError):
    """A launched script could not be run as asked (a user error: one line)."""


@dataclasses.dataclass
class Context:
    """What :func:`init` gives one worker: who it is, its client, and when to stop."""

    rank: int  #: this worker's id, 0 .. world_size - 1
    world_size: int  #: the number of workers
    client: Any  #: this worker's :class:`~stalewise.runtime.local.client.Client`
    steps: int | None = None  #: the job's budget of pushes in all (None: no budget)
    launched: bool = True  #: started by ``stalewise run`` (else: one worker, served here)
    _server: Any = dataclasses.field(default=None, repr=False)
    _barrier: Any = dataclasses.field(default=None, repr=False)  # the launcher's start barrier

    def should_stop(self) -> bool:
        """True once the job's workers have pushed ``steps`` times in all, or the job stops."""
        if self.client.stopping:
            return True
        return self.steps is not None and not self.client.may_begin(self.steps)

    def close(self) -> None:
        """Waits for this worker's last push and leaves the job (and, unlaunched, stops
        the shards served in this process). Calling it again does nothing."""
        if self.client is None:
            return
        client, self.client = self.client, None
        try:
            client.wait()
        finally:
            client.close()
            if self._server is not None:
                self._server.close()
                self._server = None


@dataclasses.dataclass
class _Launch:
    """In the launcher's process: how to run the script's workers."""

    script: str
    argv: list[str]
    workers: int
    steps: int | None
    timeout: float | None = None
    runtime: str = "local"


_LAUNCH: _Launch | None = None  # set in the launcher's process while it runs the script
_WORKER: Context | None = None  # set in a worker process before it runs the script
_INITIALISED = False  # init() has been called in this process


def init(job: Any, *, steps: int | None = None) -> Context:
    """This process's part of a launched job; see the module docstring.

    Args:
        job: the :class:`~stalewise.Job` the script trains (its parameters and
            server optimizer): in the launcher it is served; in a worker it must
            have the launcher's layout.
        steps: the job's budget of pushes in all (the launcher's ``--steps``, if
            given, wins).

    Returns:
        The worker's :class:`Context` (in the launcher's own process it does not
        return: the launcher ends there, once the workers are done).
    """
    global _INITIALISED
    from stalewise.api import Job

    if not isinstance(job, Job):
        raise TypeError(f"sw.init(job): job must be a sw.Job, got {type(job).__name__}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"sw.init: steps must be an integer >= 1 or None, got {steps!r}")
    if _INITIALISED:
        raise RuntimeError("sw.init() was called twice in this process: call it once")
    _INITIALISED = True
    if _WORKER is not None:
        ctx = _WORKER
        mine, theirs = job.config.spec.segments, ctx.client.spec.segments
        if mine.names != theirs.names or mine.sizes.tolist() != theirs.sizes.tolist():
            raise LaunchError(
                f"rank {ctx.rank}: sw.init(job) got a job whose parameters differ from the "
                "launcher's (build the same model, with the same leaves and shapes, in every "
                "process)"
            )
        if ctx.steps is None:  # no --steps: the script's own budget
            ctx.steps = steps
        _rendezvous(ctx)
        return ctx
    if _LAUNCH is not None:
        if _LAUNCH.runtime == "ray":
            from stalewise.runtime.ray.launch import serve_workers

            launch = _LAUNCH
            raise SystemExit(
                serve_workers(
                    job, launch.script, launch.argv, launch.workers, launch.steps, launch.timeout
                )
            )
        raise SystemExit(_serve_workers(job, _LAUNCH))
    server = job.serve(workers=1)
    client = server.client(0)
    ctx = Context(0, 1, client, steps=steps, launched=False, _server=server)
    atexit.register(ctx.close)
    return ctx


#: Seconds a launched worker waits at :func:`init` for the others to get there.
RENDEZVOUS_TIMEOUT = 300.0


def _rendezvous(ctx: Context) -> None:
    """Waits until every launched worker has reached :func:`init`, so that they start
    together (a worker that is first by the time its imports take would otherwise spend
    the budget alone). A worker that never gets there holds the others up for
    :data:`RENDEZVOUS_TIMEOUT` seconds at most; then they start without it."""
    if ctx._barrier is None:
        return
    try:
        ctx._barrier.wait(RENDEZVOUS_TIMEOUT)
    except threading.BrokenBarrierError:
        log.warning(
            "rank %d: not every worker reached sw.init within %g s; starting without them",
            ctx.rank,
            RENDEZVOUS_TIMEOUT,
        )


def _serve_workers(job: Any, launch: _Launch) -> int:
    """The launcher's side: serves ``job``, runs the workers, waits; the exit status."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(launch.workers)
    with job.serve(workers=launch.workers) as server:
        procs = []
        for rank in range(launch.workers):
            args = (
                launch.script,
                launch.argv,
                server.client(rank),
                rank,
                launch.workers,
                launch.steps,
                barrier,
            )
            p = ctx.Process(target=_worker_main, args=args, name=f"stalewise-run-{rank}")
            p.start()
            server.release(rank)  # the shards notice if this worker dies
            procs.append(p)
        log.info("stalewise run: %d workers started", launch.workers)
        failed = _wait_for(procs, barrier, launch.timeout)
        pushes = server.observer.job_pushes
    for line in failed:
        print(f"stalewise run: {line}", file=sys.stderr)
    print(f"stalewise run: {launch.workers} workers done, {pushes} pushes", file=sys.stderr)
    return 1 if failed else 0


def _wait_for(procs: list, barrier: Any, timeout: float | None) -> list[str]:
    """Waits for the worker processes to end (all killed after ``timeout`` seconds);
    returns what went wrong, a line each. A worker that fails lets the others past the
    start barrier at once, instead of after :data:`RENDEZVOUS_TIMEOUT`."""
    from stalewise.runtime.local.procs import describe_exit

    deadline = None if timeout is None else time.monotonic() + timeout
    failed, running = [], dict(enumerate(procs))
    while running:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            for p in running.values():
                p.kill()
                p.join()
            return [*failed, f"timed out after {timeout} s"]
        ended = connection.wait([p.sentinel for p in running.values()], left)
        for rank, p in list(running.items()):
            if p.sentinel in ended:
                p.join()
                del running[rank]
                if p.exitcode != 0:
                    failed.append(f"rank {rank} failed ({describe_exit(p.exitcode)})")
                    barrier.abort()
    return sorted(failed)


def whole_lines() -> None:
    """Makes each line a worker prints one write to the stdout and stderr it shares with
    the others. Unbuffered (``PYTHONUNBUFFERED``, ``-u``), ``print`` writes its text and
    its newline separately, and two workers' lines tear (``rank 2: 2.9rank 1: 2.9``);
    line buffering keeps them whole and still shows each line as it ends."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "write_through", False) and hasattr(stream, "reconfigure"):
            stream.reconfigure(write_through=False, line_buffering=True)


def _worker_main(
    script: str,
    argv: list[str],
    client: Any,
    rank: int,
    world: int,
    steps: int | None,
    barrier: Any,
) -> None:
    """A worker process: runs the script as ``__main__`` with its context set."""
    global _WORKER
    from stalewise.runtime.logs import child_logging

    child_logging(f"rank {rank}")
    whole_lines()
    _WORKER = Context(rank, world, client, steps=steps, _barrier=barrier)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    os.environ["STALEWISE_RANK"], os.environ["STALEWISE_WORLD_SIZE"] = str(rank), str(world)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if _WORKER.client is not None:  # the script did not close it
            _WORKER.close()


def launch(
    script: str,
    argv: list[str],
    *,
    workers: int,
    steps: int | None = None,
    timeout: float | None = None,
    runtime: str = "local",
) -> int:
    """Runs ``script`` with ``argv`` as ``stalewise run`` does; returns the exit status.

    ``runtime``: ``"local"`` (worker processes on this machine) or ``"ray"`` (Ray actors
    across the cluster this process connects to; see :mod:`stalewise.runtime.ray.launch`).

    Raises:
        LaunchError: a bad argument, or a script that ends without calling :func:`init`.
    """
    global _LAUNCH
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise LaunchError(f"--workers must be an integer in 1..{MAX_WORKERS}, got {workers!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise LaunchError(f"--steps must be an integer >= 1, got {steps!r}")
    if runtime not in ("local", "ray"):
        raise LaunchError(f"--runtime must be 'local' or 'ray', got {runtime!r}")
    path = Path(script)
    if not path.is_file():
        raise LaunchError(f"{script}: no such script")
    if runtime == "ray":
        try:
            from stalewise.runtime.ray import import_ray
            from stalewise.runtime.ray.launch import quiet_driver

            quiet_driver()
            import_ray()
        except ImportError as e:
            raise LaunchError(str(e)) from None
    _LAUNCH = _Launch(str(path), list(argv), workers, steps, timeout, runtime)
    saved = sys.argv, list(sys.path)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        if _INITIALISED:  # init() served the workers and ended the script: their status
            return int(e.code or 0)
        raise
    finally:
        _LAUNCH = None
        sys.argv, sys.path[:] = saved
    raise LaunchError(
        f"{script} ended without calling sw.init(job): a launched script calls it once, "
        "after building its Job, and trains with the context it returns"
    )
