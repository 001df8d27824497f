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
asks ``ctx.should_stop()``: once the job's pushes have reached it
(:func:`stalewise.protocol.budget.may_begin`, the rule ``should_stop`` asks), a push
not granted by a ``should_stop()`` that answered False since the last push is
refused before anything is sent: ``ctx.client.push`` raises :class:`BudgetSpent`
(a :class:`~stalewise.ServerClosed`, so ``except sw.ServerClosed`` ends such a loop
too). A rank that lets it through ends with status 0, as if its loop had ended,
and the launcher says once ``stalewise run: the budget of 50 pushes is spent; 3
pushes past it were refused``. A loop that asks ``should_stop()`` is never refused.
Either way the job commits at most ``workers - 1`` pushes beyond the budget
(:func:`~stalewise.protocol.budget.overshoot_bound`: the ranks' checks are not
atomic with the other ranks' commits).

*Progress*: while the ranks run, the launcher prints a line to stderr every
:data:`PROGRESS_TTY` seconds when stderr is a terminal, else every
:data:`PROGRESS_EVERY` seconds (logs stay short): ``stalewise run: 1200 pushes,
310.5 pushes/s, 4 of 4 ranks live``. ``STALEWISE_PROGRESS=SECONDS`` sets the
interval (0: no progress lines). The last line says how the ranks ended:
``stalewise run: 4 workers done, 1201 pushes``, or ``stalewise run: 4 workers,
1 failed, 1201 pushes`` when a rank failed. A worker that dies is reported by the
launcher, which exits with status 1; the others carry on to the budget.

*Checkpoints* (local runtime): ``stalewise run --checkpoint-dir DIR
[--checkpoint-every N] [--resume]``, or ``sw.init(job, checkpoint_dir=DIR,
checkpoint_every=N, resume=True)`` (the flags win). The launcher, which holds the
shards, saves the job in ``Job.train``'s data-only format
(:mod:`stalewise.checkpoint`, through its :class:`~stalewise.checkpoint.Saver`):
every ``N`` pushes of the job (counted by the server) and at the end, also after
Ctrl-C or SIGTERM. A checkpoint holds the shards' state (parameters, optimizer
state, versions), the job's push counts, and each rank's ``ctx.state``: a dict the
script fills (its data position, an inner optimizer's state, an RNG's
``bit_generator.state``) with JSON values and numpy arrays, nested dicts of them;
nothing is pickled (:func:`stalewise.checkpoint.flat_state`). A rank hands its
``ctx.state`` over in ``ctx.should_stop()`` once the job's pushes pass a multiple of
``N`` (the launcher waits :data:`RANK_STATE_WAIT` seconds for it, else keeps the
rank's previous one) and at ``ctx.close()``, through files in ``DIR/.ranks``.
``--resume`` restores the newest usable checkpoint before any rank starts: the
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
  is set (``ctx.should_stop()`` turns true), the ranks get :data:`STOP_GRACE`
  seconds to end, those still running are killed (a line each), then the
  shards close. ``stalewise run`` exits 130 (Ctrl-C) or 143 (SIGTERM,
  :class:`Terminated`). A rank interrupted itself (Ctrl-C in a terminal reaches
  every process of its group) says so on one line, with no traceback.
* **--timeout SECONDS**: counted from the start of the ranks, it bounds the
  whole run. At the deadline the launcher names each rank still running and how
  far it got (``rank 1 (3 pushes, the last 18.2 s ago)``), stops the job as
  above, and exits 1. This is what catches a rank that hangs before its first
  push, or every rank at once (a BSP round waiting on a hung rank).
* **The liveness rule** (``--rank-timeout SECONDS``, default
  :data:`RANK_TIMEOUT`; 0 turns it off): the launcher reads each rank's push
  counter (in the shared block) every quarter of a second. A rank that has
  pushed at least once, then pushes nothing for that long while the job goes on
  without it (another rank pushed since its last push), is taken for hung: named (``rank 1 hung: no push for 300.2 s while the
  other ranks pushed 81234 times``), killed, and the others carry on to the
  budget; the launcher exits 1. Its clock starts at its first push, so a rank
  slow to start (importing torch, loading data) is never taken for hung, and a
  job where no rank pushes is left to ``--timeout``. A fixed bound, not the
  phi rule :class:`~stalewise.protocol.liveness.Silence` gives ``Job.train``'s
  workers: between two pushes a script you own may evaluate or save for a long
  while, which a worker loop of the library never does. Pulls are not counted
  (they read the shared block without a trace), hence "pushes nothing".

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
import contextlib
import dataclasses
import logging
import math
import multiprocessing as mp
import os
import runpy
import signal
import sys
import threading
import time
from multiprocessing import connection
from pathlib import Path
from typing import Any

from stalewise import runtime as runtime_lib
from stalewise.runtime.base import ServerClosed

log = logging.getLogger(__name__)

__all__ = ["BudgetSpent", "Context", "LaunchError", "Terminated", "init", "launch"]

#: The most worker processes ``stalewise run`` starts on one machine.
MAX_WORKERS = 256


class LaunchError(RuntimeError):
    """A launched script could not be run as asked (a user error: one line)."""


class BudgetSpent(ServerClosed):
    """A push refused because the job's budget of pushes is spent (nothing was sent).

    Raised by ``ctx.client.push`` in a loop that did not ask ``ctx.should_stop()``
    (see the module docstring); a :class:`~stalewise.ServerClosed`, so a loop that
    ends on that ends on this too. ``steps`` is the budget."""

    def __init__(self, steps: int):
        super().__init__(
            f"the job's budget of {steps} pushes is spent: this push was refused (nothing "
            "was sent); end the loop when ctx.should_stop() is true"
        )
        self.steps = steps


@dataclasses.dataclass
class Context:
    """What :func:`init` gives one worker: who it is, its client, and when to stop."""

    rank: int  #: this worker's id, 0 .. world_size - 1
    world_size: int  #: the number of workers
    client: Any  #: this worker's :class:`~stalewise.runtime.local.client.Client`
    steps: int | None = None  #: the job's budget of pushes in all (None: no budget)
    launched: bool = True  #: started by ``stalewise run`` (else: one worker, served here)
    #: this rank's own state (data position, RNG, ...), saved with each checkpoint as data
    #: (JSON values, numpy arrays) and restored on resume; see "Checkpoints" above
    state: dict = dataclasses.field(default_factory=dict)
    _ckpt: Any = dataclasses.field(default=None, repr=False)  # its side of the checkpoints
    _server: Any = dataclasses.field(default=None, repr=False)
    _barrier: Any = dataclasses.field(default=None, repr=False)  # the launcher's start barrier
    _granted: bool = dataclasses.field(default=False, repr=False)  # should_stop() said go
    refused: int = dataclasses.field(default=0, repr=False)  #: pushes refused (BudgetSpent)

    def __post_init__(self) -> None:
        if self.client is not None:
            _guard_budget(self)

    def should_stop(self) -> bool:
        """True once the job's workers have pushed ``steps`` times in all, or the job stops."""
        if self._ckpt is not None:
            self._ckpt.tick(self)
        if self.client.stopping:
            return True
        stop = self.steps is not None and not self.client.may_begin(self.steps)
        self._granted = not stop
        return stop

    def close(self) -> None:
        """Waits for this worker's last push and leaves the job (and, unlaunched, stops
        the shards served in this process). Calling it again does nothing."""
        if self.client is None:
            return
        if self._ckpt is not None:  # this rank's last state (unlaunched: the last checkpoint)
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close(self)
        client, self.client = self.client, None
        try:
            client.wait()
        finally:
            client.close()
            if self._server is not None:
                self._server.close()
                self._server = None


def _guard_budget(ctx: Context) -> None:
    """Makes ``ctx.client`` refuse a push past the job's budget (:class:`BudgetSpent`)
    unless ``ctx.should_stop()`` granted it: the budget rule is the client's own
    (``may_begin``, :mod:`stalewise.protocol.budget`), asked at the commit. The local
    client's ``push`` commits through ``push_flat_sent``, which is guarded; Ray's
    ``push``."""
    client = ctx.client
    name = "push_flat_sent" if hasattr(client, "push_flat_sent") else "push"
    send = getattr(client, name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        granted, ctx._granted = ctx._granted, False
        steps = ctx.steps
        if steps is not None and not granted and not client.may_begin(steps):
            ctx.refused += 1
            raise BudgetSpent(steps)
        return send(*args, **kwargs)

    setattr(client, name, guarded)


@dataclasses.dataclass
class _Launch:
    """In the launcher's process: how to run the script's workers."""

    script: str
    argv: list[str]
    workers: int
    steps: int | None
    timeout: float | None = None
    runtime: str = "local"
    rank_timeout: float = 300.0  # the liveness rule's silence (0: off)
    address: str | None = None  # --address, runtime ray (None: RAY_ADDRESS, else a new local one)
    checkpoint_dir: str | None = None  # where the launcher saves the job (None: nowhere)
    checkpoint_every: int | None = None  # every this many pushes of the job (and at the end)
    resume: bool = False  # start from checkpoint_dir's last checkpoint, if there is one


_LAUNCH: _Launch | None = None  # set in the launcher's process while it runs the script
_WORKER: Context | None = None  # set in a worker process before it runs the script
_INITIALISED = False  # init() has been called in this process


def init(
    job: Any,
    *,
    steps: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
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
        _RankStates.join(ctx)  # --checkpoint-dir: ctx.state restored, and saved from here on
        _rendezvous(ctx)
        return ctx
    _check_checkpointing(checkpoint_dir, checkpoint_every, ValueError)
    if _LAUNCH is not None:  # the runtime's launch: _serve_workers here, Ray's on Ray
        if _LAUNCH.checkpoint_dir is None and checkpoint_dir is not None:
            if _LAUNCH.runtime != "local":
                raise LaunchError("checkpoints of a launched job are for --runtime local")
            _LAUNCH.checkpoint_dir = os.fspath(checkpoint_dir)
            _LAUNCH.resume = _LAUNCH.resume or bool(resume)
        if _LAUNCH.checkpoint_every is None:
            _LAUNCH.checkpoint_every = checkpoint_every
        raise SystemExit(runtime_lib.describe(_LAUNCH.runtime).load("launch")(job, _LAUNCH))
    server = job.serve(workers=1)
    saves = None
    if checkpoint_dir is not None:
        try:
            saves = _Checkpoints(job, server, os.fspath(checkpoint_dir), checkpoint_every, resume)
        except BaseException:
            server.close()
            raise
    client = server.client(0)
    ctx = Context(0, 1, client, steps=steps, launched=False, _server=server)
    if saves is not None:
        ctx.state, ctx._ckpt = saves.rank_state(0), _InProcess(saves)
    atexit.register(ctx.close)
    return ctx


#: Seconds a launched worker waits at :func:`init` for the others to get there.
RENDEZVOUS_TIMEOUT = 300.0


def _rendezvous(ctx: Context) -> None:
    """Waits until every launched worker has reached :func:`init`, so that they start
    together (a worker that is first by the time its imports take would otherwise spend
    the budget alone). A worker that never gets there holds the others up for
    :data:`RENDEZVOUS_TIMEOUT` seconds at most, and one that ends first not at all;
    then they start without it."""
    if ctx._barrier is None:
        return
    try:
        ctx._barrier.wait(RENDEZVOUS_TIMEOUT)
    except threading.BrokenBarrierError:
        log.warning(
            "rank %d: not every worker reached sw.init (one ended first, or %g s passed); "
            "starting without them",
            ctx.rank,
            RENDEZVOUS_TIMEOUT,
        )


def _serve_workers(job: Any, launch: _Launch) -> int:
    """The launcher's side: serves ``job``, runs the workers, waits; the exit status.

    However it ends (the ranks done, a timeout, Ctrl-C, SIGTERM), the ranks are stopped
    before the shards: :meth:`_Ranks.stop`."""
    ctx = mp.get_context("spawn")
    with job.serve(workers=launch.workers) as server, _rank_files(launch) as folder:
        saves = None  # the checkpoints (--checkpoint-dir): restored here, before any rank
        if launch.checkpoint_dir is not None:
            saves = _Checkpoints(job, server, launch.checkpoint_dir, launch.checkpoint_every,
                                 launch.resume, folder=folder)  # fmt: skip
        ranks = _Ranks(server, launch)
        ranks.checkpoints = saves
        try:
            for rank in range(launch.workers):
                ranks.start(ctx, rank)
            log.info("stalewise run: %d workers started", launch.workers)
            ranks.wait()
        finally:  # Ctrl-C and SIGTERM (Terminated) pass through here, and re-raise
            ranks.stop()
            if saves is not None:  # the last checkpoint: the job as the ranks left it
                saves.save(final=True)
        pushes = server.observer.job_pushes
    failed = sum(r.proc.exitcode != 0 for r in ranks.ranks) + launch.workers - len(ranks.ranks)
    end_lines(launch.workers, failed, pushes, launch.steps, ranks.refused)
    return 1 if ranks.failed else 0


# -- checkpoints of a loop you own (see "Checkpoints" in the module docstring) --------------

_RANKS_ENV = "STALEWISE_CHECKPOINT_RANKS"  # a rank's folder for its ctx.state (launched)
_EVERY_ENV = "STALEWISE_CHECKPOINT_EVERY"
#: Seconds the launcher waits for the ranks' ``ctx.state`` once a checkpoint is due; a
#: rank that has not called ``ctx.should_stop()`` since is saved with its previous state.
RANK_STATE_WAIT = 10.0


def _check_checkpointing(directory: Any, every: Any, error: type[Exception]) -> None:
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise error(f"checkpoint_every (--checkpoint-every) must be an integer >= 1, got {every!r}")
    if every is not None and directory is None:
        raise error("checkpoint_every (--checkpoint-every) needs checkpoint_dir (--checkpoint-dir)")


class _Checkpoints:
    """The saving side, which holds the server: restores the job (``resume``) before any
    worker joins, and saves it every ``every`` pushes of the job and at the end, with
    each rank's ``ctx.state``, through :class:`stalewise.checkpoint.Saver` (the format,
    atomic writes and failure handling of ``Job.train``'s checkpoints)."""

    def __init__(self, job: Any, server: Any, directory: str, every: int | None,
                 resume: bool, *, folder: Path | None = None):  # fmt: skip
        from types import SimpleNamespace

        from stalewise import checkpoint

        self.server, self.every, self.folder = server, every, folder
        workers = server.workers
        o = SimpleNamespace(checkpoint_dir=directory, checkpoint_every=every, resume=resume,
                            checkpoint_seconds=None, checkpoint_keep=2, room=workers,
                            run=None)  # fmt: skip
        if resume and not checkpoint.exists(directory):
            print(f"stalewise: resume: no checkpoint in {directory} yet; starting from the start",
                  file=sys.stderr, flush=True)  # fmt: skip
        try:
            ckpt = checkpoint.resume_point(job.config, o, runtime="local")
            if ckpt is not None:
                server.resume(ckpt)
        except (checkpoint.CheckpointError, ValueError) as e:
            raise LaunchError(f"--resume from {directory}: {' '.join(str(e).split())}") from None
        self.ranks: list[dict] = [{} for _ in range(workers)]
        if ckpt is not None and ckpt.ranks is not None:
            self.ranks[: len(ckpt.ranks)] = ckpt.ranks[:workers]
        self.pushes = 0 if ckpt is None else int(ckpt.step.get("pushes", 0))
        self.saver = checkpoint.Saver(job.config, None, o, runtime="local", version=0)
        self.started = time.monotonic()
        self.due: tuple[int, float] | None = None  # (the epoch due, since when)
        if ckpt is not None:
            print(f"stalewise run: resumed from {ckpt.path} (version {ckpt.version}, "
                  f"{self.pushes} pushes)", file=sys.stderr, flush=True)  # fmt: skip
        if folder is not None:
            for r, state in enumerate(self.ranks):  # what each rank starts from
                _write_rank_state(folder, r, state, self.pushes)

    def rank_state(self, rank: int) -> dict:
        return self.ranks[rank]

    def tick(self, running: list[int]) -> None:
        """The launcher's look (every quarter of a second): a checkpoint once the job's
        pushes reach the next multiple of ``every`` and the running ranks have saved
        their state for it (or :data:`RANK_STATE_WAIT` passed)."""
        if self.every is None:
            return
        pushes = int(self.server.control[self.server.layout.pushes_done].sum())
        epoch = pushes // self.every
        if self.due is None:
            if epoch > self.pushes // self.every:
                self.due = (epoch, time.monotonic())
            return
        want, since = self.due
        ready = all(_rank_epoch(self.folder, r, self.every) >= want for r in running)
        if ready or time.monotonic() - since >= RANK_STATE_WAIT:
            self.save()

    def save(self, *, final: bool = False) -> None:
        """Writes a checkpoint (``final``: the run's last) of the server and the ranks' states."""
        self.due = None
        try:
            states, step, residuals = self.server.checkpoint_parts()
        except Exception as e:  # a shard died: the last checkpoint stays the one to resume
            log.warning("checkpoint: cannot read the shards' state: %s", e)
            return
        if self.folder is not None:
            for r in range(len(self.ranks)):
                got = _read_rank_state(self.folder, r)
                if got is not None:
                    self.ranks[r] = got
        step["time"] = time.monotonic() - self.started
        self.pushes = step["pushes"]
        self.saver.save(states, step, residuals, final=final, ranks=self.ranks)


class _InProcess:
    """A context's side of the checkpoints when ``sw.init`` serves the job in its own
    process (one worker, no launcher): saves from ``should_stop()`` and ``close()``."""

    def __init__(self, saves: _Checkpoints):
        self.saves = saves

    def tick(self, ctx: Context) -> None:
        saves = self.saves
        if saves.every is not None and ctx.client.job_pushes // saves.every > (
            saves.pushes // saves.every
        ):
            ctx.client.wait()  # its pushes acknowledged: in the shards' state
            saves.ranks[0] = ctx.state
            saves.save()

    def close(self, ctx: Context) -> None:
        ctx.client.wait()
        self.saves.ranks[0] = ctx.state
        self.saves.save(final=True)


class _RankStates:
    """A launched rank's side: ``ctx.state`` from the launcher's folder at ``sw.init``, and
    into it from ``should_stop()`` once the job's pushes pass a multiple of ``every``, and
    at ``close()`` (data only: :func:`stalewise.checkpoint.flat_state`)."""

    def __init__(self, folder: Path, every: int | None):
        self.folder, self.every = folder, every
        self.epoch: int | None = None

    @classmethod
    def join(cls, ctx: Context) -> None:
        folder = os.environ.get(_RANKS_ENV)
        if not folder:
            return
        every = os.environ.get(_EVERY_ENV)
        ctx._ckpt = cls(Path(folder), int(every) if every else None)
        ctx.state = _read_rank_state(Path(folder), ctx.rank) or {}

    def tick(self, ctx: Context) -> None:
        if self.every is None:
            return
        pushes = ctx.client.job_pushes
        epoch = pushes // self.every
        if self.epoch is None:
            self.epoch = epoch
        elif epoch > self.epoch:
            self.epoch = epoch
            _write_rank_state(self.folder, ctx.rank, ctx.state, pushes)

    def close(self, ctx: Context) -> None:
        _write_rank_state(self.folder, ctx.rank, ctx.state, ctx.client.job_pushes)


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.safetensors"


def _write_rank_state(folder: Path, rank: int, state: Any, pushes: int) -> None:
    """Rank ``rank``'s state into its file, atomically: arrays as tensors, the JSON values
    and the job's ``pushes`` in the header's metadata (no pickle)."""
    import json

    from safetensors.numpy import save_file

    from stalewise import checkpoint

    arrays, values = checkpoint.flat_state(state, f"rank {rank}: ctx.state")
    path = _rank_file(folder, rank)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    meta = {"values": json.dumps(values, allow_nan=True), "pushes": str(int(pushes))}
    save_file({k: checkpoint._contiguous(a) for k, a in arrays.items()}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def _read_rank_state(folder: Path, rank: int) -> dict | None:
    import json

    from safetensors.numpy import load

    from stalewise import checkpoint

    try:
        data = _rank_file(folder, rank).read_bytes()
    except FileNotFoundError:
        return None
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n]).get("__metadata__", {})
    flat = {**json.loads(meta["values"]), **load(data)}
    return checkpoint._nested(flat)


def _rank_epoch(folder: Path | None, rank: int, every: int) -> int:
    """The epoch (job pushes // every) of rank ``rank``'s last saved state (-1: none)."""
    import json

    try:
        with open(_rank_file(folder, rank), "rb") as f:  # type: ignore[arg-type]
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(n)).get("__metadata__", {})
        return int(meta["pushes"]) // every
    except (OSError, ValueError, KeyError, TypeError):
        return -1


