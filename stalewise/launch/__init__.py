"""Run a training script you own once per worker: ``stalewise run`` and :func:`init`.

A script written for one process becomes an asynchronous job in the manner of
``torchrun``: it builds its model and a :class:`~stalewise.Job` as before, calls
``ctx = sw.init(job)`` once, and trains with ``ctx.client`` (pull the global
parameters, push gradients or pseudo-gradients) while ``not ctx.should_stop()``.

``stalewise run --workers N [--steps S] script.py args...`` runs the script in
the launcher's process until it calls :func:`init`; there :func:`init` starts
the job's shards (:meth:`stalewise.Job.serve`), starts ``N`` worker processes
that each run ``script.py args...`` again as ``__main__``, once (a worker starts
from stalewise's entry point, without importing the launcher's ``__main__``, and
the shards import none of the script: see
:func:`~stalewise.runtime.local.procs.stalewise_main`), waits for them, and
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
a worker id of the job for each rank. Each rank's environment holds them before
the script runs (on both runtimes), so a script can pick per-rank outputs before
:func:`init`, as under ``torchrun``:

* ``RANK`` and ``STALEWISE_RANK``: the rank, ``0 .. world_size - 1``;
* ``WORLD_SIZE`` and ``STALEWISE_WORLD_SIZE``: the number of ranks (``--workers``);
* ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``: the rank among those on this machine, and
  how many there are. On the local runtime every rank is on this machine
  (``LOCAL_RANK = RANK``); on Ray, the ranks that Ray placed on the same node are
  numbered in rank order (the launcher asks each actor for its node first).

*The budget* (``--steps`` or ``init(job, steps=...)``) holds for a loop that never
asks ``ctx.should_stop()``: the context gives it to its client (``client.budget``),
which refuses a push past it at the commit, before anything is sent
(:func:`stalewise.protocol.budget.refuses`), unless a ``should_stop()`` that answered
False since the last push granted it: ``ctx.client.push`` raises :class:`BudgetSpent`
(a :class:`~stalewise.ServerClosed`, so ``except sw.ServerClosed`` ends such a loop
too). A client of ``job.serve`` or ``sw.attach`` does the same once given one
(``client.budget = steps``; ``client.may_begin(steps)`` grants). A rank that lets it
through ends with status 0, as if its loop had ended, and the launcher says once
``stalewise run: the budget of 50 pushes is spent; 3 pushes past it were refused``.
A loop that asks ``should_stop()`` is never refused, except under BSP when the round
moved on between its question and its push (a late joiner's first pull). Either way
the job commits at most ``workers - 1`` pushes beyond the budget
(:func:`~stalewise.protocol.budget.overshoot_bound`: the ranks' checks are not
atomic with the other ranks' commits); under BSP, whole rounds of the shards' count,
so late joiners and restarts stay inside it too.

*Progress* (:mod:`stalewise.launch.progress`): while the ranks run, the launcher
prints a line to stderr every :data:`~stalewise.launch.progress.PROGRESS_TTY` seconds
when stderr is a terminal, else every :data:`~stalewise.launch.progress.PROGRESS_EVERY`
seconds (logs stay short): ``stalewise run: 1200 pushes (1188 applied, 12 refused),
310.5 pushes/s, loss 2.31, 4 of 4 ranks live`` (the loss: the mean of the ranks'
``ctx.log(loss=...)``, local runtime). ``STALEWISE_PROGRESS=SECONDS`` sets the
interval (0: no progress lines). The last line says how the ranks ended:
``stalewise run: 4 workers done, 1201 pushes``, or ``stalewise run: 3 of 4 workers
done, 1 failed, 1201 pushes (40 not_finite refused)``. A rank's error is one line
(``rank 1 failed: ValueError: ... (train.py, line 12); traceback in FILE``), and the
launcher exits with status 1; the others carry on to the budget.

*Refusals* are judged as in ``Job.train`` (:class:`stalewise.protocol.loop.Watch`):
the first is a warning with its reason, and 20 in a row as NaN/Inf end the rank
(:class:`~stalewise.protocol.loop.Diverged`). A push before the first pull, and an
``exclude_from_*`` pattern that matches no leaf, warn once. The launcher's run of the
script up to :func:`init` sees rank 0's ``RANK``... (not ``STALEWISE_RANK``) and is stopped at
:data:`INIT_TIMEOUT`. ``--name NAME``: ``sw.attach(NAME)`` joins, ``--workers`` more ids.

*Checkpoints* (local runtime, :mod:`stalewise.launch.checkpoints`): ``stalewise run
--checkpoint-dir DIR [--checkpoint-every N] [--resume]``, or ``sw.init(job,
checkpoint_dir=DIR, checkpoint_every=N, resume=True)`` (the flags win), or
``job.serve(workers=..., checkpoint_dir=DIR, checkpoint_every=N, resume=True)`` for
processes you start and attach yourself (then a thread of the serving process saves,
and closing the server saves the last one; there are no ranks' states). The
launcher, which holds the shards, saves the job in ``Job.train``'s data-only format
(:mod:`stalewise.checkpoint`, through its :class:`~stalewise.checkpoint.Saver`):
every ``N`` pushes of the job (counted by the server) and at the end, also after
Ctrl-C or SIGTERM. A checkpoint holds the shards' state (parameters, optimizer
state, versions), the job's push counts, and each rank's ``ctx.state``: a dict the
script fills (its data position, an inner optimizer's state, an RNG's
``bit_generator.state``) with JSON values and numpy arrays, nested dicts of them;
nothing is pickled (:func:`stalewise.checkpoint.store.flat_state`). A rank hands its
``ctx.state`` over in ``ctx.should_stop()`` once the job's pushes pass a multiple of
``N`` (the launcher waits :data:`~stalewise.launch.checkpoints.RANK_STATE_WAIT` seconds
for it, else keeps the rank's previous one) and at ``ctx.close()``, through files in ``DIR/.ranks``.
``--resume`` restores the newest usable checkpoint before any rank starts (one of a
job whose ``--steps`` are spent says so, and no rank starts): the
versions and the job's pushes (so ``--steps`` stays the total budget) go on from it,
and each rank's ``ctx.state`` is filled before ``sw.init`` returns. With no
checkpoint in ``DIR`` yet it says so on one line and starts from the start (so the
same command serves the first launch and every restart); a checkpoint of another job
(other parameters, optimizer, shards or ``--workers``) is refused on one line, exit
status 2. Unlaunched (``python script.py``), ``sw.init`` saves from ``should_stop()``
and ``close()`` in the script's own process.

How a launch ends, on the local runtime:

* **The launcher killed** (even ``kill -9``): each rank, like each shard
  process, dies with it, and so does everything started from them through
  stalewise (:func:`~stalewise.runtime.local.procs.die_with_parent`, the first
  thing a rank does: on Linux a parent-death signal, checked against the race
  by the parent's pid, and everywhere a thread watching the pipe from the
  launcher). The shared block has no name in ``/dev/shm``
  (:mod:`stalewise.runtime.local.shm`), the start rendezvous is a pipe per rank
  (no named semaphore), and ``multiprocessing``'s resource tracker ends with
  the last process that holds its pipe, so nothing of the job stays.
* **Ctrl-C or SIGTERM to the launcher**: an orderly stop. The job's stop flag
  is set (``ctx.should_stop()`` turns true), the ranks get
  :data:`~stalewise.launch.ranks.STOP_GRACE` seconds to end, those still running are
  killed (a line each), then the shards close. ``stalewise run`` exits 130 (Ctrl-C) or 143 (SIGTERM,
  :class:`Terminated`). A rank interrupted itself (Ctrl-C in a terminal reaches
  every process of its group) says so on one line, with no traceback.
* **--timeout SECONDS**: counted from the start of the ranks, it bounds the
  whole run. At the deadline the launcher names each rank still running and how
  far it got (``rank 1 (3 pushes, the last 18.2 s ago)``), stops the job as
  above, and exits 1. This is what catches a rank that hangs before its first
  push, or every rank at once (a BSP round waiting on a hung rank).
* **The liveness rule** (``--rank-timeout SECONDS``, default
  :data:`~stalewise.launch.ranks.RANK_TIMEOUT`; 0 turns it off): the launcher reads
  each rank's push counter (in the shared block) every quarter of a second. A rank
  that has pushed at least once, then pushes nothing for that long while the other
  ranks push, is taken for hung (the rule and why it is a fixed bound:
  :func:`stalewise.protocol.liveness.silent_rank`): named (``rank 1 hung: no push for
  300.2 s while the other ranks pushed 81234 times``), killed, and the others carry on
  to the budget; the launcher exits 1. Pulls are not counted (they read the shared
  block without a trace), hence "pushes nothing".

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
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from stalewise import runtime as runtime_lib
from stalewise.launch import checkpoints, context
from stalewise.launch import checkpoints as saving  # init's checkpoints= is the option group
from stalewise.launch.context import RENDEZVOUS_TIMEOUT, Context, LaunchError  # noqa: F401
from stalewise.launch.ranks import RANK_TIMEOUT, STOP_GRACE, rank_env  # noqa: F401
from stalewise.launch.ranks import serve_workers as _serve_workers  # noqa: F401 (the registry's)
from stalewise.options import checkpoint_fields
from stalewise.runtime.errors import BudgetSpent

log = logging.getLogger(__name__)

__all__ = ["BudgetSpent", "Context", "LaunchError", "Terminated", "init", "launch"]

#: The most worker processes ``stalewise run`` starts on one machine.
MAX_WORKERS = 256
#: Seconds the launcher runs the script before it says that ``sw.init`` is not called yet,
#: and before it stops the script (which would otherwise train alone in the launcher).
INIT_NOTE, INIT_TIMEOUT = 10.0, 120.0


class _NoInit(Exception):
    """The launcher's run of the script reached :data:`INIT_TIMEOUT` before ``sw.init``."""


