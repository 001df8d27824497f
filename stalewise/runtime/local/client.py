"""A worker's handle on the local runtime's shards: pull, push, wait.

A :class:`Client` is one incarnation of its worker id and belongs to one thread of
one process; every blocking call takes a ``timeout`` in seconds (None waits
forever). A shard that closed its connection makes every later call raise
:class:`ServerClosed`, a shard whose process died :class:`~stalewise.runtime.errors.ShardError`
naming it, unless :attr:`Client.rejoin` brings the restarted shard's new pipe (then what
it was not answered is sent again). How: ``docs/design-notes.md`` ("Local runtime")."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from multiprocessing import connection, reduction
from typing import Any, NoReturn

import numpy as np

from stalewise import tree
from stalewise.protocol import Ack, PushResult, ServerConfig, budget, pipeline
from stalewise.protocol.replica import Outstanding
from stalewise.protocol.sender import Sender
from stalewise.runtime.base import PullsIntoTrees
from stalewise.runtime.errors import BudgetSpent, ServerClosed, ShardError
from stalewise.runtime.local import layout as L
from stalewise.runtime.local import wire
from stalewise.runtime.local.layout import Layout, Residuals, Snapshots
from stalewise.runtime.local.procs import describe_exit
from stalewise.runtime.local.shm import SharedBlock

EXIT_WAIT = 1.0  # seconds a client whose pipe to a shard ended waits for the server's word
SLICE = 0.05  # seconds between two looks at the shards' exits while a client waits
# seconds between two looks at a busy shard's snapshot or live params: the first pause,
# doubled up to the longest (a step of a large slice takes milliseconds)
SPIN, SPIN_MAX = 5e-5, 1e-3
REJOIN_TIMEOUT = 60.0  # seconds a client waits for a restarted shard's new pipe (Rejoin)
LIVE_COPIES = 2  # copies of a shard's live params a read-your-writes pull tries before asking

log = logging.getLogger(__name__)


def recv_reply(
    conn: connection.Connection, timeout: float | None, what: str, *, trusted: bool = False
) -> tuple:
    """The next message from a shard, decoded (:func:`wire.decode_reply`); ``trusted``:
    ``conn`` is the parent's control pipe, whose bulk replies may be of any length."""
    if not wire.readable([conn], timeout):
        raise TimeoutError(f"no answer to {what} within {timeout} s")
    try:
        body = conn.recv_bytes(None if trusted else wire.MAX_REPLY)
    except (EOFError, OSError):
        raise ServerClosed(f"shard closed the connection while waiting for {what}") from None
    try:
        return wire.decode_reply(body, trusted=trusted)
    except wire.WireError as e:
        raise ServerClosed(f"malformed message while waiting for {what}: {e}") from None


class Rejoin:
    """A :attr:`Client.rejoin`: restarted shard k's new pipe, as the server sends it on
    ``conn`` (``Job.train``'s result pipe, an attached process's socket), ``timeout`` s at
    most once the shard's new process has started (then None); ``beat`` while it waits."""

    def __init__(self, conn: connection.Connection, timeout: float, client: Client, beat=None):
        self.conn, self.beat, self.timeout, self.client, self.ends = conn, beat, timeout, client, {}

    def __call__(self, k: int) -> connection.Connection | None:
        deadline = time.monotonic() + self.timeout
        while k not in self.ends and (left := deadline - time.monotonic()) > 0:
            if (code := self.client._exits[k]) == code:  # an exit code: the server restarts it
                deadline = time.monotonic() + self.timeout
            every = 1.0 if self.beat is None else (self.beat() or self.beat.every or 1.0)
            try:
                if self.conn.poll(min(left, every)):
                    j = wire.decode_rejoin(self.conn.recv_bytes(wire.MAX_RESULT))
                    self.ends[j] = connection.Connection(reduction.recv_handle(self.conn))
            except (OSError, EOFError, wire.WireError) as e:  # the server is gone or gave up
                log.warning("worker: no new pipe to shard %d: %s", k, e)
                break
        self.timeout = self.timeout if k in self.ends else 0  # once in vain: no more waits
        return self.ends.pop(k, None)

    @property
    def sent(self) -> bool:
        """Whether the server has sent a new pipe not taken yet."""
        return bool(self.ends) or self.conn.poll(0)