@contextlib.contextmanager
def _rank_files(launch: _Launch):
    """The folder the ranks exchange their ``ctx.state`` through
    (``CHECKPOINT_DIR/.ranks``, emptied first), named in the ranks' environment; None
    without ``--checkpoint-dir``."""
    if launch.checkpoint_dir is None:
        yield None
        return
    import shutil

    folder = Path(launch.checkpoint_dir) / ".ranks"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    saved = {k: os.environ.get(k) for k in (_RANKS_ENV, _EVERY_ENV)}
    os.environ[_RANKS_ENV] = str(folder)
    os.environ[_EVERY_ENV] = str(launch.checkpoint_every or "")
    try:
        yield folder
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: Seconds the launcher gives its ranks to end by themselves once it stops the job
#: (Ctrl-C, SIGTERM, ``--timeout``): a rank that polls ``ctx.should_stop()`` ends within
#: a step; the ranks still running after that are killed.
STOP_GRACE = 5.0
#: ``--rank-timeout``'s default: seconds without a push, once a rank has pushed, while the
#: other ranks push, before the launcher takes that rank for hung.
RANK_TIMEOUT = 300.0
_POLL = 0.25  # seconds between the launcher's looks at the ranks' push counters
#: Seconds between the launcher's progress lines when stderr is a terminal.
PROGRESS_TTY = 2.0
#: Seconds between them otherwise (a log file, a pipe).
PROGRESS_EVERY = 10.0


