"""``stalewise run`` on the local runtime: one process per rank, watched by the launcher."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import connection
from pathlib import Path
from typing import Any

from stalewise.launch import checkpoints, context
from stalewise.launch.progress import Progress, end_lines, pushes_of, say
from stalewise.protocol.liveness import silent_rank
from stalewise.runtime.errors import BudgetSpent, ServerClosed

log = logging.getLogger(__name__)

#: Seconds ranks get to end once the job stops (Ctrl-C, SIGTERM, ``--timeout``); then a kill.
STOP_GRACE = 5.0
#: ``--rank-timeout``'s default: seconds a rank that pushed may go without while others push.
RANK_TIMEOUT = 300.0
POLL = 0.25  # seconds between the launcher's looks at the ranks' push counters


def serve_workers(job: Any, launch: Any) -> int:
    """The launcher's side: serves ``job``, runs the workers, waits; returns the exit status."""
    ctx = mp.get_context("spawn")
    directory, every = launch.checkpoint_dir, launch.checkpoint_every
    with job.serve(workers=room(launch), name=launch.name) as server, \
            checkpoints.rank_files(directory, every, launch.resume) as folder:  # fmt: skip
        saves = None  # the checkpoints (--checkpoint-dir): restored here, before any rank
        if directory is not None:
            saves = checkpoints.Saves(job, server, directory, every, launch.resume, folder=folder)
            if launch.steps is not None and server.job_pushes >= launch.steps:
                say(f"the job is complete: {server.job_pushes} of {launch.steps} pushes, as "
                    f"checkpointed in {directory}; no rank started")  # fmt: skip
                return 0
        ranks = Ranks(server, launch, saves)
        try:
            for rank in range(launch.workers):
                ranks.start(ctx, rank)
            log.info("stalewise run: %d workers started", launch.workers)
            ranks.wait()
        finally:  # Ctrl-C and SIGTERM (Terminated) pass through here, and re-raise
            ranks.stop()
            if saves is not None:  # the last checkpoint: the job as the ranks left it
                saves.save(final=True)
        pushes = pushes_of(server)
    with contextlib.suppress(OSError):  # the rank logs' folder, if no rank failed
        os.rmdir(ranks.logs)
    failed = sum(r.proc.exitcode != 0 for r in ranks.ranks) + launch.workers - len(ranks.ranks)
    end_lines(launch.workers, failed, pushes, launch.steps, ranks.refused)
    return 1 if ranks.failed else 0


class Rank:
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
        self.why: str | None = None  # its error, in the line it sent

    def progress(self, now: float) -> str:
        if self.last_push is None:
            return "no push yet"
        return f"{self.pushes} pushes, the last {now - self.last_push:.1f} s ago"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.ended = True
        self.conn.close()


class Ranks:
    """The launcher's ranks: starts, releases, watches (the liveness rule) and stops them."""

    def __init__(self, server: Any, launch: Any, saves: checkpoints.Saves | None = None):
        self.server, self.launch, self.saves = server, launch, saves
        self.ranks: list[Rank] = []
        self.failed: list[str] = []
        self.stopping = False
        self.started = time.monotonic()
        self.refused = 0  # pushes past the budget refused (BudgetSpent), as the ranks said
        self.pushes = 0  # the job's pushes at the last look
        self.progress = Progress(launch.workers, server)
        self.logs = tempfile.mkdtemp(prefix="stalewise-run-")  # a failed rank's traceback
        from stalewise.runtime.local.procs import refers_to_main

        # a rank is spawned without the script as __main__ unless the config needs it
        self.needs_main = refers_to_main(server.config)

    def start(self, ctx: Any, rank: int) -> None:
        from stalewise.runtime.local.procs import stalewise_main

        launch = self.launch
        mine, theirs = ctx.Pipe()
        client = self.server.client(rank)
        args = (launch.script, launch.argv, client, rank, launch.workers, launch.steps, theirs,
                self.logs)  # fmt: skip
        # from this thread, which outlives them: the parent-death signal fires when it ends
        p = ctx.Process(target=worker_main, args=args, name=f"stalewise-run-{rank}")
        with stalewise_main(self.needs_main):
            p.start()
        theirs.close()
        self.server.release(rank)  # the shards notice if this worker dies
        self.ranks.append(Rank(rank, p, mine))

    def _fail(self, line: str) -> None:
        """Says what went wrong, at once, on a line of stderr; the run will exit 1."""
        self.failed.append(line)
        say(line)

    def running(self) -> list[Rank]:
        return [r for r in self.ranks if not r.ended]

    def _release(self, word: bytes) -> None:
        for r in self.ranks:
            if not r.released and not r.ended:
                r.released = True
                with contextlib.suppress(OSError):
                    r.conn.send_bytes(word)

    def _heard(self, r: Rank, word: bytes) -> None:
        """A rank's word: ``ready``, ``failed LINE`` (its error) or ``refused N`` (pushes)."""
        if word.startswith(b"refused "):
            self.refused += int(word.split()[1])
        elif word.startswith(b"failed "):
            r.why = word[7:].decode(errors="replace")

    def _ended(self, r: Rank) -> None:
        r.proc.join()
        r.ended = r.ready = True
        with contextlib.suppress(EOFError, OSError):
            while r.conn.poll():
                self._heard(r, r.conn.recv_bytes())
        r.conn.close()
        if r.proc.exitcode != 0 and not r.judged and not self.stopping:
            from stalewise.runtime.local.procs import describe_exit

            self._fail(r.why or f"rank {r.rank} failed ({describe_exit(r.proc.exitcode)})")
            self._release(b"alone")  # the others start without it, at once

    def _look(self, now: float) -> None:
        """Reads the ranks' push counters; kills a rank that the liveness rule finds hung."""
        counts = self.server.control[self.server.layout.pushes_done]
        job = self.pushes = int(counts.sum())
        self.progress.tick(now, len(self.running()))
        for r in self.ranks:
            n = int(counts[r.rank])
            if n != r.pushes:
                r.pushes, r.last_push, r.job_then = n, now, job
        limit, rounds = self.launch.rank_timeout, self.server.config.consistency.averages_rounds
        for r in self.running():
            silence = None if r.last_push is None else now - r.last_push
            if r.judged or not silent_rank(silence, job - r.job_then, limit, rounds=rounds):
                continue
            r.judged = True
            r.proc.kill()
            self._fail(
                f"rank {r.rank} hung: no push for {silence:.1f} s while the other ranks "
                f"pushed {job - r.job_then} times (--rank-timeout {limit:g}); killed it"
            )

    def wait(self) -> None:
        """Until every rank has ended, or ``--timeout`` (then ``failed`` names those running)."""
        timeout = self.launch.timeout
        deadline = None if timeout is None else self.started + timeout
        while running := self.running():
            now = time.monotonic()
            self._look(now)
            if self.saves is not None:
                self.saves.tick([r.rank for r in running])
            if deadline is not None and now >= deadline:
                still = "; ".join(f"rank {r.rank} ({r.progress(now)})" for r in running)
                self._fail(f"timed out after {timeout:g} s (--timeout): still running: {still}")
                return
            if all(r.ready for r in self.ranks):
                self._release(b"go")
            waiting = {r.conn: r for r in running if not r.ready}
            ends = {r.proc.sentinel: r for r in running}
            poll = POLL if self.saves is None else self.saves.poll(POLL)
            left = poll if deadline is None else max(0.0, min(poll, deadline - now))
            for obj in connection.wait([*waiting, *ends], left):
                if obj in waiting:
                    r = waiting[obj]
                    with contextlib.suppress(EOFError, OSError):  # else its end will say
                        self._heard(r, r.conn.recv_bytes())
                    r.ready = True
            for r in ends.values():
                if not r.ended and not r.proc.is_alive():
                    self._ended(r)

    def stop(self) -> None:
        """Stops the ranks still running: the stop flag, :data:`STOP_GRACE` s, then a kill."""
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
                r.kill()
                print(f"stalewise run: rank {r.rank} {why}; killed it", file=sys.stderr)