@dataclasses.dataclass
class _Launch:
    """In the launcher's process: how to run the script's workers (see :func:`launch`)."""

    script: str
    argv: list[str]
    workers: int
    steps: int | None
    timeout: float | None
    runtime: str
    rank_timeout: float  # the liveness rule's silence (0: off)
    address: str | None  # --address, runtime ray (None: RAY_ADDRESS, else a new local one)
    checkpoint_dir: str | None  # where the launcher saves the job (None: nowhere)
    checkpoint_every: int | None  # every this many pushes of the job (and at the end)
    resume: bool  # start from checkpoint_dir's last checkpoint, if there is one
    timed: bool = False  # SIGALRM bounds the run up to sw.init (INIT_TIMEOUT)
    name: str | None = None  # --name: the job is served under it, for sw.attach


_LAUNCH: _Launch | None = None  # set in the launcher's process while it runs the script


def init(
    job: Any,
    *,
    steps: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    checkpoints: Any = None,
) -> Context:
    """This process's part of a launched job; see the module docstring.

    Args:
        job: the :class:`~stalewise.Job` the script trains (its parameters and
            server optimizer): in the launcher it is served; in a worker it must
            have the launcher's layout.
        steps: the job's budget of pushes in all (the launcher's ``--steps``, if
            given, wins).
        checkpoint_dir, checkpoint_every, resume: checkpoints of the job and of each
            rank's ``ctx.state`` (see "Checkpoints" in the module docstring); the
            launcher's ``--checkpoint-dir``, ``--checkpoint-every`` and ``--resume``, if
            given, win. Ignored in a launched worker (the launcher's hold).
        checkpoints: or ``sw.Checkpoints(dir, every=, resume=)``, as ``Job.train`` takes them.

    Returns:
        The worker's :class:`Context` (in the launcher's own process it does not
        return: the launcher ends there, once the workers are done).
    """
    from stalewise.api import Job

    if not isinstance(job, Job):
        raise TypeError(f"sw.init(job): job must be a sw.Job, got {type(job).__name__}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"sw.init: steps must be an integer >= 1 or None, got {steps!r}")
    checkpoint_dir, checkpoint_every, resume = checkpoint_fields(
        "sw.init", checkpoints, checkpoint_dir, checkpoint_every, resume
    )
    if context.INITIALISED:
        raise RuntimeError("sw.init() was called twice in this process: call it once")
    context.INITIALISED = True
    if context.WORKER is not None:
        ctx = context.WORKER
        mine, theirs = job.config.spec.segments, ctx.client.spec.segments
        if mine.names != theirs.names or mine.sizes.tolist() != theirs.sizes.tolist():
            raise LaunchError(
                f"rank {ctx.rank}: sw.init(job) got a job whose parameters differ from the "
                "launcher's (build the same model, with the same leaves and shapes, in every "
                "process)"
            )
        if ctx.steps is None:  # no --steps: the script's own budget
            ctx.budget(steps)
        saving.RankStates.join(ctx)  # --checkpoint-dir: ctx.state restored, and saved
        context.rendezvous(ctx)
        return ctx
    saving.check(checkpoint_dir, checkpoint_every, ValueError)
    if _LAUNCH is None:
        from stalewise.runtime.logs import child_logging

        child_logging("worker 0")  # unlaunched: its warnings reach stderr
    _unmatched(job)
    if _LAUNCH is not None:  # the runtime's launch: ranks.serve_workers here, Ray's on Ray
        if _LAUNCH.checkpoint_dir is None and checkpoint_dir is not None:
            if _LAUNCH.runtime != "local":
                raise LaunchError("checkpoints of a launched job are for --runtime local")
            _LAUNCH.checkpoint_dir = os.fspath(checkpoint_dir)
            _LAUNCH.resume = _LAUNCH.resume or bool(resume)
        if _LAUNCH.checkpoint_every is None:
            _LAUNCH.checkpoint_every = checkpoint_every
        if _LAUNCH.steps is None:  # the ranks' own init(steps=) will say the same
            _LAUNCH.steps = steps
        if _LAUNCH.timed:
            signal.setitimer(signal.ITIMER_REAL, 0)  # the script reached sw.init in time
        raise SystemExit(runtime_lib.describe(_LAUNCH.runtime).load("launch")(job, _LAUNCH))
    server = job.serve(workers=1)
    saves = None
    if checkpoint_dir is not None:
        try:
            saves = saving.Saves(job, server, os.fspath(checkpoint_dir), checkpoint_every, resume)
        except BaseException:
            server.close()
            raise
    ctx = Context(0, 1, server.client(0), steps=steps, launched=False, _server=server)
    if saves is not None:
        ctx.state, ctx._ckpt = saves.ranks[0], saving.InProcess(saves)
    atexit.register(ctx.close)
    return ctx


def _unmatched(job: Any) -> None:
    """Warns of an optimizer's exclusion pattern that matches no leaf of the job."""
    from stalewise.optim._leaves import unmatched

    segments = job.config.spec.segments
    for field, pattern in unmatched(job.config.optimizer, segments):
        log.warning(
            "%s pattern %r matches no parameter of the job, so it excludes nothing; "
            "patterns are re.search'ed on names such as %s",
            field,
            pattern,
            ", ".join(map(repr, segments.names[:3])),
        )


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the launcher, which stops the job as Ctrl-C does (``stalewise run``
    then exits with status 143)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated("SIGTERM")


def _init_alarm(script: str) -> Any:
    """The launcher's SIGALRM while it runs the script up to ``sw.init``: a line at
    :data:`INIT_NOTE` seconds, :class:`_NoInit` at :data:`INIT_TIMEOUT`."""
    noted = []

    def on_alarm(signum: int, frame: Any) -> None:
        if context.INITIALISED:
            return
        if noted:
            raise _NoInit
        noted.append(True)
        print(
            f"stalewise run: {script} has not called sw.init(job) after {INIT_NOTE:g} s "
            f"(the launcher runs it up to there, then starts the ranks); it stops it at "
            f"{INIT_TIMEOUT:g} s",
            file=sys.stderr,
            flush=True,
        )
        signal.setitimer(signal.ITIMER_REAL, INIT_TIMEOUT - INIT_NOTE)

    return on_alarm


def _check_python(path: Path) -> None:
    """Refuses a script that is not Python (``stalewise run /bin/true``) on one line,
    before anything starts."""
    try:
        source = path.read_bytes()
    except OSError as e:
        raise LaunchError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as e:
        where = f" at line {e.lineno}" if e.lineno else ""
        raise LaunchError(f"{path} is not valid Python: {e.msg}{where}") from None
    except ValueError as e:  # null bytes (a binary), an undecodable file
        raise LaunchError(f"{path} is not valid Python: {e}") from None


def _seconds(value: Any, least: float) -> bool:
    """Whether ``value`` is a finite number of seconds >= ``least``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value >= least


def launch(
    script: str,
    argv: list[str],
    *,
    workers: int,
    steps: int | None = None,
    timeout: float | None = None,
    runtime: str = "local",
    rank_timeout: float | None = None,
    address: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    name: str | None = None,
) -> int:
    """Runs ``script`` with ``argv`` as ``stalewise run`` does; returns the exit status.

    ``runtime``: ``"local"`` (worker processes on this machine) or ``"ray"`` (Ray actors
    across the cluster this process connects to; see :mod:`stalewise.runtime.ray.launch`).
    ``timeout``: seconds for the whole run, from the start of the ranks (None: no bound);
    ``rank_timeout``: the liveness rule's silence, local runtime only (None:
    :data:`~stalewise.launch.ranks.RANK_TIMEOUT`; 0: off). ``checkpoint_dir``,
    ``checkpoint_every``, ``resume``: the job's checkpoints, local runtime only (they win
    over ``sw.init``'s). See the module docstring.

    ``name``: serve the job under this name, with room for ``workers`` more worker ids,
    so that other processes join it with ``sw.attach(name)``.

    ``address``: the Ray cluster to run on, runtime ray only (None: ``RAY_ADDRESS``, else
    a new local instance, never a cluster another user started on this machine; see
    :func:`stalewise.runtime.ray.launch.ray_address`).

    Called from the main thread, it handles SIGTERM as Ctrl-C while it runs: the job is
    stopped in order and :class:`Terminated` (a ``KeyboardInterrupt``) is raised.

    Raises:
        LaunchError: a bad argument, or a script that ends without calling :func:`init`.
    """
    global _LAUNCH
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise LaunchError(f"--workers must be an integer in 1..{MAX_WORKERS}, got {workers!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise LaunchError(f"--steps must be an integer >= 1, got {steps!r}")
    if runtime not in runtime_lib.names("launch"):
        able = " or ".join(map(repr, runtime_lib.names("launch")))
        raise LaunchError(f"--runtime must be {able}, got {runtime!r}")
    if timeout is not None and (not _seconds(timeout, 0.0) or timeout == 0):
        raise LaunchError(f"--timeout must be a number of seconds > 0, got {timeout!r}")
    if rank_timeout is not None and not _seconds(rank_timeout, 0.0):
        raise LaunchError(
            f"--rank-timeout must be a number of seconds >= 0 (0: off), got {rank_timeout!r}"
        )
    if runtime == "ray" and rank_timeout is not None:
        raise LaunchError("--rank-timeout is for --runtime local (Ray's ranks are not watched)")
    if address is not None and runtime != "ray":
        raise LaunchError("--address is for --runtime ray (the Ray cluster to run on)")
    if rank_timeout is None:
        rank_timeout = RANK_TIMEOUT
    if name is not None:
        from stalewise.runtime.attach import check_name

        try:
            check_name(name)
        except ValueError as e:
            raise LaunchError(f"--name: {e}") from None
    checkpoints.check(checkpoint_dir, checkpoint_every, LaunchError)
    if resume and checkpoint_dir is None:
        raise LaunchError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if runtime != "local" and checkpoint_dir is not None:
        raise LaunchError("--checkpoint-dir is for --runtime local")
    path = Path(script)
    if not path.is_file():
        raise LaunchError(f"{script}: no such script")
    _check_python(path)
    missing = runtime_lib.describe(runtime).missing()
    if missing is not None:
        raise LaunchError(missing)
    _LAUNCH = _Launch(str(path), list(argv), workers, steps, timeout, runtime, rank_timeout,
                      address, checkpoint_dir, checkpoint_every, bool(resume), name=name)  # fmt: skip
    saved = sys.argv, list(sys.path), dict(os.environ)
    main = _LAUNCH.timed = threading.current_thread() is threading.main_thread()
    if main:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        alarm = signal.signal(signal.SIGALRM, _init_alarm(script))
        signal.setitimer(signal.ITIMER_REAL, INIT_NOTE)
    # up to sw.init, torchrun's variables say rank 0 (so are its outputs); STALEWISE_RANK
    # stays unset: the launcher's run, not a rank
    env = rank_env(0, workers, 0, workers)
    os.environ.update({k: v for k, v in env.items() if not k.startswith("STALEWISE_")})
    try:
        context.run_script(path, argv)
    except SystemExit as e:
        if context.INITIALISED:  # init() served the workers and ended the script: their status
            return int(e.code or 0)
        raise
    except _NoInit:
        raise LaunchError(
            f"{script} did not call sw.init(job) within {INIT_TIMEOUT:g} s, so the launcher "
            "stopped it: call sw.init right after building the Job, before training"
        ) from None
    finally:
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGALRM, alarm)
        _LAUNCH = None
        sys.argv, sys.path[:] = saved[:2]
        os.environ.clear()
        os.environ.update(saved[2])
    raise LaunchError(
        f"{script} ended without calling sw.init(job): a launched script calls it once, "
        "after building its Job, and trains with the context it returns"
    )