def progress_every() -> float:
    """Seconds between progress lines: ``STALEWISE_PROGRESS`` if set (0: none), else
    :data:`PROGRESS_TTY` when stderr is a terminal, else :data:`PROGRESS_EVERY`."""
    text = os.environ.get("STALEWISE_PROGRESS", "").strip()
    if text:
        try:
            every = float(text)
        except ValueError:
            every = -1.0
        if math.isfinite(every) and every >= 0:
            return every
        log.warning("STALEWISE_PROGRESS=%r is not a number of seconds >= 0; ignored", text)
    isatty = getattr(sys.stderr, "isatty", None)
    return PROGRESS_TTY if isatty is not None and isatty() else PROGRESS_EVERY


class Progress:
    """The launcher's progress line on stderr, on both runtimes: the job's pushes, their
    rate since the last line, and the ranks still running."""

    def __init__(self, workers: int):
        self.workers = workers
        self.every = progress_every()
        self.last = time.monotonic()
        self.pushes = 0

    def tick(self, now: float, pushes: int, live: int) -> None:
        """Prints a line if the interval has passed since the last one (or the start)."""
        if not self.every or now - self.last < self.every:
            return
        rate = (pushes - self.pushes) / max(now - self.last, 1e-9)
        self.last, self.pushes = now, pushes
        print(
            f"stalewise run: {pushes} pushes, {rate:.1f} pushes/s, "
            f"{live} of {self.workers} ranks live",
            file=sys.stderr,
            flush=True,
        )