class Gate:
    """A rank's side of the start rendezvous: says ``ready`` on its pipe, waits for ``go``."""

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


def worker_main(
    script: str,
    argv: list[str],
    client: Any,
    rank: int,
    world: int,
    steps: int | None,
    conn: Any,
    logs: str,
) -> None:
    """A worker process (a rank): runs the script once as ``__main__`` with its context set."""
    from stalewise.runtime.local.procs import die_with_parent

    die_with_parent()
    from stalewise.runtime.logs import child_logging

    child_logging(f"rank {rank}")
    for stream in (sys.stdout, sys.stderr):  # line-buffered: two ranks' lines never tear
        if getattr(stream, "write_through", False) and hasattr(stream, "reconfigure"):
            stream.reconfigure(write_through=False, line_buffering=True)
    ctx = context.Context(rank, world, client, steps=steps, _barrier=Gate(conn))
    context.become(ctx)
    os.environ.update(rank_env(rank, world, rank, world))
    try:
        context.run_script(script, argv)
    except BudgetSpent:  # the loop did not ask should_stop(): the launcher says so, once
        _leave_quietly(ctx)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback either
        _leave_quietly(ctx)
        print(f"stalewise run: rank {rank} interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except ServerClosed as e:  # the launcher stopped the job under it
        _leave_quietly(ctx)
        print(f"stalewise run: rank {rank}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Exception as e:  # one line to the launcher, the traceback to the rank's log
        _leave_quietly(ctx)
        with contextlib.suppress(OSError):
            conn.send_bytes(b"failed " + failure(e, script, rank, logs).encode())
        raise SystemExit(1) from None
    except BaseException:  # its exit status tells the rest
        _leave_quietly(ctx)
        raise
    finally:
        if ctx.refused:  # the launcher counts the refused pushes (Ranks._ended)
            with contextlib.suppress(OSError):
                conn.send_bytes(b"refused %d" % ctx.refused)
    if ctx.client is not None:  # the script did not close it
        ctx.close()


def failure(e: BaseException, script: str, rank: int, logs: str) -> str:
    """A rank's error in one line and where in the script; the traceback in ``logs``."""
    frames = traceback.extract_tb(e.__traceback__)
    at = next((f for f in reversed(frames) if f.filename == script), frames[-1] if frames else None)
    where = f" ({Path(at.filename).name}, line {at.lineno})" if at else ""
    path = Path(logs) / f"rank-{rank}.log"
    try:
        path.write_text("".join(traceback.format_exception(e)))
        where += f"; traceback in {path}"
    except OSError:
        traceback.print_exception(e)
    what = (str(e).strip().splitlines() or [""])[0]
    return f"rank {rank} failed: {type(e).__name__}: {what}{where}"


def room(launch: Any) -> int | tuple[int, int]:
    """The worker ids a launch serves: with ``--name``, as many more for ``sw.attach``."""
    return launch.workers if launch.name is None else (launch.workers, 2 * launch.workers)


def rank_env(rank: int, world: int, local_rank: int, local_world: int) -> dict[str, str]:
    """A rank's environment variables before its script runs (torchrun's and stalewise's)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "STALEWISE_RANK": str(rank),
        "STALEWISE_WORLD_SIZE": str(world),
    }


def _leave_quietly(ctx: context.Context) -> None:
    """Closes the rank's context if the script did not, whatever the shards' state."""
    if ctx.client is not None:
        with contextlib.suppress(Exception):
            ctx.close()
