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
the worker's push buffer and sends ``("push", seq, base_version)`` to every
shard; the buffer is reused only after every shard acknowledged it. The
worker's side is :class:`stalewise.runtime.local.client.Client`; this module holds the
shard processes and :class:`LocalServer`, which starts and stops them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing import connection
from typing import Any

import numpy as np

from stalewise.protocol import ServerConfig
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


PUBLISH_EVERY = 0.02  # seconds: the longest a busy shard defers publishing a new version


def _shard_main(
    config: ServerConfig, k: int, block_name: str, layout: Layout, conns: list, control
) -> None:
    """Body of a shard process: serve pulls and pushes until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
    block = SharedBlock.attach(block_name)
    lo, hi = config.ranges[k]
    shard = config.build_shard(k, layout.params(block)[lo:hi], layout.workers)
    pulls = [layout.pull_buffer(block, w)[lo:hi] for w in range(layout.workers)]
    pushes = [layout.push_buffer(block, w)[lo:hi] for w in range(layout.workers)]
    observer = layout.observer(block)[lo:hi]
    snapshots = Snapshots(layout, block, config.ranges)
    shard.warm_up()
    snapshots.publish(k, shard.params, shard.version, shard.min_clock())
    published, published_at = shard.version, time.monotonic()

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

    def reply(w: int, msg: tuple) -> None:
        try:
            conns[w].send(msg)
        except OSError:  # the worker is gone: stop waiting for it
            open_conns.pop(conns[w], None)
            waiting.discard(w)
            if shard.live[w]:
                shard.leave(w)

    control.send(("ready", k))
    waiting: set[int] = set()  # workers whose pull waits on the gate
    open_conns = {c: w for w, c in enumerate(conns)}
    open_conns[control] = None
    while True:
        for c in connection.wait(list(open_conns)):
            w = open_conns[c]
            try:
                msg = c.recv()
            except (EOFError, OSError):
                del open_conns[c]
                if w is None:
                    return
                waiting.discard(w)
                if shard.live[w]:
                    shard.leave(w)
                continue
            kind = msg[0]
            if kind == "pull" and w is not None:
                waiting.add(w)
            elif kind == "push":
                reply(w, ("ack", shard.push(msg[1], pushes[w], refused=msg[2])))
            elif kind == "leave":
                waiting.discard(w)
                shard.leave(w)
            elif kind == "pull":  # the observer: exact, never gated
                c.send(("pulled", shard.pull(None, observer)))
            elif kind == "stats":
                c.send(("stats", shard.stats.as_dict() | {"version": shard.version}))
            elif kind == "stop":
                c.send(("stopped", shard.stats.as_dict() | {"version": shard.version}))
                return
        # After the acks: a pusher's next pull waits for the version its ack named
        # (read-your-writes), and pushes queued behind this batch go first.
        publish(busy=any(c.poll() for c in open_conns))
        for w in sorted(waiting):
            if shard.live[w] and shard.may_start(w):
                waiting.discard(w)
                reply(w, ("pulled", shard.pull(w, pulls[w])))


class LocalServer:
    """The shards of a job, running as local processes; a context manager.

    Example:
        >>> with LocalServer(config, workers=2) as server:   # doctest: +SKIP
        ...     client = server.client(0)
        ...     params = client.pull()
        ...     client.push(grads)
    """

    def __init__(self, config: ServerConfig, workers: int, *, start_timeout: float = 120.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.config = config
        self.workers = workers
        self.layout = Layout(config.spec.size, str(config.init.dtype), workers, config.shards)
        self._ctx = mp.get_context("spawn")
        self._block = SharedBlock.create(self.layout.nbytes)
        self._procs: list = []
        self._clients_made: set[int] = set()
        try:
            self.layout.params(self._block)[:] = config.init
            self.control = self.layout.control(self._block)
            S = config.shards
            # pipes[w][k]: worker w <-> shard k
            pipes = [[self._ctx.Pipe() for _ in range(S)] for _ in range(workers)]
            self._worker_ends = [[p[0] for p in row] for row in pipes]
            self._controls = []
            for k in range(S):
                mine, theirs = self._ctx.Pipe()
                shard_conns = [pipes[w][k][1] for w in range(workers)]
                p = self._ctx.Process(
                    target=_shard_main,
                    args=(config, k, self._block.name, self.layout, shard_conns, theirs),
                    name=f"stalewise-shard-{k}",
                    daemon=True,
                )
                with thread_budget(1):
                    p.start()
                self._procs.append(p)
                self._controls.append(mine)
                theirs.close()
            for c in (end for row in pipes for p in row for end in (p[1],)):
                c.close()  # the shard processes own their ends now
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
        """The client for ``worker`` (0 <= worker < workers); one per worker id."""
        if not (isinstance(worker, int) and 0 <= worker < self.workers):
            raise ValueError(
                f"unknown worker {worker!r}: this server has workers 0..{self.workers - 1}"
            )
        if worker in self._clients_made:
            raise ValueError(f"a client for worker {worker} was already made")
        self._clients_made.add(worker)
        return Client(worker, self._block.name, self.layout, self.config, self._worker_ends[worker])

    def release(self, worker: int) -> None:
        """Closes this process's copies of ``worker``'s pipes once its process holds them.

        Call it after starting the worker's process: then, if that process dies,
        the shards see its pipes close and stop waiting for it (gates, BSP rounds).
        """
        for c in self._worker_ends[worker]:
            c.close()

    def pull(self, *, copy: bool = True, into: Any = None, timeout: float | None = 60.0) -> Any:
        """The current parameters (as an observer: never gated, not counted as a worker)."""
        return self.observer.pull(copy=copy, into=into, timeout=timeout)

    def stats(self, timeout: float | None = 60.0) -> list[dict]:
        """Each shard's counters (applied, rejected, staleness, bytes, version)."""
        for c in self._controls:
            c.send(("stats",))
        return [self.observer._take(k, "stats", timeout)[1] for k in range(len(self._controls))]

    def unlink(self) -> None:
        """Removes the shared-memory name early (every process has mapped it already)."""
        self._block.unlink()

    def close(self, timeout: float = 10.0) -> list[dict]:
        """Stops the shards and frees the shared memory; returns the shards' final stats."""
        if self._block is None:
            return []
        final: list[dict] = []
        for k, c in enumerate(getattr(self, "_controls", [])):
            try:
                c.send(("stop",))
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
        self._block.close()
        self._block = None  # type: ignore[assignment]
        return final