def end_lines(
    workers: int, failed: int, pushes: int, steps: int | None, refused: int, where: str = ""
) -> None:
    """The launcher's last lines on stderr: the pushes refused past the budget (once, if
    any), then how the ranks ended (``where``: e.g. `` on 2 Ray node(s)``)."""
    if refused and steps is not None:
        print(
            f"stalewise run: the budget of {steps} pushes is spent; {refused} pushes past "
            "it were refused",
            file=sys.stderr,
        )
    ended = (
        f"{workers} workers done"
        if not failed
        else (f"{workers - failed} of {workers} workers done, {failed} failed")
    )
    print(f"stalewise run: {ended}{where}, {pushes} pushes", file=sys.stderr, flush=True)


class _Rank:
    """The launcher's view of one rank: its process, its pipe, its pushes."""

    def __init__(self, rank: int, proc: Any, conn: Any):
        self.rank, self.proc, self.conn = rank, proc, conn
        self.ready = False  # reached sw.init (or can no longer say so)
        self.released = False  # told to start (the rendezvous)
        self.ended = False
        self.judged = False  # a line already says what became of it (hung, killed)
        self.pushes = 0
        self.last_push: float | None = None  # when the launcher saw its count last rise
        self.job_then = 0  # the job's pushes at that moment

    def progress(self, now: float) -> str:
        if self.last_push is None:
            return "no push yet"
        return f"{self.pushes} pushes, the last {now - self.last_push:.1f} s ago"


