"""The local runtime: shards and workers as OS processes on one machine.

Bytes move through one shared-memory block (see :mod:`stalewise.runtime.layout`);
only small control tuples go through pipes.

A pull normally asks no one: the worker copies each shard's latest published
snapshot (seqlocked, so never torn) into its pull buffer. When the worker's
clock is too far ahead for the consistency model by the published clocks, or
when DC-ASGD needs the shard to remember what the worker pulled, the pull is
served: the shard answers when the gate opens, copying its slice itself. The
server's own observer pull (evaluation, ``LocalServer.pull``) is always served,
so it sees every acknowledged push. A push writes the flattened update into the worker's push buffer and sends
``("push", seq, base_version)`` to every shard; the buffer is reused only
after every shard acknowledged it.

Threading contract: a :class:`Client` belongs to one thread of one process.
Every blocking call takes a ``timeout`` in seconds (None waits forever).
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing import connection
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.runtime.layout import Layout, Snapshots
from stalewise.runtime.shm import SharedBlock
from stalewise.server import Ack, PushHeader, ServerConfig

log = logging.getLogger(__name__)


class PushRejected(RuntimeError):
    """A shard refused a push; the message says which shard and why."""


class ServerClosed(ConnectionError):
    """The shards have stopped (the job ended or a shard process died)."""


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


def _recv(conn: connection.Connection, timeout: float | None, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer to {what} within {timeout} s")
    try:
        return conn.recv()
    except (EOFError, OSError):
        raise ServerClosed(f"shard closed the connection while waiting for {what}") from None


class Client:
    """A worker's handle on the shards: ``pull()`` params, ``push()`` updates.

    Made by :meth:`LocalServer.client`; picklable until first used, so it can be
    handed to a ``multiprocessing`` process (spawn or fork).
    """

    def __init__(
        self,
        worker: int | None,
        block_name: str,
        layout: Layout,
        config: ServerConfig,
        conns: list,
        block: SharedBlock | None = None,
    ):
        self.worker = worker
        self._block_name = block_name
        self._layout = layout
        self._spec = config.spec
        self._ranges = config.ranges
        self._consistency = config.consistency
        self._direct = not config.staleness.dc_lambda  # DC-ASGD needs served pulls
        self._conns = conns
        self._block: SharedBlock | None = None
        self._snapshots: Snapshots | None = None  # set on attach (workers only)
        if worker is None:  # the server's own observer shares its mapping
            assert block is not None
            self._block = block
            self._pull_buf = layout.observer(block)
        self._seq = 0
        self._base = [0] * len(conns)
        self._acks_due = [False] * len(conns)  # shard k still owes an ack for the last push
        self._pulls_due = [False] * len(conns)  # shard k still owes a served pull (after a timeout)
        self._acks: list[Any] = [None] * len(conns)
        self._inbox: list[list] = [[] for _ in conns]  # replies read while waiting for another kind
        self.last_acks: list[Ack] = []

    def __getstate__(self) -> dict:
        if self._block is not None:
            raise RuntimeError("a Client can be sent to another process only before its first use")
        return self.__dict__.copy()

    def _attach(self) -> SharedBlock:
        if self._block is None:  # a worker's client, first used in its own process
            self._block = SharedBlock.attach(self._block_name)
            self._pull_buf = self._layout.pull_buffer(self._block, self.worker)
            self._push_buf = self._layout.push_buffer(self._block, self.worker)
            self._snapshots = Snapshots(self._layout, self._block, self._ranges)
        return self._block

    def pull(self, *, copy: bool = True, into: Any = None, timeout: float | None = None) -> Any:
        """Blocks until the consistency model lets this worker start, then returns the params.

        Args:
            copy: False returns leaves that view the pull buffer (valid until the next pull).
            into: an existing tree or model (e.g. a ``torch.nn.Module``) to copy the
                values into, in place; it is returned.
            timeout: seconds to wait for the shards (None: forever).

        Returns:
            The parameters in the structure and backend the job was made with.
        """
        self.pull_flat(timeout=timeout)
        return self.last_pull(copy=copy, into=into)

    def last_pull(self, *, copy: bool = True, into: Any = None) -> Any:
        """The parameters of the last completed pull, as :meth:`pull` returns them."""
        if into is not None:
            tree.unflatten_into(into, self._pull_buf, self._spec)
            return into
        return tree.unflatten(self._pull_buf, self._spec, copy=copy)

    def pull_flat(self, *, timeout: float | None = None) -> np.ndarray:
        """Like :meth:`pull` but returns the flat pull buffer itself (no copy)."""
        self._attach()
        shards = range(len(self._ranges))
        snaps = self._snapshots  # None for the observer: its pulls are served
        if (
            snaps is not None
            and self._direct
            and not any(self._pulls_due)
            and all(self._consistency.may_start(self._seq, snaps.min_clock(k)) for k in shards)
        ):
            for k in shards:
                # read-your-writes: once an ack is in, wait for the snapshot that holds it
                seen = (
                    self._acks[k].version
                    if self._acks[k] is not None and not self._acks_due[k]
                    else 0
                )
                deadline = None if timeout is None else time.monotonic() + timeout
                while (version := snaps.read(k, self._pull_buf)) < seen:
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(
                            f"shard {k} did not publish version {seen} within {timeout} s"
                        )
                    time.sleep(0.0001)
                self._base[k] = version
            return self._pull_buf
        if not any(self._pulls_due):
            for c in self._conns:  # sent before reading the last push's acks: saves a round trip
                c.send(("pull",))
            self._pulls_due = [True] * len(self._conns)
        rejected = None
        try:
            self.wait(timeout=timeout)
        except PushRejected as e:
            rejected = e
        for k in shards:
            if self._pulls_due[k]:
                self._base[k] = self._take(k, "pulled", timeout)[1]
                self._pulls_due[k] = False
        if rejected is not None:  # the pull itself is complete; report the refused push
            raise rejected
        return self._pull_buf

    def _take(self, k: int, kind: str, timeout: float | None) -> Any:
        """The next reply of ``kind`` from shard ``k``, keeping replies of other kinds."""
        for i, msg in enumerate(self._inbox[k]):
            if msg[0] == kind:
                return self._inbox[k].pop(i)
        while True:
            msg = _recv(self._conns[k], timeout, f"{kind} from shard {k}")
            if msg[0] == kind:
                return msg
            self._inbox[k].append(msg)

    def push(self, update: Any, *, timeout: float | None = None) -> None:
        """Sends an update (same structure as the params) to every shard; returns at once.

        The previous push must have been acknowledged first; this waits for that.
        Raises PushRejected (for the previous push) if a shard refused it.
        """
        if self.worker is None:
            raise ValueError("an observer client cannot push")
        self._attach()
        try:
            self.wait(timeout=timeout)
        finally:  # a refused previous push must not cost this one
            tree.flatten(update, spec=self._spec, out=self._push_buf)
            self.push_flat_sent()

    def push_flat_sent(self) -> None:
        """Announces the update already written into :attr:`push_buffer` to every shard."""
        refusal = None
        if len(self._conns) > 1 and not math.isfinite(np.dot(self._push_buf, self._push_buf)):
            # Each shard sees only its slice: decide for all of them, or some would
            # apply a push that another one refuses.
            bad = int(np.flatnonzero(~np.isfinite(self._push_buf))[0])
            leaf = self._spec.segments.names[
                int(np.searchsorted(self._spec.segments.offsets, bad, "right")) - 1
            ]
            refusal = (
                "not_finite",
                f"payload has NaN or Inf (first at element {bad}, leaf {leaf!r})",
            )
        for k, c in enumerate(self._conns):
            c.send(("push", PushHeader(self.worker, self._seq, self._base[k]), refusal))
        self._seq += 1
        self._acks_due = [True] * len(self._conns)

    @property
    def push_buffer(self) -> np.ndarray:
        """The flat push buffer (write an update here, then call :meth:`push_flat_sent`)."""
        self._attach()
        self.wait()
        return self._push_buf

    def wait(self, timeout: float | None = None) -> list[Ack]:
        """Waits for the acknowledgements of the last push; raises PushRejected if refused."""
        if not any(self._acks_due):
            return self.last_acks
        for k, due in enumerate(self._acks_due):
            if due:  # progress survives a timeout: the next call waits for the rest
                self._acks[k] = self._take(k, "ack", timeout)[1]
                self._acks_due[k] = False
        acks = self.last_acks = list(self._acks)
        bad = [(k, a) for k, a in enumerate(acks) if not a.ok]
        if bad:
            raise PushRejected(
                "; ".join(f"shard {k} rejected push {a.seq}: {a.reason}" for k, a in bad)
            )
        return acks

    def close(self) -> None:
        """Leaves the job (gates stop waiting for this worker) and closes the pipes."""
        try:
            if self.worker is not None:
                if any(self._acks_due):
                    self.wait(timeout=30)
                for c in self._conns:
                    c.send(("leave",))
        except (OSError, ServerClosed, PushRejected, TimeoutError):
            pass
        for c in self._conns:
            c.close()
        self._pull_buf = self._push_buf = None  # type: ignore[assignment]
        if self._block is not None:
            self._block.close()


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
                if _recv(c, start_timeout, f"start of shard {k}") != ("ready", k):
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
