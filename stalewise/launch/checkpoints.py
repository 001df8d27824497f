"""Checkpoints of a loop you own (``stalewise run``, ``sw.init``, ``job.serve``): one :class:`Saves`
where the shards are served, ticked by the launcher (:class:`RankStates`), the one unlaunched
worker (:class:`InProcess`) or a thread of the serving process (:class:`Served`)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from stalewise import runtime as runtime_lib
from stalewise.checkpoint import CheckpointError
from stalewise.launch.context import LaunchError
from stalewise.protocol import budget
from stalewise.protocol.messages import DUPLICATE, PushResult

log = logging.getLogger(__name__)

CUT = "cut"  # the file of the epoch of the launcher's last read of the shards
TICKS = "ticks"  # a rank's file once its loop calls ctx.should_stop() (``ticks-<rank>``)
RANKS_ENV = "STALEWISE_CHECKPOINT_RANKS"  # a rank's folder for its ctx.state (launched)
EVERY_ENV = "STALEWISE_CHECKPOINT_EVERY"
#: Seconds a due checkpoint waits for the ranks' ``ctx.state`` (a late one's previous is saved).
RANK_STATE_WAIT = 10.0
CUT_POLL = 0.002  #: Seconds between a paused rank's looks at the cut, and the launcher's when due.
SERVED_POLL = 0.25  #: Seconds between a served job's looks at its pushes (``checkpoint_every``).


def check(directory: Any, every: Any, error: type[Exception]) -> None:
    """Refuses checkpoint settings that do not fit together; makes ``directory`` if missing."""
    from stalewise.checkpoint.store import untrusted

    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise error(f"checkpoint_every (--checkpoint-every) must be an integer >= 1, got {every!r}")
    if every is not None and directory is None:
        raise error("checkpoint_every (--checkpoint-every) needs checkpoint_dir (--checkpoint-dir)")
    if directory is None:
        return
    try:
        with contextlib.suppress(FileExistsError):  # a file there: untrusted says so
            Path(directory).mkdir(0o755, parents=True, exist_ok=True)
        problem = untrusted(os.stat(directory))
    except OSError as e:
        problem = f"cannot make it: {e.strerror or e}"
    if problem:
        raise error(f"checkpoint_dir (--checkpoint-dir) {os.fspath(directory)}: {problem}")


class Saves:
    """The side holding the server: restores the job (``resume``) before any worker joins; saves
    it with each rank's ``ctx.state`` before any push, every ``every`` pushes and at the end."""

    def __init__(self, job: Any, server: Any, directory: str, every: int | None,
                 resume: bool, *, folder: Path | None = None):  # fmt: skip
        from types import SimpleNamespace

        from stalewise import checkpoint
        from stalewise.checkpoint import replay

        self.server, self.every, self.folder, self.directory = server, every, folder, directory
        workers = server.workers
        o = SimpleNamespace(checkpoint_dir=directory, checkpoint_every=every, resume=resume,
                            checkpoint_seconds=None, checkpoint_keep=2, room=workers,
                            run=None)  # fmt: skip
        try:
            ckpt = start = checkpoint.resume_point(job.config, o, runtime="local")
            if ckpt is not None:  # and the pushes of its logs
                server.resume(ckpt := replay.logged(start, job.config))
            # per worker: its state, the pushes it accounts for, those held past it (skipped)
            self.ranks: list[dict] = getattr(ckpt, "ranks", None) or [{} for _ in range(workers)]
            held = [0] * workers if ckpt is None else ckpt.step.get("pushed") or [None] * workers
            before = _counts(start, "pushed", workers) or held  # the checkpoint's own
            self.pushed: list[int | None] = list(_counts(start, "ranks_pushed", workers) or before)
            for r in range(workers) if ckpt is not start and (folder or any(self.ranks)) else ():
                self.ranks[r], self.pushed[r] = _choose(folder, r, held[r], self.ranks[r],
                                                        self.pushed[r], before[r])  # fmt: skip
            self.skips = [0 if h is None else h - n for h, n in zip(held, self.pushed, strict=True)]
        except (checkpoint.CheckpointError, ValueError) as e:
            raise LaunchError(f"--resume from {directory}: {' '.join(str(e).split())}") from None
        pushes = 0 if ckpt is None else int(ckpt.step.get("pushes", 0))
        self.saver = checkpoint.Saver(job.config, None, o, runtime="local", pushes=pushes)
        self.started = time.monotonic()
        self.due: tuple[int, float] | None = None  # (the epoch due, since when)
        self.unticked: set[int] = set()  # ranks named as never calling ctx.should_stop()
        if ckpt is not None:  # and its push logs: more pushes than the folder's name says
            print(f"stalewise: resumed from {ckpt.path} (version {ckpt.states[0]['version']}, "
                  f"{pushes} pushes)", file=sys.stderr, flush=True)  # fmt: skip
        for r, state in enumerate(self.ranks if folder is not None else ()):  # rank's start
            write_rank_state(folder, r, state, pushes, self.pushed[r], self.skips[r], only=True)
        self.save()  # before any push: the logs from here on are named by a checkpoint

    def poll(self, idle: float) -> float:
        """Seconds to the launcher's next :meth:`tick` (ranks wait at the cut meanwhile)."""
        return idle if self.every is None else CUT_POLL if self.due else 5 * CUT_POLL

    def tick(self, running: list[int]) -> None:
        """A checkpoint once due and the ``running`` ranks wait at the cut (or after the wait)."""
        if self.every is None:
            return
        if self.due is None:
            if self.saver.due(pushes := self.server.job_pushes, 0.0):
                self.due = (pushes // self.every, time.monotonic())
            return
        want, since = self.due
        folder = self.folder
        ticking = [r for r in running if folder is None or (folder / f"{TICKS}-{r}").exists()]
        for r in set(running) - set(ticking) - self.unticked:
            self.unticked.add(r)
            log.warning("checkpoint: rank %d has not called ctx.should_stop(): checkpoints do not "
                        "wait for it and hold the ctx.state it started with", r)  # fmt: skip
        ready = all(rank_epoch(self.folder, r, self.every) >= want for r in ticking)
        if ready or time.monotonic() - since >= RANK_STATE_WAIT:
            self.save()

    def save(self, *, final: bool = False) -> None:
        """Writes a checkpoint (``final``: the run's last) of the server and the ranks' states,
        and warns of a rank whose state is not of the shards' cut (:func:`.budget.off_cut`)."""
        self.due = None
        try:
            states, step, residuals = self.server.checkpoint_parts(log_dir=self.directory)
        except Exception as e:  # a shard died: the last checkpoint stays the one to resume
            log.warning("checkpoint: cannot read the shards' state: %s", e)
            return
        finally:
            if self.folder is not None:  # the ranks' states are read before they go on
                self._read_ranks()
                tmp = self.folder / f".tmp-{CUT}"  # the ranks go on: the cut is read
                tmp.write_text(str(self.server.job_pushes // (self.every or 1)))
                os.chmod(tmp, 0o644)  # as a rank's file: read back only if no one else can write
                os.replace(tmp, self.folder / CUT)
        held, counts = step["pushed"], []  # each rank's state's pushes (ranks_pushed)
        for r, (state, n, skip) in enumerate(zip(self.ranks, self.pushed, self.skips, strict=True)):
            known = bool(state) and n is not None  # else none to repeat or skip
            if why := budget.off_cut(states, r, held[r], n + skip if known else None):
                log.warning("checkpoint: %s", why)
            counts.append(n if known else held[r])
        step |= {"time": time.monotonic() - self.started, "ranks_pushed": counts}
        self.saver.save(states, step, residuals, final=final, ranks=self.ranks)

    def _read_ranks(self) -> None:
        for r in range(len(self.ranks)):
            try:
                got = read_rank_state(self.folder, r)
            except CheckpointError as e:  # its last state read stays the one saved
                log.warning("checkpoint: rank %d's state is not read: %s", r, e)
                continue
            if got is not None:
                self.ranks[r], self.pushed[r], self.skips[r] = got


def _counts(ckpt: Any, key: str, workers: int) -> list[int] | None:
    """``ckpt``'s ``step[key]``: a count per worker (None: no ``ckpt`` or no such key)."""
    counts = None if ckpt is None else ckpt.step.get(key)
    ok = counts is None or (isinstance(counts, list) and len(counts) == workers
                            and all(type(n) is int and n >= 0 for n in counts))  # fmt: skip
    if not ok:
        raise CheckpointError(f"{ckpt.path}: step.{key} is {counts!r}, not a count per worker")
    return counts


def _choose(folder: Path, rank: int, held: int, saved: dict, count: int, before: int
            ) -> tuple[dict, int]:  # fmt: skip
    """Rank ``rank``'s state to resume from when the shards hold ``held`` of its pushes, and
    the count of them it accounts for: its saved state of the most up to ``held``, else the
    checkpoint's (``saved``, of ``count`` when the shards held ``before``)."""
    gens, errors = _headers(folder, rank)
    below = sorted((g for g in gens if 0 <= g[0] <= held), reverse=True)
    for *_, slot in below:
        try:
            state, n, skip = read_rank_state(folder, rank, slot)
            break
        except CheckpointError as e:
            errors.append(e)
    else:
        state, n, skip = saved, count, before - count
    for e in errors:
        log.warning("resume: rank %d's state is not read: %s", rank, e)
    if n + skip != held:
        log.warning("resume: rank %d's ctx.state is after %d of its pushes (saved: %s), the "
                    "shards hold %d: it skips its next %d", rank, n,
                    sorted(g[0] for g in gens), held, held - n)  # fmt: skip
    return state, n


class InProcess:
    """A context's side of the checkpoints when ``sw.init`` serves the job in its own process:
    ``ctx.state`` from the checkpoint, saved from ``should_stop()`` and at ``close()``."""

    def __init__(self, saves: Saves, ctx: Any):
        self.saves, self.skip = saves, saves.skips[0]
        ctx.state, ctx._ckpt = saves.ranks[0], self
        _skipping(self, ctx.client)

    def tick(self, ctx: Any) -> None:
        if self.saves.every is not None and self.saves.saver.due(ctx.client.job_pushes, 0.0):
            self.close(ctx, final=False)

    def close(self, ctx: Any, final: bool = True) -> None:
        ctx.client.wait()  # its pushes acknowledged: in the shards' state
        saves, skip = self.saves, self.skip
        saves.ranks[0], saves.pushed[0], saves.skips[0] = ctx.state, ctx.client.pushed - skip, skip
        saves.save(final=final)


class Served:
    """``job.serve(..., checkpoint_dir=...)``: the server, restored and saved by :class:`Saves`."""

    def __init__(self, job: Any, server: Any, directory: str, every: int | None, resume: bool):
        self._server = server
        self._saves = Saves(job, server, directory, every, resume)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stalewise-saves", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(SERVED_POLL):
            try:
                self._saves.tick([])
            except Exception as e:  # the server is closing under it, or a shard died
                log.warning("checkpoint: %s", e)

    def close(self, *args: Any, **kwargs: Any) -> Any:
        """The last checkpoint, then the server's ``close``. Calling it again closes only."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._saves.save(final=True)
        return self._server.close(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def served(job: Any, start: Any, runtime: str, directory: Any, every: Any, resume: Any) -> Any:
    """``job.serve``'s server with checkpoints in ``directory`` (:class:`Served`), or as it is
    without one; closed if its checkpoints cannot start (:class:`LaunchError`)."""
    if directory is not None and not runtime_lib.describe(runtime).saves_served:
        able = runtime_lib.able("saves_served")
        raise ValueError(f"job.serve: checkpoint_dir is for runtime={able!r}, not {runtime!r}")
    server = start()
    if directory is None:
        return server
    try:
        return Served(job, server, os.fspath(directory), every, bool(resume))
    except BaseException:
        server.close()
        raise


class RankStates:
    """A launched rank's side: ``ctx.state`` read at ``sw.init``, written at ``should_stop()`` and
    ``close()``; pushes the shards hold past it are skipped (a ``"duplicate"`` result, seq -1)."""

    def __init__(self, folder: Path, every: int | None, rank: int):
        self.folder, self.every = folder, every
        self.epoch = rank_epoch(folder, rank, every) if every else -1  # the launcher's start
        self.ticks = False  # its loop has called ctx.should_stop()
        self.skip = 0  # its next pushes that the shards hold already

    @classmethod
    def join(cls, ctx: Any) -> None:
        folder = os.environ.get(RANKS_ENV)
        if not folder:
            return
        every = os.environ.get(EVERY_ENV)
        ctx._ckpt = self = cls(Path(folder), int(every) if every else None, ctx.rank)
        ctx.state, _, self.skip = read_rank_state(Path(folder), ctx.rank) or ({}, None, 0)
        _skipping(self, ctx.client)

    def tick(self, ctx: Any) -> None:
        if not self.ticks:  # the launcher waits at the cut only for ranks that tick
            self.ticks = True
            (self.folder / f"{TICKS}-{ctx.rank}").touch(0o644)
        every, pushes = self.every, ctx.client.job_pushes
        if every is None or not budget.checkpoint_due(pushes, self.epoch * every, every):
            self._write(ctx, pushes)  # of this epoch still: the launcher waits on
            return
        self.epoch = self.close(ctx) // self.every
        deadline = time.monotonic() + RANK_STATE_WAIT + 1.0
        while self.epoch > _cut(self.folder) and time.monotonic() < deadline:
            if ctx.client.stopping:
                break
            time.sleep(CUT_POLL)

    def close(self, ctx: Any) -> int:
        ctx.client.wait()  # its pushes acknowledged: in the shards' state
        pushes = ctx.client.job_pushes
        self._write(ctx, pushes)
        return pushes

    def _write(self, ctx: Any, pushes: int) -> None:
        skip = self.skip
        write_rank_state(self.folder, ctx.rank, ctx.state, pushes, ctx.client.pushed - skip, skip)


def _skipping(side: Any, client: Any) -> None:
    """``client``'s next ``side.skip`` pushes skipped (see :class:`RankStates`)."""
    if not side.skip:
        return
    sent = client.push_flat_sent

    def push_flat_sent() -> None:  # what client.push sends through
        if side.skip > 0:
            side.skip -= 1
            client.last_result = PushResult(-1, DUPLICATE, None, None, tuple(client._sender.known),
                                            None)  # fmt: skip
            return
        del client.push_flat_sent
        sent()

    client.push_flat_sent = push_flat_sent


def _rank_file(folder: Path, rank: int, slot: int) -> Path:
    return folder / f"rank-{rank}-{slot}.safetensors"


def _cut(folder: Path) -> int:
    """The epoch of the launcher's last read of the shards (-1: none yet)."""
    from stalewise.checkpoint import store as checkpoint

    try:
        return int(checkpoint._read_file(folder, CUT, 64))
    except (CheckpointError, ValueError):
        return -1


def write_rank_state(folder: Path, rank: int, state: Any, pushes: int, pushed: int | None = None,
                     skip: int = 0, *, only: bool = False) -> None:  # fmt: skip
    """Rank ``rank``'s state, atomically as data, into its file of ``pushed`` (the pushes it counts
    for; ``skip``: the shards hold more); the other keeps the previous (``only``: removed)."""
    from safetensors.numpy import save_file

    from stalewise.checkpoint import store as checkpoint

    arrays, values = checkpoint.flat_state(state, f"rank {rank}: ctx.state")
    slot = (pushed or 0) % 2
    path = _rank_file(folder, rank, slot)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    meta = {"values": json.dumps(values, allow_nan=True), "pushes": str(int(pushes))}
    if pushed is not None:
        meta |= {"pushed": str(int(pushed)), "skip": str(int(skip))}
    save_file({k: checkpoint._contiguous(a) for k, a in arrays.items()}, str(tmp), metadata=meta)
    os.chmod(tmp, 0o644)  # whatever the umask: the launcher refuses what others can write
    os.replace(tmp, path)
    if only:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_rank_file(folder, rank, 1 - slot))


MAX_RANK_STATE = 1 << 36  # bytes of one rank's ctx.state file read back (64 GiB)
_MAX_HEADER = 100 << 20  # a safetensors header's bytes, as safetensors itself bounds it


def _metadata(f: Any) -> dict:
    n = int.from_bytes(f.read(8), "little")
    if n > _MAX_HEADER:
        raise ValueError(f"a header of {n} bytes, more than {_MAX_HEADER}")
    return json.loads(f.read(n)).get("__metadata__", {})


def read_rank_state(folder: Path, rank: int, slot: int | None = None
                    ) -> tuple[dict, int | None, int] | None:  # fmt: skip
    """Rank ``rank``'s saved state (of file ``slot``; None: of the most pushes), the count of
    its pushes it accounts for (None: unknown) and how many more the shards hold; or None."""
    from safetensors.numpy import load

    from stalewise.checkpoint import store as checkpoint

    if slot is None:
        gens, errors = _headers(folder, rank)
        if errors and not gens:
            raise errors[0]
        if not gens:
            return None
        slot = max(gens)[-1]
    path = _rank_file(folder, rank, slot)
    if not os.path.lexists(path):
        return None
    # read as every checkpoint file is: no symlink followed, no FIFO waited on, bounded
    data = checkpoint._read_file(folder, path.name, MAX_RANK_STATE, "MAX_RANK_STATE")
    try:
        meta = _metadata(io.BytesIO(data))
        values, arrays = json.loads(meta["values"]), load(data)
        pushed = int(meta["pushed"]) if "pushed" in meta else None
        skip = int(meta.get("skip", 0))
    except Exception as e:  # whatever the bytes are: one line naming the file
        raise CheckpointError(f"{path}: not a rank's state file ({e})") from None
    return checkpoint._nested({**values, **arrays}), pushed, skip


def _headers(folder: Path | None, rank: int) -> tuple[list[tuple[int, int, int, int]], list]:
    """The ``(pushed (-1: unknown), skip, pushes, slot)`` of each of rank ``rank``'s state
    files, from their headers, and the :class:`CheckpointError` of each that does not read."""
    from stalewise.checkpoint import store as checkpoint

    gens, errors = [], []
    for slot in (0, 1) if folder is not None else ():
        path = _rank_file(folder, rank, slot)
        if not os.path.lexists(path):
            continue
        try:  # opened as every checkpoint file is: no symlink followed, no FIFO waited on
            fd, _ = checkpoint.open_file(folder, path.name)
            with os.fdopen(fd, "rb") as f:
                meta = _metadata(f)
            gens.append((int(meta.get("pushed", -1)), int(meta.get("skip", 0)),
                         int(meta["pushes"]), slot))  # fmt: skip
        except Exception as e:  # whatever the bytes are: one line naming the file
            bad = CheckpointError(f"{path}: not a rank's state file ({e})")
            errors.append(e if isinstance(e, CheckpointError) else bad)
    return gens, errors


def rank_epoch(folder: Path | None, rank: int, every: int) -> int:
    """The epoch (job pushes // every) of rank ``rank``'s last saved state (-1: none)."""
    return max((pushes // every for _, _, pushes, _ in _headers(folder, rank)[0]), default=-1)


@contextlib.contextmanager
def rank_files(directory: str | None, every: int | None, resume: bool = False):
    """The folder the ranks exchange their ``ctx.state`` through (None without a ``directory``)."""
    if directory is None:
        yield None
        return
    import shutil

    from stalewise.checkpoint.store import untrusted

    folder = Path(directory) / ".ranks"  # 0700, in a folder of ours (check)
    with contextlib.suppress(FileNotFoundError):
        if problem := untrusted(os.lstat(folder)):
            raise LaunchError(f"{folder} is {problem}, which stalewise never makes: remove it")
        for path in folder.iterdir() if resume else ():  # Saves reads the states, then writes
            if not path.name.startswith("rank-"):  # ours (0700): a folder is removed too
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        if not resume:
            shutil.rmtree(folder)
    folder.mkdir(0o700, exist_ok=resume)
    saved = {k: os.environ.get(k) for k in (RANKS_ENV, EVERY_ENV)}
    os.environ[RANKS_ENV] = str(folder)
    os.environ[EVERY_ENV] = str(every or "")
    try:
        yield folder
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