class _Ranks:
    """The launcher's ranks: starts them, releases them together, watches their pushes
    (the liveness rule, see the module docstring), and stops them."""

    def __init__(self, server: Any, launch: _Launch):
        self.server, self.launch = server, launch
        self.ranks: list[_Rank] = []
        self.failed: list[str] = []
        self.stopping = False
        self.started = time.monotonic()
        self.refused = 0  # pushes past the budget refused (BudgetSpent), as the ranks said
        self.pushes = 0  # the job's pushes at the last look
        self.progress = Progress(launch.workers)
        from stalewise.runtime.local.procs import refers_to_main

        # a rank runs the script once, with runpy: it is spawned without the launcher's
        # __main__ (the script), unless the job's config refers to something defined
        # there (a schedule written in the script), which only importing it can unpickle
        self.needs_main = refers_to_main(server.config)

    def start(self, ctx: Any, rank: int) -> None:
        launch = self.launch
        mine, theirs = ctx.Pipe()
        args = (
            launch.script,
            launch.argv,
            self.server.client(rank),
            rank,
            launch.workers,
            launch.steps,
            theirs,
        )
        # started from this thread, which waits for them: a rank's parent-death signal
        # (procs.die_with_parent) fires when the thread that started it ends
        p = ctx.Process(target=_worker_main, args=args, name=f"stalewise-run-{rank}")
        from stalewise.runtime.local.procs import stalewise_main

        with stalewise_main(self.needs_main):
            p.start()
        theirs.close()
        self.server.release(rank)  # the shards notice if this worker dies
        self.ranks.append(_Rank(rank, p, mine))

    def _fail(self, line: str) -> None:
        """Says what went wrong, at once, on a line of stderr; the run will exit 1."""
        self.failed.append(line)
        print(f"stalewise run: {line}", file=sys.stderr, flush=True)

    def running(self) -> list[_Rank]:
        return [r for r in self.ranks if not r.ended]

    def _release(self, word: bytes) -> None:
        """Lets every rank waiting at the rendezvous go (``go``: all there; ``alone``: a
        rank ended before it got there)."""
        for r in self.ranks:
            if not r.released and not r.ended:
                r.released = True
                with contextlib.suppress(OSError):
                    r.conn.send_bytes(word)

    def _ended(self, r: _Rank) -> None:
        r.proc.join()
        r.ended = r.ready = True
        with contextlib.suppress(EOFError, OSError):
            while r.conn.poll():  # b"ready" unread, then b"refused N" (pushes past the budget)
                word = r.conn.recv_bytes()
                if word.startswith(b"refused "):
                    self.refused += int(word.split()[1])
        r.conn.close()
        if r.proc.exitcode != 0 and not r.judged and not self.stopping:
            from stalewise.runtime.local.procs import describe_exit

            self._fail(f"rank {r.rank} failed ({describe_exit(r.proc.exitcode)})")
            self._release(b"alone")  # the others start without it, at once

    def _look(self, now: float) -> None:
        """Reads the ranks' push counters; kills a rank that the liveness rule finds hung."""
        control = self.server.control
        counts = control[self.server.layout.pushes_done]
        job = self.pushes = int(counts.sum())
        self.progress.tick(now, job, len(self.running()))
        for r in self.ranks:
            n = int(counts[r.rank])
            if n != r.pushes:
                r.pushes, r.last_push, r.job_then = n, now, job
        limit = self.launch.rank_timeout
        if not limit:
            return
        for r in self.running():
            if r.judged or r.last_push is None or now - r.last_push < limit:
                continue
            others = job - r.job_then  # the others' pushes since its last one
            if others <= 0:  # the job is not going on without it either: --timeout's case
                continue
            r.judged = True
            r.proc.kill()
            self._fail(
                f"rank {r.rank} hung: no push for {now - r.last_push:.1f} s while the other "
                f"ranks pushed {others} times (--rank-timeout {limit:g}); killed it"
            )

    def wait(self) -> None:
        """Until every rank has ended, or ``--timeout`` (then ``failed`` says which ranks
        were still running, and how far they had got)."""
        timeout = self.launch.timeout
        deadline = None if timeout is None else self.started + timeout
        while running := self.running():
            now = time.monotonic()
            self._look(now)
            if getattr(self, "checkpoints", None) is not None:
                self.checkpoints.tick([r.rank for r in running])
            if deadline is not None and now >= deadline:
                still = "; ".join(f"rank {r.rank} ({r.progress(now)})" for r in running)
                self._fail(f"timed out after {timeout:g} s (--timeout): still running: {still}")
                return
            if all(r.ready for r in self.ranks):
                self._release(b"go")
            waiting = {r.conn: r for r in running if not r.ready}
            ends = {r.proc.sentinel: r for r in running}
            left = _POLL if deadline is None else max(0.0, min(_POLL, deadline - now))
            for obj in connection.wait([*waiting, *ends], left):
                if obj in waiting:
                    r = waiting[obj]
                    with contextlib.suppress(EOFError, OSError):  # else its end will say
                        r.conn.recv_bytes()  # b"ready"
                    r.ready = True
            for r in ends.values():
                if not r.ended and not r.proc.is_alive():
                    self._ended(r)

    def stop(self) -> None:
        """Stops the ranks still running, before the shards close: sets the job's stop flag
        (``ctx.should_stop()`` turns true), lets the ranks waiting at the rendezvous go,
        gives them :data:`STOP_GRACE` seconds to end, then kills the rest. A second
        Ctrl-C (or SIGTERM) meanwhile kills them at once."""
        self.stopping = True
        if not self.running():
            return
        if self.server.control is not None:
            self.server.control[0] = 1
        self._release(b"go")
        why = "was still running"
        try:
            deadline = time.monotonic() + STOP_GRACE
            while (running := self.running()) and (left := deadline - time.monotonic()) > 0:
                connection.wait([r.proc.sentinel for r in running], left)
                for r in running:
                    if not r.proc.is_alive():
                        self._ended(r)
            why = f"did not stop within {STOP_GRACE:g} s"
        except KeyboardInterrupt:
            why = "was still running at the second interrupt"
        finally:
            for r in self.running():
                r.proc.kill()
                r.proc.join()
                r.ended = True
                r.conn.close()
                print(f"stalewise run: rank {r.rank} {why}; killed it", file=sys.stderr)


