"""Run a training script you own once per worker: ``stalewise run`` and :func:`init`.

Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (and the
``STALEWISE_`` ones). Example: ``examples/torch_launch.py``; more: the README and docs/."""

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
from stalewise.protocol.config import ServerConfig
from stalewise.runtime.errors import BudgetSpent

log = logging.getLogger(__name__)

__all__ = ["BudgetSpent", "Context", "LaunchError", "Terminated", "init", "launch"]

MAX_WORKERS = 256  #: The most worker processes ``stalewise run`` starts on one machine.
#: Seconds the launcher runs the script before it notes, then stops, a missing ``sw.init``.
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
    env: list[str]  # --env NAME ...: variables each rank on Ray gets from the launcher
    env_all: bool  # --env-all: every variable but the launcher's session and credentials
    checkpoint_dir: str | None  # where the launcher saves the job (None: nowhere)
    checkpoint_every: int | None  # every this many pushes of the job (and at the end)
    resume: bool  # start from checkpoint_dir's last checkpoint, if there is one
    timed: bool = False  # SIGALRM bounds the run up to sw.init (INIT_TIMEOUT)
    name: str | None = None  # --name: the job is served under it, for sw.attach


_LAUNCH: _Launch | None = None  # set in the launcher's process while it runs the script


def init(job: Any, *, steps: int | None = None, checkpoints: Any = None) -> Context:
    """This process's worker :class:`Context` in a launched job (the launcher serves ``job``, never
    returning); ``steps``: the budget, ``checkpoints``: ``sw.Checkpoints`` (flags win)."""
    if not (isinstance(getattr(job, "config", None), ServerConfig) and hasattr(job, "serve")):
        raise TypeError(f"sw.init(job): job must be a sw.Job, got {type(job).__name__}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"sw.init: steps must be an integer >= 1 or None, got {steps!r}")
    checkpoint_dir, checkpoint_every, resume = checkpoint_fields("sw.init", checkpoints)
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
    if _LAUNCH is None:
        from stalewise.runtime.logs import child_logging

        child_logging("worker 0")  # unlaunched: its warnings reach stderr
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
    if _LAUNCH is not None:  # the runtime's launch: ranks.serve_workers here, Ray's on Ray
        if _LAUNCH.checkpoint_dir is None and checkpoint_dir is not None:
            if not runtime_lib.describe(_LAUNCH.runtime).saves_served:
                raise LaunchError("checkpoints of a launched job are for --runtime "
                                  + runtime_lib.able("saves_served"))  # fmt: skip
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
        saving.InProcess(saves, ctx)
    atexit.register(ctx.close)
    return ctx


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the launcher: it stops the job as Ctrl-C does (exit status 143)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated("SIGTERM")


def _init_alarm(script: str) -> Any:
    """The launcher's SIGALRM up to ``sw.init``: a note, then :class:`_NoInit` at the timeout."""
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


def _seconds(value: Any, least: float) -> bool:
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
    env: list[str] = (),
    env_all: bool = False,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    name: str | None = None,
) -> int:
    """Runs ``script`` with ``argv`` as ``stalewise run`` does (its flags); returns the exit status.

    From the main thread, SIGTERM is handled as Ctrl-C and raises :class:`Terminated`;
    :class:`LaunchError` for a bad argument or a script that ends without calling :func:`init`."""
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
    described = runtime_lib.describe(runtime)
    if rank_timeout is not None and not described.watches_ranks:
        raise LaunchError(f"--rank-timeout is for --runtime {runtime_lib.able('watches_ranks')} "
                          f"({runtime}'s ranks are not watched)")  # fmt: skip
    for flag, given in (("--address", address is not None), ("--env", env), ("--env-all", env_all)):
        if given and described.connect is None:
            raise LaunchError(f"{flag} is for --runtime {runtime_lib.able('connect')}")
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
    if checkpoint_dir is not None and not described.saves_served:
        raise LaunchError(f"--checkpoint-dir is for --runtime {runtime_lib.able('saves_served')}")
    path = Path(script)
    if not path.is_file():
        raise LaunchError(f"{script}: no such script")
    try:  # a script that is not Python (``stalewise run /bin/true``): refused before anything
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
    missing = described.missing()
    if missing is not None:
        raise LaunchError(missing)
    _LAUNCH = _Launch(str(path), list(argv), workers, steps, timeout, runtime, rank_timeout,
                      address, list(env), env_all, checkpoint_dir, checkpoint_every, bool(resume),
                      name=name)  # fmt: skip
    saved = sys.argv, list(sys.path), dict(os.environ)
    main = _LAUNCH.timed = threading.current_thread() is threading.main_thread()
    if main:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        alarm = signal.signal(signal.SIGALRM, _init_alarm(script))
        signal.setitimer(signal.ITIMER_REAL, INIT_NOTE)
    # up to sw.init, torchrun's variables say rank 0; STALEWISE_RANK stays unset (not a rank)
    rank0 = rank_env(0, workers, 0, workers)
    os.environ.update({k: v for k, v in rank0.items() if not k.startswith("STALEWISE_")})
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
