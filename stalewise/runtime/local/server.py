"""The local runtime: shards and workers as OS processes on one machine.

Bytes move through one shared-memory block (see :mod:`stalewise.runtime.local.layout`);
only small control tuples go through pipes.

A pull normally asks no one: the worker copies each shard's latest published
snapshot (seqlocked, so never torn) into its pull buffer. When the worker's
clock is too far ahead for the consistency model by the published clocks, or
when DC-ASGD needs the shard to remember what the worker pulled, the pull is
served: the shard answers when the gate opens, copying its slice itself. The
server's own observer pull (evaluation, ``LocalServer.pull``) is always served,
so it sees every acknowledged push. A push writes the flattened update into
the worker's push buffer, commits its record (see
:mod:`stalewise.runtime.local.layout`) and sends ``("push", seq)`` to every
shard; the buffer is reused only after every shard acknowledged it.

Each incarnation of a worker gets its own pipes, made by
:meth:`LocalServer.client` and handed to the shard processes over their control
pipes (file-descriptor passing), so a shard knows who sent a message from the
pipe it came on. When a worker's pipe closes (it left, or its process died),
the shard delivers a push the worker committed but the shard has not handled,
then drops the worker. The worker's side is
:class:`stalewise.runtime.local.client.Client`; this module holds the shard
processes and :class:`LocalServer`, which starts and stops them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing import connection, reduction
from typing import Any

import numpy as np

from stalewise.protocol import PushHeader, ServerConfig, commit
from stalewise.runtime.local import layout as L
from stalewise.runtime.local.client import Client, ServerClosed, recv_reply
from stalewise.runtime.local.layout import Layout, Snapshots
from stalewise.runtime.local.shm import SharedBlock

log = logging.getLogger(__name__)


_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


@contextlib.contextmanager
def thread_budget(threads: int) -> Iterator[None]:
    """Caps the math-library threads of processes spawned inside the block.

    Several worker processes that each start one thread per core fight over the
    cores (torch on 2 cores with 2 workers ran 10x slower per push). Variables the
    user set are respected; the parent's environment is restored afterwards.
    """
    saved = {k: os.environ.get(k) for k in _THREAD_VARS}
    for k in _THREAD_VARS:
        os.environ.setdefault(k, str(max(1, threads)))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def child_logging(name: str) -> None:
    """Sends a spawned process's stalewise warnings and errors to stderr, named.

    A spawned child starts with no logging set up, and the package's NullHandler
    would swallow what the user must see (a refused push, a worker that never
    started); the parent's stderr is inherited, so that is where they go.
    """
    logger = logging.getLogger("stalewise")
    if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"stalewise {name}: %(levelname)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)


PUBLISH_EVERY = 0.02  # seconds: the longest a busy shard defers publishing a new version


def committed_push(
    layout: Layout, records: np.ndarray, pushes: list, w: int, k: int
) -> tuple[PushHeader, np.ndarray, commit.Verdict] | None:
    """Worker ``w``'s committed push as shard ``k`` reads it from its record, or None."""
    rec = records[w]
    seq_plus_one = int(rec[L.R_COMMIT])
    if not seq_plus_one or int(rec[L.R_SEQ]) != seq_plus_one - 1:
        return None  # nothing committed, or a record caught while being rewritten
    header = PushHeader(w, int(rec[L.R_SEQ]), int(rec[L.R_BASES + k]), int(rec[L.R_INC]))
    return header, pushes[w], commit.Verdict(int(rec[L.R_CODE]), int(rec[L.R_DETAIL]))