class Client(PullsIntoTrees):
    """A worker's handle on the shards: ``pull()`` params, ``push()`` updates; made by
    :meth:`LocalServer.client`, picklable until first used."""

    #: the job's budget of pushes this client refuses to pass at commit (None: none; see
    #: :meth:`may_begin`), checked when set
    budget = budget.Budget()

    def __init__(
        self,
        worker: int | None,
        block_name: str,
        layout: Layout,
        config: ServerConfig,
        conns: list,
        block: SharedBlock | None = None,
        incarnation: int = 0,
        joined_at: int = 0,
    ):
        self.worker = worker
        self.incarnation = incarnation
        self.joined_at = joined_at  #: the shards' clock for this worker when it joined
        self._block_name = block_name
        self._layout = layout
        self._spec = config.spec
        self._ranges = config.ranges
        self._consistency = config.consistency
        self._staleness = config.staleness
        self._direct = pipeline.reads_snapshots(  # else the shards serve each pull
            config, incarnation=incarnation, joined_at=joined_at
        )
        self._compressor = config.compressor()  # with a codec: one payload per shard
        self._residuals: Residuals | None = None  # error feedback, in the block (on attach)
        self._payloads: list[np.ndarray] = []  # shard k's payload in the push region
        self._sender: Sender | None = None  # versions, verdict, residual; made on attach
        self._conns = conns
        self._block: SharedBlock | None = None
        self._snapshots: Snapshots | None = None  # set on attach (workers only)
        self._last: Any = None  # what the last pull filled (see last_pull)
        self._spares: list[np.ndarray] = []  # the last pulls' new memory (see _fresh)
        if worker is None:  # the server's own observer shares its mapping
            assert block is not None
            self._block = block
            self._pull_buf = layout.observer(block)
            self._control = layout.control(block)
        self._acks_due = [False] * len(conns)  # shard k still owes an ack for the last push
        self._pulls_due = [False] * len(conns)  # shard k still owes a served pull (after a timeout)
        self._acks: list[Any] = [None] * len(conns)
        self._inbox: list[list] = [[] for _ in conns]  # replies read while waiting for another kind
        self._results: list[PushResult] = []  # push results not yet taken
        self.last_result: PushResult | None = None
        self._closed_by: str | None = None  # why a shard closed the connection, once one did
        self._exits: np.ndarray | None = None  # how each shard's process ended (workers only)
        self._stop_word: np.ndarray | None = None  # the server's stop flag (workers only)
        self._done: np.ndarray | None = None  # this worker id's pushes (workers only)
        #: whether the last pull includes this worker's last push (see :meth:`pull`'s ``own``)
        self.pull_has_own = True
        #: pulls from a shard whose snapshot lacked this worker's acknowledged push and whose
        #: live params kept changing while read, so served by the shard (read-your-writes)
        self.own_requests = 0
        self.trailed = 0  #: read-your-writes pulls copied behind their push's step (_trail)
        self._lease: connection.Connection | None = None  # an attached process's socket
        self.budget_refused = 0  # pushes refused past the budget
        self._granted = False  # may_begin said yes since the last push
        self._round = joined_at  # under BSP: this worker's clock as it knows it
        self.watch: Any = None  # a loop the user owns: its protocol.loop.Watch
        #: ``rejoin(k)``: restarted shard k's new pipe for this incarnation (None: none comes)
        self.rejoin: Any = None
        self._outstanding = Outstanding(len(conns))  # keyed by the reply awaited
        self._sums: list[float] | None = None  # each shard's sum of squares of the push

    @property
    def pushed(self) -> int:
        """This worker id's pushes committed, over its incarnations (a checkpoint's cut)."""
        self._attach()
        return int(self._control[self._layout.pushes_done][self.worker])

    @property
    def job_pushes(self) -> int:
        """Pushes committed by the job's workers (each id, all incarnations): ``steps`` counts."""
        self._attach()
        return int(self._control[self._layout.pushes_done].sum())

    def _may_begin(self, steps: int) -> bool:
        if self._consistency.averages_rounds:
            self._attach()
            workers = self._layout.expected or self._layout.workers
            return budget.may_begin_round(self._round_now(), workers, steps)
        return budget.may_begin(self.job_pushes, 0, steps)

    def _round_now(self) -> int:
        """Under BSP: the round of this worker's next push (its clock, or the shards', if later)."""
        snaps = self._snapshots
        shards = 0 if snaps is None else max(snaps.min_clock(k) for k in range(len(self._ranges)))
        return budget.round_of(self._round, shards)

    @property
    def stopping(self) -> bool:
        """Whether the server has asked its workers to stop (the job is ending)."""
        self._attach()
        return bool(self._control[0])

    def __getstate__(self) -> dict:
        if self._block is not None:
            raise RuntimeError("a Client can be sent to another process only before its first use")
        return self.__dict__.copy()

    def _attach(self) -> SharedBlock:
        if self._conns and getattr(self._conns[0], "handed_on", False):
            w = self.worker
            raise RuntimeError(
                f"worker {w}'s client was released: server.release({w}) hands it to the "
                f"process it was sent to, which alone uses it (server.client({w}) makes another)"
            )
        if self._block is None:  # a worker's client, first used in its own process
            self._block = SharedBlock.attach(self._block_name)
            self._pull_buf = self._layout.pull_buffer(self._block, self.worker)
            if self._compressor is None:
                self._push_buf = self._layout.push_buffer(self._block, self.worker)
                tree.warm_copy(self._push_buf)  # its compile now, not at the first push
            else:  # the update, in this process, encoded into the shared payloads at push
                self._push_buf = np.empty(self._layout.size, self._layout.dtype)
                shards = range(len(self._ranges))
                self._payloads = [self._layout.payload(self._block, self.worker, k) for k in shards]
                if self._layout.feedback:
                    self._residuals = Residuals(self._layout, self._block)
                self._compressor.warm_up()  # its kernels load now, not at the first push
            self._record = self._layout.records(self._block)[self.worker]
            self._snapshots = Snapshots(self._layout, self._block, self._ranges)
            self._control = control = self._layout.control(self._block)
            self._exits, self._stop_word = control[self._layout.shard_exits], control[:1]
            self._done = control[self._layout.pushes_done][self.worker : self.worker + 1]
        if self._sender is None:  # residuals in the block: Residuals.put leaves the current in 1
            res = self._residuals
            self._sender = Sender(
                self._spec.segments,
                self._staleness,
                len(self._conns),
                self._compressor if self.worker is not None else None,
                buffers=None if res is None else res.buffers[self.worker],
                current=1,
                dtype=self._layout.dtype,
            )
        return self._block

    def pull(self, *, copy: bool = True, into: Any = None, timeout=None, own: bool = True) -> Any:
        # one copy, into new memory or `into`'s leaves (a pull that raises may have written some)
        views = None if into is None else tree.views_into(into, self._spec)
        if (not copy and into is None) or (into is not None and views is None):
            return super().pull(copy=copy, into=into, timeout=timeout, own=own)
        flat = self.pull_flat(
            timeout=timeout, own=own, out=self._fresh() if views is None else views
        )
        return into if views is not None else tree.unflatten(flat, self._spec)  # views `flat`

    def _fresh(self) -> np.ndarray:
        """Memory for a pull's new arrays: one of the last two pulls' once nothing outside
        this client refers to it (CPython's reference count: no page faults), else new."""
        for a in self._spares:  # referred to by the list, `a`, getrefcount and maybe _last
            if sys.getrefcount(a) == 3 + (a is self._last):
                return a
        self._spares = [np.empty(self._layout.size, self._layout.dtype), *self._spares[:1]]
        return self._spares[0]

    def last_pull(self, *, copy: bool = True, into: Any = None) -> Any:
        """The parameters of the last completed pull; after ``pull()`` or ``pull(into=)``,
        read from the arrays that pull filled, so with any change made to them since."""
        last, buf = self._last, self._pull_buf
        if last is not None and last is not buf:  # read into fresh memory or a tree's leaves
            for at, view in [(0, last)] if isinstance(last, np.ndarray) else last:
                np.copyto(buf[at : at + view.size], view)
            self._last = buf
        return super().last_pull(copy=copy, into=into)

    def pull_flat(self, *, timeout: float | None = None, own: bool = True, out: Any = None) -> Any:
        """Like :meth:`pull` but returns the flat pull buffer itself (no copy), or ``out``
        (a flat vector, or pieces of one: :func:`layout.copy_range`) filled with the pull."""
        self._attach()
        out = self._last = self._pull_buf if out is None else out
        if self.watch is not None:
            self.watch.pulled = True
        shards, copied = range(len(self._ranges)), {}
        snaps = self._snapshots  # None for the observer: its pulls are served
        if snaps is not None:  # a shard that died, or closed this client's pipe, says so now
            self._check_open()
            for k in shards:
                self._drain(k)
            if own:  # read-your-writes: behind the last push's step, else after its acks
                copied = self._trail(out, timeout)
                if not copied:
                    self.wait(timeout=timeout)
        # served pulls go after the push on the same pipe, so they hold it too
        self.pull_has_own = bool(copied) or not any(self._acks_due) or not self._direct
        if copied:
            self.trailed += 1
            for k, version in copied.items():
                self._sender.pulled(k, version)
        elif self._reads_direct():
            for k in shards:  # a shard whose copies lack the acked push serves the pull
                version = self._read(k, timeout, out)
                if version is None:
                    self._send(k, wire.pull(), "pulled")
                    self._pulls_due[k] = True
                else:
                    self._sender.pulled(k, version)
            self.own_requests += sum(self._pulls_due)
        elif not any(self._pulls_due):
            for k in shards:  # sent before reading the last push's acks: saves a round trip
                self._send(k, wire.pull(), "pulled")
            self._pulls_due = [True] * len(self._conns)
        if any(self._pulls_due):
            self.wait(timeout=timeout)
            for k in shards:
                if self._pulls_due[k]:
                    self._sender.pulled(k, self._take(k, "pulled", timeout)[1])
                    self._pulls_due[k] = False
                    if out is not self._pull_buf:  # served into the pull buffer
                        L.copy_range(out, self._pull_buf, *self._ranges[k])
        return out

    def _reads_direct(self) -> bool:
        """Whether this pull may copy the shards' memory itself (else the shards serve it)."""
        snaps, shards = self._snapshots, range(len(self._ranges))
        return (
            snaps is not None
            and self._direct
            and not any(self._pulls_due)
            and pipeline.may_read(
                self._consistency, self._sender.seq, (snaps.min_clock(k) for k in shards)
            )
        )

    def _trail(self, out: Any, timeout: float | None) -> dict[int, int]:
        """Copies each shard's live params into ``out`` behind the step of this worker's last
        push, as the shard writes them (``Snapshots.trail``), not waiting for its acks; returns
        each shard's version so copied: all of them, or none (then read after the acks)."""
        snaps, conns, exits = self._snapshots, self._conns, self._exits
        if not (LIVE_COPIES and all(self._acks_due) and self._reads_direct()):  # a live copy
            return {}
        tag = L.step_tag(self.worker, int(self._record[L.R_SEQ]))
        trails = {k: snaps.trail(k, out, self.worker, tag) for k in range(len(conns))}
        copied, pause = {}, SPIN
        end = None if timeout is None else time.monotonic() + timeout
        try:
            while trails:
                # something to read (its ack, or the pipe's end): the shard is past the step
                past = set(wire.readable([conns[k] for k in trails], 0))
                if exits is not None and any(c == c for c in exits.tolist()):  # an exit code
                    return {}
                for k in list(trails):
                    try:
                        running = next(trails[k])
                    except StopIteration as stop:
                        del trails[k]
                        if stop.value is None:
                            return {}
                        copied[k] = stop.value
                        continue
                    if (
                        conns[k] in past
                        or any(m[0] == "ack" for m in self._inbox[k])
                        or (end is not None and time.monotonic() > end)
                    ):
                        return {}
                    if running:
                        pause = SPIN
                if trails:
                    time.sleep(pause)
                    pause = min(2 * pause, SPIN_MAX)
            return copied
        finally:
            for trail in trails.values():
                trail.close()  # its mark in the table goes

    def peek(self) -> Any:
        """The params as the shards last published them, past every gate (a warm-up's: a
        resumed BSP worker a push ahead waits for the others' pushes at its pull)."""
        self._attach()
        for k in range(len(self._ranges)):
            self._snapshots.read(k, self._pull_buf)
        return self.last_pull(copy=False)

    def _read(self, k: int, timeout: float | None, out: Any) -> int | None:
        """Copies shard ``k``'s params holding this worker's acked push into ``out`` and
        returns their version; None after :data:`LIVE_COPIES` torn copies (ask the shard)."""
        ack, snaps = self._acks[k], self._snapshots
        # the version shard k named in its ack of this worker's last push (0: none, or not read)
        acked = ack.version if ack is not None and not self._acks_due[k] else 0
        copies, pause, deadline = 0, SPIN, None if timeout is None else time.monotonic() + timeout
        while snaps.version(k) < acked:
            if snaps.announced(k) < acked and snaps.steady(k):  # no publish of it under way
                if copies == LIVE_COPIES:
                    return None
                copies += 1
                version = snaps.read_live(k, out, self.worker)
                if version is not None and version >= acked:
                    return version
                continue
            self._check_shards()
            self._drain(k)  # the pipe's end: the shard stopped
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"shard {k} had no version {acked} to read in {timeout} s")
            time.sleep(pause)
            pause = min(2 * pause, SPIN_MAX)
        return snaps.read(k, out)

    def _take(self, k: int, kind: str | tuple[str, ...], timeout: float | None) -> Any:
        """The next reply of ``kind`` (or one of those kinds) from shard ``k``, keeping others;
        waits in slices of :data:`SLICE` seconds, ending when a shard dies (ShardError)."""
        kinds = (kind,) if isinstance(kind, str) else kind
        for i, msg in enumerate(self._inbox[k]):
            if msg[0] in kinds:
                return self._inbox[k].pop(i)
        self._check_open()
        what = f"{' or '.join(kinds)} from shard {k}"
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._exits is not None:  # a worker's client: one poll of the pipe, then the read
                self._check_shards()
                left = None if deadline is None else deadline - time.monotonic()
                try:
                    msg = self._recv(k, SLICE if left is None else max(0.0, min(SLICE, left)), what)
                except TimeoutError:
                    if left is not None and left <= SLICE:
                        raise TimeoutError(f"no answer to {what} within {timeout} s") from None
                    continue
            else:
                msg = self._recv(k, timeout, what)
            if msg[0] in kinds:
                return msg
            self._inbox[k].append(msg)

    def _recv(self, k: int, timeout: float | None, what: str) -> tuple:
        """The next message from shard ``k``: ServerClosed (or ShardError, if it died)
        when the shard closed the pipe or refused to serve this client."""
        try:
            msg = recv_reply(self._conns[k], timeout, what, trusted=self.worker is None)
        except ServerClosed as e:  # the message names the shard
            self._gone(k, str(e))  # returns once shard k's new pipe is in
            return self._recv(k, timeout, what)
        if msg[0] == "error":  # the shard refused to serve this client
            self._closed(f"shard {k}: {msg[1]}")
        self._outstanding.answered(k, msg[0])
        return msg

    def _drain(self, k: int) -> None:
        """Reads what shard ``k`` sent (to the inbox), not waiting; a pipe end or refusal raises."""
        with contextlib.suppress(TimeoutError):  # a new pipe, with nothing yet
            while wire.readable([self._conns[k]], 0):
                self._inbox[k].append(self._recv(k, 0, f"messages from shard {k}"))

    def _send(self, k: int, body: bytes, reply: str = "") -> None:
        """Sends ``body`` to shard ``k``; ``reply``: the kind of its answer, awaited."""
        self._check_open()
        try:
            self._conns[k].send_bytes(body)
        except OSError as e:
            self._gone(k, f"shard {k} closed the connection ({type(e).__name__})")
            return self._send(k, body, reply)  # on the new pipe
        if reply:
            self._outstanding.sent(k, reply, body)

    def _reconnect(self, k: int) -> bool:
        """Takes restarted shard ``k``'s new pipe (:attr:`rejoin`) and sends it again what
        the old one did not answer; False when none comes."""
        if self.rejoin is None or self._stop_word[0] or (conn := self.rejoin(k)) is None:
            return False
        self._conns[k].close()
        self._conns[k] = conn
        with contextlib.suppress(OSError):  # died again: the next read or send says so
            for body in self._outstanding.resend(k):
                conn.send_bytes(body)
        return True

    def _gone(self, k: int, why: str) -> None:
        """A pipe to shard ``k`` ended: returns once its new pipe is in (:meth:`_reconnect`,
        tried once the shard is seen dead or a new pipe comes), else ShardError if it died
        (the server's word may come a moment after the pipe ends), else ServerClosed."""
        if self._exits is not None and self._closed_by is None:
            end = time.monotonic() + EXIT_WAIT
            while not self._stop_word[0] and time.monotonic() < end:
                if self._exits[k] == self._exits[k] or getattr(self.rejoin, "sent", False):
                    if self._reconnect(k):  # it died (an exit code, not NaN), or is back
                        return
                    break
                time.sleep(0.005)
            self._check_shards()
        self._closed(why)

    def _closed(self, why: str) -> NoReturn:
        if self._closed_by is None:
            self._closed_by = why
        raise ServerClosed(why)

    def _check_shards(self) -> None:
        """Raises :class:`ShardError` naming each shard seen dead, not back (:meth:`_reconnect`)."""
        exits = self._exits
        if exits is None or all(c != c for c in exits.tolist()):  # NaN: running
            return
        if all(self._reconnect(k) for k, c in enumerate(exits.tolist()) if c == c):
            return
        raise ShardError(
            "; ".join(
                f"shard {k} has died ({_ended(float(code))})"
                for k, code in enumerate(exits.tolist())
                if not np.isnan(code)
            )
        )

    def _check_open(self) -> None:
        self._check_shards()
        if self._closed_by is not None:
            raise ServerClosed(self._closed_by)

    def push(self, update: Any, *, timeout: float | None = None) -> None:
        """Sends an update (same structure as the params) to every shard; returns at once,
        once the previous push was acknowledged (see :attr:`last_result`)."""
        if self.worker is None:
            raise ValueError("an observer client cannot push")
        self._attach()
        self.wait(timeout=timeout)  # a timeout propagates: the shards may still read the buffer
        spec, out = self._spec, self._push_buf
        if self._compressor is None:  # each shard's sum of squares of its slice, as copied
            self._sums = tree.flatten_measured(update, self._ranges, spec=spec, out=out)[2]
        else:
            tree.flatten(update, spec=spec, out=out)
        self.push_flat_sent()

    def push_flat_sent(self) -> None:
        """Commits the update already written into :attr:`push_buffer` and tells every shard."""
        sums, self._sums = self._sums, None  # measured by push(), or not
        self._check_open()  # a shard has cut this worker off: commit nothing more
        granted, self._granted = self._granted, False
        rounds = self._consistency.averages_rounds
        if budget.refuses(self.budget, granted, self._may_begin, rounds=rounds):
            self.budget_refused += 1
            raise BudgetSpent(self.budget)
        if self.watch is not None:
            self.watch.pushing()
        if self._compressor is not None:
            self.wait()  # the shards read the payloads until they have acked the last push
            self._encode()
        if rounds:
            self._round = self._round_now() + 1
        seq = self._commit(sums)
        self._done[0] += 1  # this worker id's pushes, the job's budget count: committed
        self._sender.committed()  # the new residual is the one a successor takes
        for k in range(len(self._conns)):
            self._send(k, wire.push(seq), "ack")
        self._acks_due = [True] * len(self._conns)

    def _encode(self) -> None:
        """Encodes the push buffer into the payloads, the residual into the other shared buffer."""
        res, sender = self._residuals, self._sender
        if res is None:
            sender.encode(self._push_buf, self._payloads)
            return
        j = 1 - sender.current
        res.writing(self.worker, j)
        sender.encode(self._push_buf, self._payloads)
        res.written(self.worker, j, sender.seq + 1)

    @property
    def residual(self) -> np.ndarray | None:
        """This worker's error-feedback residual after its last push (shared memory; or None)."""
        self._attach()
        return self._sender.residual

    def _commit(self, sums: list[float] | None = None) -> int:
        """Judges the update in the push buffer and writes its record (``sums``: each shard's
        sum of squares of its slice, None: not measured), commit word last; returns the seq."""
        sender = self._sender
        if self._snapshots is not None:  # what the shards published may be newer
            for k in range(len(self._conns)):
                sender.observed(k, self._snapshots.version(k))
        seq, bases, verdict = sender.judge(self._push_buf)
        rec = self._record
        rec[L.R_COMMIT] = 0  # the old record is void while the new one is written
        rec[L.R_INC : L.R_BASES + len(bases)] = (self.incarnation, seq, *verdict, *bases)
        rec[L.R_BASES + len(bases) :] = np.array(sums or [-1.0] * len(bases)).view(np.int64)
        rec[L.R_COMMIT] = seq + 1  # committed: from here on, all shards or none
        return seq

    @property
    def push_buffer(self) -> np.ndarray:
        """The flat push buffer (write an update here, then call :meth:`push_flat_sent`)."""
        self._attach()
        self.wait()
        return self._push_buf

    def wait(self, timeout: float | None = None) -> PushResult | None:
        """Waits for the last push's acks; returns its :class:`PushResult` (None: no push yet)."""
        if not any(self._acks_due):
            return self.last_result
        for k, due in enumerate(self._acks_due):
            if due:  # progress survives a timeout: the next call waits for the rest
                ack: Ack = self._take(k, "ack", timeout)[1]
                self._acks[k] = ack
                self._acks_due[k] = False
        self.last_result = self._sender.result(self._acks)
        self._results.append(self.last_result)
        if self.watch is not None:
            self.watch.result(self.last_result)
        return self.last_result

    def log_loss(self, loss: float) -> None:
        """Publishes this worker's latest training loss (the control block's slot)."""
        self._attach()
        self._control[self._layout.losses][self.worker] = loss

    def close(self) -> None:
        """Leaves the job (gates stop waiting for this worker) and closes the pipes."""
        try:
            if self.worker is not None:
                if any(self._acks_due):
                    self.wait(timeout=30)
                for k in range(len(self._conns)):
                    self._send(k, wire.leave())
        except (OSError, ServerClosed, ShardError, TimeoutError):
            pass
        for c in self._conns:
            c.close()
        self._closed_by = self._closed_by or "this client is closed"
        if self._lease is not None:  # the server gives this worker id back (see .attach)
            self._lease.close()
        self._pull_buf = self._push_buf = None  # type: ignore[assignment]
        self._payloads, self._spares = [], []
        self._residuals = None
        if self._block is not None:
            self._block.close()


def _ended(code: float) -> str:
    """How a shard's process ended, from its control word (inf: not known)."""
    return "its exit status is unknown" if np.isinf(code) else describe_exit(int(code))