def whole_lines() -> None:
    """Makes each line a worker prints one write to the stdout and stderr it shares with
    the others. Unbuffered (``PYTHONUNBUFFERED``, ``-u``), ``print`` writes its text and
    its newline separately, and two workers' lines tear (``rank 2: 2.9rank 1: 2.9``);
    line buffering keeps them whole and still shows each line as it ends."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "write_through", False) and hasattr(stream, "reconfigure"):
            stream.reconfigure(write_through=False, line_buffering=True)


class _Gate:
    """A rank's side of the launcher's start rendezvous: its pipe to the launcher, on
    which it says ``ready`` and waits for ``go`` (``alone``: a rank ended before it got
    there). No named semaphore: nothing of it can stay in ``/dev/shm``."""

    def __init__(self, conn: Any):
        self.conn = conn

    def wait(self, timeout: float) -> None:
        try:
            self.conn.send_bytes(b"ready")
            word = self.conn.recv_bytes() if self.conn.poll(timeout) else b""
        except (EOFError, OSError):  # the launcher is gone (and this rank goes with it)
            word = b""
        if word != b"go":
            raise threading.BrokenBarrierError


def _worker_main(
    script: str,
    argv: list[str],
    client: Any,
    rank: int,
    world: int,
    steps: int | None,
    conn: Any,
) -> None:
    """A worker process (a rank): runs the script as ``__main__`` with its context set,
    once (it was spawned without the launcher's ``__main__``, see :class:`_Ranks`).

    It dies with the launcher (:func:`~stalewise.runtime.local.procs.die_with_parent`,
    first thing). Interrupted (Ctrl-C reaches every process of the terminal's group),
    or stopped by the launcher while it waits on the shards, it says so on one line."""
    global _WORKER
    from stalewise.runtime.local.procs import die_with_parent

    die_with_parent()
    from stalewise.runtime.logs import child_logging

    child_logging(f"rank {rank}")
    whole_lines()
    _WORKER = Context(rank, world, client, steps=steps, _barrier=_Gate(conn))
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    os.environ.update(rank_env(rank, world, rank, world))
    try:
        runpy.run_path(script, run_name="__main__")
    except BudgetSpent:  # the loop did not ask should_stop(): the launcher says so, once
        _leave_quietly()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback either
        _leave_quietly()
        print(f"stalewise run: rank {rank} interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except ServerClosed as e:  # the launcher stopped the job under it
        _leave_quietly()
        print(f"stalewise run: rank {rank}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except BaseException:  # its traceback (or exit status) tells the rest
        _leave_quietly()
        raise
    finally:
        if _WORKER.refused:  # the launcher counts the refused pushes (_Ranks._ended)
            with contextlib.suppress(OSError):
                conn.send_bytes(b"refused %d" % _WORKER.refused)
    if _WORKER.client is not None:  # the script did not close it
        _WORKER.close()


def rank_env(rank: int, world: int, local_rank: int, local_world: int) -> dict[str, str]:
    """The variables a rank's environment holds before its script runs (torchrun's names
    and stalewise's; see the module docstring)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "STALEWISE_RANK": str(rank),
        "STALEWISE_WORLD_SIZE": str(world),
    }


def _leave_quietly() -> None:
    """Closes the rank's context if the script did not, whatever the shards' state."""
    if _WORKER is not None and _WORKER.client is not None:
        with contextlib.suppress(Exception):
            _WORKER.close()


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the launcher, which stops the job as Ctrl-C does (``stalewise run``
    then exits with status 143)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated("SIGTERM")


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
) -> int:
    """Runs ``script`` with ``argv`` as ``stalewise run`` does; returns the exit status.

    ``runtime``: ``"local"`` (worker processes on this machine) or ``"ray"`` (Ray actors
    across the cluster this process connects to; see :mod:`stalewise.runtime.ray.launch`).
    ``timeout``: seconds for the whole run, from the start of the ranks (None: no bound);
    ``rank_timeout``: the liveness rule's silence, local runtime only (None:
    :data:`RANK_TIMEOUT`; 0: off). ``checkpoint_dir``, ``checkpoint_every``, ``resume``:
    the job's checkpoints, local runtime only (they win over ``sw.init``'s). See the
    module docstring.

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
    _check_checkpointing(checkpoint_dir, checkpoint_every, LaunchError)
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
    _LAUNCH = _Launch(str(path), list(argv), workers, steps, timeout, runtime, rank_timeout)
    _LAUNCH.address = address
    _LAUNCH.checkpoint_dir, _LAUNCH.checkpoint_every = checkpoint_dir, checkpoint_every
    _LAUNCH.resume = bool(resume)
    saved = sys.argv, list(sys.path)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.resolve().parent))
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main else None
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        if _INITIALISED:  # init() served the workers and ended the script: their status
            return int(e.code or 0)
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        _LAUNCH = None
        sys.argv, sys.path[:] = saved
    raise LaunchError(
        f"{script} ended without calling sw.init(job): a launched script calls it once, "
        "after building its Job, and trains with the context it returns"
    )