def _shard_main(
    config: ServerConfig,
    k: int,
    block_name: str,
    layout: Layout,
    control,
    join_timeout: float,
) -> None:
    """Body of a shard process: serve pulls and pushes until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
    child_logging(f"shard {k}")
    block = SharedBlock.attach(block_name)
    lo, hi = config.ranges[k]
    shard = config.build_shard(k, layout.params(block)[lo:hi], layout.workers)
    pulls = [layout.pull_buffer(block, w)[lo:hi] for w in range(layout.workers)]
    pushes = [layout.push_buffer(block, w)[lo:hi] for w in range(layout.workers)]
    records = layout.records(block)
    observer = layout.observer(block)[lo:hi]
    snapshots = Snapshots(layout, block, config.ranges)
    shard.warm_up()
    snapshots.publish(k, shard.params, shard.version, shard.min_clock())
    published, published_at = shard.version, time.monotonic()
    lease_ends = time.monotonic() + join_timeout

    def publish(busy: bool) -> None:
        """Copies the params out for pulls: when idle, or every PUBLISH_EVERY s under load.

        The clock never gets ahead of the published params (a worker the gate lets
        through must read the params of the round it waited for): alone only while
        the params are unchanged, else together with them, at once when it moved.
        """
        nonlocal published, published_at
        clock = shard.min_clock()
        if shard.version == published:
            snapshots.publish_clock(k, clock)
        elif (
            not busy
            or clock != snapshots.min_clock(k)
            or time.monotonic() - published_at > PUBLISH_EVERY
        ):
            snapshots.publish(k, shard.params, shard.version, clock)
            published, published_at = shard.version, time.monotonic()

    waiting: set[int] = set()  # workers whose pull waits on the gate
    conns: dict[Any, tuple[int, int]] = {}  # a worker incarnation's pipe -> (worker, incarnation)
    current: dict[int, Any] = {}  # worker -> the pipe of its current incarnation

    def depart(c: Any) -> None:
        """The pipe ``c`` is gone: deliver its committed push if this shard lacks it, leave."""
        w, inc = conns.pop(c)
        c.close()
        if current.get(w) is c:
            del current[w]
            waiting.discard(w)
        shard.depart(w, inc, committed_push(layout, records, pushes, w, k))

    def reply(c: Any, msg: tuple) -> None:
        try:
            c.send(msg)
        except OSError:  # the worker is gone: stop waiting for it
            if c in conns:
                depart(c)

    def push(c: Any, msg: tuple) -> None:
        w, inc = conns[c]
        got = committed_push(layout, records, pushes, w, k)
        if len(msg) != 2 or got is None or got[0].seq != msg[1] or got[0].incarnation != inc:
            log.warning(
                "shard %d: worker %d sent a push with no matching record: %r", k, w, msg[:2]
            )
            reply(c, ("error", f"push {msg[1:2]} has no committed record"))
            depart(c)
            return
        header, payload, verdict = got
        reply(c, ("ack", shard.push(header, payload, verdict=verdict)))

    def join(w: int, inc: int) -> None:
        fd = reduction.recv_handle(control)
        c = connection.Connection(fd)
        old = current.get(w)
        if old is not None:
            depart(old)  # the old incarnation's committed push first, then it leaves
        shard.join(w, inc)
        conns[c], current[w] = (w, inc), c
        control.send(("joined", w, inc))

    control.send(("ready", k))
    while True:
        timeout = None if lease_ends is None else max(0.0, lease_ends - time.monotonic())
        for c in connection.wait([control, *conns], timeout=timeout):
            if c is not control and c not in conns:
                continue  # departed while this batch was being handled
            try:
                msg = c.recv()
            except (EOFError, OSError):
                if c is control:
                    return
                depart(c)
                continue
            if c is control:
                kind = msg[0]
                if kind == "join":
                    join(msg[1], msg[2])
                elif kind == "pull":  # the observer: exact, never gated
                    c.send(("pulled", shard.pull(None, observer)))
                elif kind == "stats":
                    c.send(("stats", shard.stats.as_dict() | {"version": shard.version}))
                elif kind == "state":
                    c.send(("state", shard.state_dict()))
                elif kind == "load":  # a checkpoint, before any worker joins (resume)
                    if conns:
                        c.send(("loaded", None, "workers have joined; load before they do"))
                        continue
                    try:
                        shard.load_state_dict(msg[1])
                    except ValueError as e:
                        c.send(("loaded", None, str(e)))
                        continue
                    snapshots.publish(k, shard.params, shard.version, shard.min_clock())
                    published, published_at = shard.version, time.monotonic()
                    c.send(("loaded", shard.version, None))
                elif kind == "stop":
                    c.send(("stopped", shard.stats.as_dict() | {"version": shard.version}))
                    return
                continue
            kind = msg[0] if isinstance(msg, tuple) and msg else None
            w = conns[c][0]
            if kind == "push":
                push(c, msg)
            elif kind == "pull":
                waiting.add(w)
            elif kind == "leave":
                depart(c)
            else:
                log.warning("shard %d: worker %d sent an unknown message; disconnecting it", k, w)
                depart(c)
        if lease_ends is not None and time.monotonic() >= lease_ends:
            lease_ends = None
            gone = shard.expire_unstarted()
            if gone:
                log.error(
                    "shard %d: worker(s) %s did not start within %g s (join_timeout); "
                    "the gates no longer wait for them",
                    k,
                    ", ".join(map(str, gone)),
                    join_timeout,
                )
        # After the acks: a pusher's next pull waits for the version its ack named
        # (read-your-writes), and pushes queued behind this batch go first.
        publish(busy=any(c.poll() for c in conns))
        for w in sorted(waiting):
            if shard.live[w] and shard.may_start(w):
                waiting.discard(w)
                reply(current[w], ("pulled", shard.pull(w, pulls[w])))


class LocalServer:
    """The shards of a job, running as local processes; a context manager.

    Example:
        >>> with LocalServer(config, workers=2) as server:   # doctest: +SKIP
        ...     client = server.client(0)
        ...     params = client.pull()
        ...     client.push(grads)
    """

    def __init__(
        self,
        config: ServerConfig,
        workers: int,
        *,
        start_timeout: float = 120.0,
        join_timeout: float = 300.0,
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.config = config
        self.workers = workers
        self.start_timeout = start_timeout
        self.layout = Layout(config.spec.size, str(config.init.dtype), workers, config.shards)
        self._ctx = mp.get_context("spawn")
        self._block = SharedBlock.create(self.layout.nbytes)
        self._procs: list = []
        self._controls: list = []
        self._incarnations = [0] * workers  # the newest incarnation of each worker id
        self._worker_ends: list[list] = [[] for _ in range(workers)]  # until release(w)
        self._snapshots: Snapshots | None = None  # the parent's view, for published_version
        try:
            self.layout.params(self._block)[:] = config.init
            self.control = self.layout.control(self._block)
            self.control[1 + workers :] = np.nan  # last loss per worker: none yet
            for k in range(config.shards):
                mine, theirs = self._ctx.Pipe()
                p = self._ctx.Process(
                    target=_shard_main,
                    args=(config, k, self._block.name, self.layout, theirs, join_timeout),
                    name=f"stalewise-shard-{k}",
                    daemon=True,
                )
                with thread_budget(1):
                    p.start()
                self._procs.append(p)
                self._controls.append(mine)
                theirs.close()
            for k, c in enumerate(self._controls):
                if recv_reply(c, start_timeout, f"start of shard {k}") != ("ready", k):
                    raise RuntimeError(f"shard {k} failed to start")
            self.observer = Client(
                None, self._block.name, self.layout, config, self._controls, self._block
            )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def client(self, worker: int) -> Client:
        """A client for a new incarnation of ``worker`` (0 <= worker < workers).

        The first call for an id starts that worker; a later call restarts it: the
        shards first finish the old incarnation (a push it committed is delivered
        everywhere) and drop it, then the new one starts from the current
        parameters with fresh sequence numbers, and the old one's pipes are cut.
        Restart a worker only once its old process has exited or been killed: both
        would write the same shared push buffer.
        """
        if not (isinstance(worker, int) and 0 <= worker < self.workers):
            raise ValueError(
                f"unknown worker {worker!r}: this server has workers 0..{self.workers - 1}"
            )
        self.release(worker)
        self._incarnations[worker] += 1
        inc = self._incarnations[worker]
        ends = []
        for k, control in enumerate(self._controls):
            mine, theirs = self._ctx.Pipe()
            control.send(("join", worker, inc))
            reduction.send_handle(control, theirs.fileno(), self._procs[k].pid)
            theirs.close()  # shard k holds its own copy now
            ends.append(mine)
        for k in range(len(self._controls)):
            reply = self.observer._take(k, "joined", self.start_timeout)
            assert reply[1:] == (worker, inc), reply
        self._worker_ends[worker] = ends
        return Client(worker, self._block.name, self.layout, self.config, ends, incarnation=inc)

    def release(self, worker: int) -> None:
        """Closes this process's copies of ``worker``'s pipes once its process holds them.

        Call it after starting the worker's process: then, if that process dies,
        the shards see its pipes close and stop waiting for it (gates, BSP rounds).
        """
        for c in self._worker_ends[worker]:
            c.close()
        self._worker_ends[worker] = []

    def pull(self, *, copy: bool = True, into: Any = None, timeout: float | None = 60.0) -> Any:
        """The current parameters (as an observer: never gated, not counted as a worker)."""
        return self.observer.pull(copy=copy, into=into, timeout=timeout)

    def stats(self, timeout: float | None = 60.0) -> list[dict]:
        """Each shard's counters (applied, rejected, staleness, bytes, version)."""
        for c in self._controls:
            c.send(("stats",))
        return [self.observer._take(k, "stats", timeout)[1] for k in range(len(self._controls))]

    def state_dicts(self, timeout: float | None = 60.0) -> list[dict]:
        """Each shard's whole state (:meth:`Shard.state_dict`), between two messages it handles."""
        for c in self._controls:
            c.send(("state",))
        return [self.observer._take(k, "state", timeout)[1] for k in range(len(self._controls))]

    def load_state_dicts(self, states: list[dict], timeout: float | None = 60.0) -> list[int]:
        """Loads one :meth:`Shard.state_dict` into each shard (a checkpoint); returns the versions.

        Call it before any worker joins. Every shard checks its state before
        changing anything (:meth:`Shard.load_state_dict`); a refusal raises
        ValueError naming the shard and the key. The loaded incarnation numbers
        are remembered, so :meth:`client` starts new incarnations above them.
        The loaded workers that were live count for the gates until their new
        incarnations join (which first makes the old ones leave).
        """
        if len(states) != len(self._controls):
            raise ValueError(f"{len(states)} shard states for {len(self._controls)} shards")
        for c, state in zip(self._controls, states, strict=True):
            c.send(("load", state))
        replies = [self.observer._take(k, "loaded", timeout) for k in range(len(self._controls))]
        errors = [f"shard {k}: {msg[2]}" for k, msg in enumerate(replies) if msg[2] is not None]
        if errors:
            raise ValueError("; ".join(errors))
        for state in states:
            for w, inc in enumerate(np.asarray(state["incarnation"]).tolist()[: self.workers]):
                self._incarnations[w] = max(self._incarnations[w], int(inc))
        return [int(msg[1]) for msg in replies]

    def published_version(self, k: int = 0) -> int:
        """Shard ``k``'s version as last published for pulls (shared memory: asks no one)."""
        if self._snapshots is None:
            self._snapshots = Snapshots(self.layout, self._block, self.config.ranges)
        return self._snapshots.version(k)

    def unlink(self) -> None:
        """Removes the shared-memory name early (every process has mapped it already)."""
        self._block.unlink()

    def close(self, timeout: float = 10.0) -> list[dict]:
        """Stops the shards and frees the shared memory; returns the shards' final stats."""
        if self._block is None:
            return []
        final: list[dict] = []
        for k, c in enumerate(self._controls):
            try:
                c.send(("stop",))
                if hasattr(self, "observer"):
                    final.append(self.observer._take(k, "stopped", timeout)[1])
            except (OSError, ServerClosed, TimeoutError):
                pass
        for p in self._procs:
            p.join(timeout)
            if p.is_alive():
                log.warning("shard process %s did not stop; killing it", p.pid)
                p.kill()
                p.join()
        self._procs = []
        self.final_params = np.array(self.layout.params(self._block))  # copy out before unmapping
        self._block.unlink()
        self.control = None  # type: ignore[assignment]
        self._snapshots = None
        self._block.close()
        self._block = None  # type: ignore[assignment]
        return final
