"""The body of a local shard process: one :class:`~stalewise.protocol.Shard` behind pipes, in
turns (:meth:`ShardProcess.turn`), and of its backup's (:func:`backup_main`). A worker's bad
message disconnects it (:class:`WorkerPipe`). Why: ``docs/design-notes.md`` ("Local runtime")."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import signal
import socket
import struct
import time
from multiprocessing import connection, reduction

import numpy as np

from stalewise.checkpoint.store import LogWriter
from stalewise.protocol import PushHeader, ServerConfig, Shard, commit, delivery, pipeline, pushlog
from stalewise.protocol.replica import Backup, CatchUp, Forward, Held, Primary, digest
from stalewise.runtime.local import layout as L
from stalewise.runtime.local import wire
from stalewise.runtime.local.layout import Layout, Snapshots, step_tag
from stalewise.runtime.local.procs import die_with_parent
from stalewise.runtime.local.shm import SharedBlock
from stalewise.runtime.logs import child_logging

log = logging.getLogger(__name__)


PARTIAL_TIMEOUT = 1.0  # seconds a worker's message may stay incomplete before it is cut off
CUT_LIMIT = 60.0  # seconds a shard stays frozen for a cut (the parent gave up: it thaws)
READ_CHUNK = 4096  # bytes read from one worker's pipe per turn of the loop
_REGION = struct.Struct("<i")  # a forwarded entry's tag: the worker whose push region it lacks


def push_regions(layout: Layout, block: SharedBlock, lo: int, hi: int, k: int) -> list:
    """What shard ``k`` (``lo:hi``) reads of each worker's push: its slice, or its payload."""
    if layout.payloads:
        return [layout.payload(block, w, k) for w in range(layout.workers)]
    return [layout.push_buffer(block, w)[lo:hi] for w in range(layout.workers)]


def committed_push(
    layout: Layout, records: np.ndarray, pushes: list, w: int, k: int
) -> tuple[PushHeader, np.ndarray, commit.Verdict] | None:
    """Worker ``w``'s committed push as shard ``k`` reads it from its record, or None
    (``pushes[w]``: shard ``k``'s part of worker ``w``'s push region)."""
    rec = records[w].tolist()
    if not rec[L.R_COMMIT] or rec[L.R_SEQ] != rec[L.R_COMMIT] - 1:
        return None  # nothing committed, or a record caught while being rewritten
    header = PushHeader(w, rec[L.R_SEQ], rec[L.R_BASES + k], rec[L.R_INC])
    return header, pushes[w], commit.Verdict(rec[L.R_CODE], rec[L.R_DETAIL])


class WorkerPipe:
    """The shard's end of one worker incarnation's pipe: non-blocking, framed as it arrives."""

    def __init__(self, fd: int, worker: int, incarnation: int):
        os.set_blocking(fd, False)
        self.fd, self.worker, self.incarnation = fd, worker, incarnation
        self.reader = wire.FrameReader(wire.MAX_WORKER_MESSAGE)
        self.partial_since: float | None = None  # when the incomplete message began

    def fileno(self) -> int:
        return self.fd

    def read(self) -> list[bytes] | None:
        """The bodies of the messages now complete ([] if none); None at end of file; OSError:
        the pipe broke."""
        try:
            data = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return []
        if not data:
            return None
        bodies = self.reader.feed(data)
        if not self.reader.pending:
            self.partial_since = None
        elif bodies or self.partial_since is None:  # a new message has begun
            self.partial_since = time.monotonic()
        return bodies

    def write(self, body: bytes) -> None:
        """Sends one message without blocking (BlockingIOError: the pipe is full, the worker
        does not read its replies; OSError: the pipe broke, the worker is gone)."""
        data = wire.frame(body)
        if os.write(self.fd, data) != len(data):
            raise BlockingIOError("the pipe is full")

    def close(self) -> None:
        os.close(self.fd)


class ShardProcess:
    """A shard and its pipes: the state of :func:`shard_main`'s loop."""

    def __init__(self, config: ServerConfig, k: int, block: SharedBlock, layout: Layout, control):
        lo, hi = config.ranges[k]
        self.k, self.layout, self.control = k, layout, control
        params = layout.params(block)[lo:hi]
        self.shard: Shard = config.build_shard(k, params, layout.workers, layout.expected)
        self.pulls = [layout.pull_buffer(block, w)[lo:hi] for w in range(layout.workers)]
        self.pushes = push_regions(layout, block, lo, hi, k)
        self.records = layout.records(block)
        self.observer = layout.observer(block)[lo:hi]
        self.snapshots = Snapshots(layout, block, config.ranges)
        self.snapshots.announce(k, 0)  # nothing announced (a restart's predecessor may have)
        self.snapshots.changed(k, self.shard.version)  # the live params are consistent
        self.pipes: dict[WorkerPipe, None] = {}  # the live pipes, in the order they joined
        self.current: dict[int, WorkerPipe] = {}  # worker -> the pipe of its current incarnation
        self.waiting: set[int] = set()  # workers whose pull waits on the gate
        self.published, self.published_at = -1, 0.0
        self.answers: list[tuple[WorkerPipe, bytes]] = []  # this turn's acks, sent in settle()
        self.cutting = delivery.Cut()  # a consistent cut under way: held pipes are not read
        self.cut_aimed = False  # its targets are in: the state is sent once they are reached
        self.cut_log: tuple = ("", False)  # and the push log begun then: (path, fsync)
        self.cut_n, self.cut_until = 0, 0.0  # its number, and when it is given up
        self.publishes, self.copy_time = 0, 0.0  # snapshots published; a copy's seconds
        self.log, self.unsynced = LogWriter(f"shard {k}"), False  # the push log; entries unsynced
        self.served = 0  # pulls served into a worker's pull buffer
        self.primary, self.link, self.backup_timeout = None, None, 0.0  # replicas=2 (sync)
        self.unsent = 0  # the bytes of the entries not forwarded yet
        if config.replicas == 2:
            self.equal = np.empty(1 << 18, bool)  # scratch of same()
            self.primary = Primary(self.shard)
            self.record, self.shard.journal = self.shard.journal, self.journal
        else:  # the step reports its progress to a pull that trails it
            self.shard.done = self.snapshots.done(k)

    # -- snapshots -----------------------------------------------------------------

    def publish_now(self) -> None:
        shard, start = self.shard, time.monotonic()
        self.snapshots.publish(self.k, shard.params, shard.version, shard.min_clock())
        self.published, self.published_at = shard.version, time.monotonic()
        self.publishes += 1
        self.copy_time = min(self.copy_time or math.inf, self.published_at - start)  # warm

    def publish_due(self, busy: bool) -> bool:
        """Whether to copy the params out for pulls now (``pipeline.publish_due``)."""
        clock = self.shard.min_clock()
        if self.shard.version == self.published:
            self.snapshots.set_min_clock(self.k, clock)
            return False
        return pipeline.publish_due(
            self.shard.version, self.published, busy=busy,
            clock_moved=clock != self.snapshots.min_clock(self.k),
            since=time.monotonic() - self.published_at,
        )  # fmt: skip

    def write(self, call, *args, step: int = 0, **kwargs):
        """``call(*args, **kwargs)``, a call that may write the shard's params, inside the live
        params' seqlock (released at the version reached, even if it raises); ``step``: the
        push it applies, which its sender's pull may copy behind (``Snapshots.trail``)."""
        snaps, version = self.snapshots, self.shard.version
        step = step if self.primary is None else 0  # else read from sync on (the backup's)
        snaps.changing(self.k, step)
        try:
            return call(*args, **kwargs)
        finally:
            if step:
                snaps.stepped(self.k, self.shard.version == version + 1)
            if self.primary is None:  # else at sync: no worker reads what the backup lacks
                snaps.changed(self.k, self.shard.version)

    # -- workers -------------------------------------------------------------------

    def depart(self, p: WorkerPipe) -> None:
        """Pipe ``p`` is gone: deliver its committed push if this shard lacks it, leave."""
        del self.pipes[p]
        p.close()
        w = p.worker
        if self.current.get(w) is p:
            del self.current[w]
            self.waiting.discard(w)
        got = committed_push(self.layout, self.records, self.pushes, w, self.k)
        self.write(self.shard.depart, w, p.incarnation, got)

    def disconnect(self, p: WorkerPipe, reason: str) -> None:
        """Cuts off a worker that broke the protocol: a warning, an error reply, then depart."""
        w, inc = p.worker, p.incarnation
        log.warning(
            "shard %d: worker %d (incarnation %d) %s; disconnecting it", self.k, w, inc, reason
        )
        with contextlib.suppress(OSError):
            p.write(wire.error(f"disconnected worker {w} ({inc}): {reason}"))
        self.depart(p)

    def reply(self, p: WorkerPipe, body: bytes) -> None:
        try:
            p.write(body)
        except BlockingIOError:
            self.disconnect(p, "does not read its replies (its pipe is full)")
        except OSError:  # the worker is gone: stop waiting for it
            self.depart(p)

    def receive(self, p: WorkerPipe) -> None:
        """Reads what pipe ``p`` has and handles every message it completes, in order."""
        try:
            bodies = p.read()
        except OSError:
            bodies = None
        if bodies is None:  # end of file: the worker left or died
            self.depart(p)
            return
        for body in bodies:
            try:
                msg = wire.decode_from_worker(body)
            except wire.WireError as e:
                self.disconnect(p, f"sent {e}")
                return
            if msg[0] == "push":
                self.push(p, msg[1])
            elif msg[0] == "pull":
                self.waiting.add(p.worker)
            else:
                self.depart(p)
            if p not in self.pipes:
                return
        if p.reader.error is not None:
            self.disconnect(p, f"sent {p.reader.error}")

    def push(self, p: WorkerPipe, seq: int) -> None:
        got = committed_push(self.layout, self.records, self.pushes, p.worker, self.k)
        if got is None or got[0].seq != seq or got[0].incarnation != p.incarnation:
            self.disconnect(p, f"sent push {seq}, which has no committed record")
            return
        header, payload, verdict = got
        sq = self.layout.sumsq(self.records[p.worker], self.k)  # None: the shard measures
        readers = self.snapshots.readers
        while (wait := pipeline.step_wait(readers(self.k), time.monotonic(), self.copy_time)) > 0:
            time.sleep(min(wait, 1e-4))  # a worker copies the live params: its copy first
        now, tag = time.monotonic(), step_tag(p.worker, seq)
        ack = self.write(
            self.shard.push, header, payload, verdict=verdict, now=now, sumsq=sq, step=tag
        )
        self.answers.append((p, wire.ack(ack)))  # sent at the end of this turn (settle)

    def answer(self, sync: bool = True) -> None:
        """Sends this turn's acks, in order, to the pipes still connected (after :meth:`sync`)."""
        if sync:
            self.sync()
        answers, self.answers = self.answers, []
        for p, body in answers:
            if p in self.pipes:
                self.reply(p, body)

    def sync(self) -> None:
        """The entries made so far reach the push log (the OS; with fsync the disk), then the
        backup, which must hold them before anything leaves that a worker acts on."""
        primary = self.primary
        if self.unsynced:
            self.unsynced = False
            if not self.log.sync() and primary is None:  # the log failed: no entry for anyone
                self.shard.journal = None
            fwd, at, self.unsent = primary and primary.forward(), self.log.where(self.unsent), 0
            if fwd and primary.backed:
                try:
                    self.link.send_bytes(wire.link(fwd, *at))
                    until = time.monotonic() + self.backup_timeout
                    while primary.acked < primary.entries:
                        if not self.link.poll(max(0.0, until - time.monotonic())):
                            raise TimeoutError(f"no answer in {self.backup_timeout:g} s")
                        primary.held(wire.decode_link(self.link.recv_bytes(64))[0])
                except (OSError, EOFError, TimeoutError, wire.WireError) as e:
                    self.lose_backup(e)
        if primary is not None:
            self.snapshots.changed(self.k, self.shard.version)

    def lose_backup(self, why: Exception | str) -> None:
        """The backup died, hung or failed: it is killed (its state is never taken), the
        parent starts a new one; this shard serves alone meanwhile."""
        if self.primary.backed:
            log.warning("shard %d: its backup is gone (%s); serving alone", self.k, why or "EOF")
        if self.link is not None and not isinstance(why, str | EOFError | ConnectionError):
            with contextlib.suppress(OSError):  # (else it is dead, maybe reaped: its pid reused)
                os.kill(self.backup_pid, signal.SIGKILL)
        self.primary.detach()
        if self.link is not None:
            self.link = self.link.close()  # None

    def catch_up(self) -> None:
        """Starts the backup on the link from the state now (a new view)."""
        start = self.primary.attach()
        try:
            self.link.send_bytes(wire.link(start, *self.log.where()))
        except OSError as e:
            self.lose_backup(e)

    def expire_partial(self) -> float | None:
        """Cuts off workers whose message stayed incomplete for PARTIAL_TIMEOUT seconds;
        returns when the next one would be, or a frozen cut is given up (None: neither)."""
        now, ends = time.monotonic(), [self.cut_until] if self.cutting.frozen else []
        for p in list(self.pipes):
            if p.partial_since is not None and now - p.partial_since < PARTIAL_TIMEOUT:
                ends.append(p.partial_since + PARTIAL_TIMEOUT)
            elif p.partial_since is not None:
                why = f"({p.reader.pending} bytes) and nothing more for {PARTIAL_TIMEOUT:g} s"
                self.disconnect(p, f"sent an incomplete message {why}")
        return min(ends, default=None)

    def serve_waiting_pulls(self) -> None:
        for w in sorted(self.waiting):
            if self.shard.live[w] and self.shard.may_start(w):
                self.waiting.discard(w)
                version = self.shard.pull(w, self.pulls[w], now=time.monotonic())
                self.served += 1
                self.answers.append((self.current[w], wire.pulled(version)))
        # the backup holds the pulls first; unreplicated, at once (the entries reach the log later)
        self.answer(sync=bool(self.answers) and self.primary is not None)

    # -- the loop ------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether a worker's message is waiting (the next turn has work at once)."""
        return bool(self.pipes) and bool(wire.readable(self.pipes, 0))

    def turn(self, timeout: float | None) -> bool:
        """Handles what arrives within ``timeout`` seconds (None: waits for something); False
        when the shard must stop (:func:`serve` cuts off incomplete messages before each)."""
        readable = [p for p in self.pipes if not self.held(p)]
        for c in wire.readable([self.control, *readable], timeout):
            if c is self.control:
                if not self.on_control():
                    self.answer()  # the pushes handled before the stop are answered
                    return False
            elif c in self.pipes and not self.held(c):  # else: departed, or a cut began
                self.receive(c)
        if self.cut_aimed and self.cutting.reached(self.shard):
            self.end_cut(self.shard.state_dict())
        elif self.cutting.frozen and time.monotonic() >= self.cut_until:
            log.error("shard %d: no consistent cut within %g s; thawed", self.k, CUT_LIMIT)
            self.end_cut(None, f"shard {self.k}: no consistent cut within {CUT_LIMIT:g} s")
        return True

    def end_cut(self, *reply) -> None:
        """Thaws, begins the cut's push log (at its state, or where it was given up: a chain
        has no gap), then sends ``reply`` (:func:`wire.cut_reply`'s; none: the parent's thaw)."""
        if self.cut_log[0]:
            self.begin_log(self.cut_log[0], None, self.cut_log[1])
        self.cutting.thaw()
        self.cut_aimed, self.cut_log = False, ("", False)
        if reply:
            self.control.send_bytes(wire.cut_reply(self.cut_n, *reply))

    def held(self, p: WorkerPipe) -> bool:
        """Whether pipe ``p`` is not read now: under a cut, unless its next push is below target."""
        cut = self.cutting
        return cut.frozen and cut.holds(p.worker, p.incarnation, int(self.shard.next_seq[p.worker]))

    def settle(self) -> None:
        """After a turn: the acks, the publish (:meth:`publish_due`; a gated shard whose
        slowest clock moved publishes first), then the served pulls."""
        self.sync()  # the backup holds what is published
        busy = self.busy()
        due = self.publish_due(busy)
        gate = self.shard.consistency.gated
        if due and gate and self.shard.min_clock() != self.snapshots.min_clock(self.k):
            self.publish_now()
            due = False
        elif due and busy:
            self.snapshots.announce(self.k, self.shard.version)
        self.answer()
        if due:
            self.publish_now()
        self.serve_waiting_pulls()
        if not busy:
            self.shard.prepare()  # the next step's undo copy (or bounds), while no push waits

    # -- the push log --------------------------------------------------------------

    def begin_log(self, path: str, at: int | None = None, fsync: bool = False) -> None:
        """Ends the push log and begins ``path`` at the state now (``at``: goes on with it, cut
        there: a restart's); ``fsync``: each turn's entries reach the disk before its acks."""
        self.sync()  # a forward never spans two logs
        self.end_log()
        if self.log.begin(path, at, fsync):
            self.shard.journal = self.journal

    def journal(self, entry: list) -> None:
        self.unsynced = True
        size = self.log.write(entry)
        if self.primary is not None:
            self.unsent += size
            self.record(self.by_region(entry))

    def by_region(self, entry: list) -> list:
        """``entry`` for the backup, tagged with the worker whose push region still holds its
        payload after the step (then left out: it is rewritten only once acknowledged), or -1."""
        f = json.loads(entry[1]) if len(entry[-1]) and self.primary.backed else {}
        w = (f.get("header") or [-1])[0]  # [worker, seq, base, incarnation]
        if 0 <= w < len(self.pushes) and self.same(entry[-1], self.pushes[w].view(np.uint8)):
            return [_REGION.pack(w), *entry[:-1]]
        return [_REGION.pack(-1), *entry]

    def same(self, data: bytes, region: np.ndarray) -> bool:
        """Whether ``data`` is ``region``'s bytes, compared a block at a time (no big temporary)."""
        data, eq = np.frombuffer(data, np.uint8), self.equal
        if data.size != region.size:
            return False
        for i in range(0, data.size, eq.size):
            n = min(eq.size, data.size - i)
            if not np.equal(data[i : i + n], region[i : i + n], out=eq[:n]).all():
                return False
        return True

    def end_log(self) -> None:
        """Closes the push log, flushed and fsynced (bounding what a machine crash loses)."""
        self.log.end(fsync=True)
        self.shard.journal = None if self.primary is None else self.journal

    # -- the parent ----------------------------------------------------------------

    def on_control(self) -> bool:
        """Handles one message from the parent; False when the shard must stop."""
        c, shard = self.control, self.shard
        try:
            msg = wire.decode_control(c.recv_bytes())
        except (EOFError, OSError):
            return False
        except wire.WireError as e:  # the parent is this program: a bug, said loudly
            log.error("shard %d: the parent sent %s; ignored", self.k, e)
            return True
        kind = msg[0]
        self.sync()  # the backup holds what a reply says
        if kind == "join":
            self.join(msg[1], msg[2])
        elif kind == "pull":  # the observer: exact, never gated
            c.send_bytes(wire.pulled(shard.pull(None, self.observer)))
        elif kind == "stats":
            c.send_bytes(wire.stats_reply(shard.stats.as_dict() | {"version": shard.version}))
        elif kind == "state":
            c.send_bytes(wire.state_reply(shard.state_dict()))
        elif kind == "cut" and msg[2] is None:  # frozen: each worker's (incarnation, pushes)
            self.cut_n, self.cut_until = msg[1], time.monotonic() + CUT_LIMIT
            c.send_bytes(wire.cut_reply(msg[1], self.cutting.freeze(shard)))
        elif kind == "cut":
            self.cut_n, self.cut_log = msg[1], msg[3:]
            if self.cutting.frozen:
                self.cutting.aim(msg[2])
                self.cut_aimed = True
            else:  # it gave the cut up (CUT_LIMIT): no consistent state
                self.end_cut(None, f"shard {self.k}: not frozen for cut {msg[1]} (gave it up)")
        elif kind == "thaw":
            self.end_cut()
        elif kind == "backup":  # a new backup's link: catch it up; its writes are bounded too
            self.lose_backup("")
            self.link = connection.Connection(reduction.recv_handle(c))
            self.backup_pid, self.backup_timeout = msg[1:]
            with socket.socket(fileno=os.dup(self.link.fileno())) as s:
                tv = struct.pack("ll", *divmod(int(self.backup_timeout * 1e6), 10**6))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self.catch_up()
        elif kind == "load":  # a checkpoint, before any worker joins (resume), or a restart's
            c.send_bytes(wire.loaded(*self.load(*msg[1:])))
        else:  # stop
            stats = shard.stats.as_dict() | {"version": shard.version}
            c.send_bytes(
                wire.stopped(stats | ({"digest": digest(shard.state_dict())} if self.link else {}))
            )
            return False
        return True

    def load(self, state: dict, logged: tuple | None, keep: tuple) -> tuple:
        """Loads ``state``: a checkpoint's, or a restart's, whose push log goes on (``logged``:
        ``(path, at, fsync)``; the dead workers depart, but ``keep``); returns (version, error)."""
        shard = self.shard
        if self.pipes:
            return None, "workers have joined; load before they do"
        try:
            self.write(shard.load_state_dict, state)
        except ValueError as e:  # refused before anything was written
            return None, str(e)
        if logged is None:
            shard.resume()  # the saved workers' next incarnations take their seats
        else:
            if logged[0]:
                self.begin_log(*logged)
            for w in shard.unresumed(keep=keep):
                got = committed_push(self.layout, self.records, self.pushes, w, self.k)
                self.write(shard.depart, w, int(shard.incarnation[w]), got)
            self.answer()  # the log's entries reach the OS
        if self.link is not None:
            self.catch_up()  # the backup starts again from the state loaded
        self.publish_now()
        return shard.version, None

    def join(self, w: int, inc: int) -> None:
        self.admit(reduction.recv_handle(self.control), w, inc)
        self.sync()  # the backup holds the join before the reply
        self.control.send_bytes(wire.joined(w, inc, int(self.shard.clocks[w])))

    def admit(self, fd: int, w: int, inc: int) -> None:
        """Incarnation ``inc`` of worker ``w`` joins on the pipe end ``fd`` (now the shard's),
        or takes its seat as it is (:meth:`Shard.seated`)."""
        p = WorkerPipe(fd, w, inc)
        old = self.current.get(w)
        if old is not None:
            self.depart(old)  # the old incarnation's committed push first, then it leaves
        try:
            if not self.shard.seated(w, inc):
                self.write(self.shard.join, w, inc)
        except ValueError as e:  # its seat left: refused, in one line
            with contextlib.suppress(OSError):
                p.write(wire.error(f"disconnected worker {w} ({inc}): {e}"))
            p.close()
            return
        self.pipes[p], self.current[w] = None, p


def shard_main(
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
    proc = ShardProcess(config, k, SharedBlock.attach(block_name), layout, control)
    proc.shard.warm_up()  # the JIT and the codec's kernels now, not at the first push
    proc.publish_now()
    control.send_bytes(wire.ready(k))
    serve(proc, join_timeout)


def serve(proc: ShardProcess, join_timeout: float) -> None:
    """The loop of shard ``proc``: one turn, then settle, until told to stop."""
    k, shard = proc.k, proc.shard
    lease_ends: float | None = time.monotonic() + join_timeout
    while True:
        deadlines = [d for d in (lease_ends, proc.expire_partial()) if d is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        if not proc.turn(timeout):
            proc.end_log()
            return
        if lease_ends is not None and time.monotonic() >= lease_ends:
            lease_ends = None
            gone = proc.write(shard.expire_unstarted)
            if gone:
                names = ", ".join(map(str, gone))
                log.error("shard %d: worker(s) %s did not start within %g s (join_timeout); the "
                          "gates no longer wait for them", k, names, join_timeout)  # fmt: skip
        proc.settle()


def backup_main(
    config: ServerConfig, k: int, block_name: str, layout: Layout, link, control, join_timeout
) -> None:
    """Body of shard ``k``'s backup process (replicas=2): a private copy of the shard that
    follows its primary on ``link`` (:class:`Backup`) until the parent says stop, or promotes
    it when the primary died: then it serves in the primary's place (:func:`serve`)."""
    named = not block_name.startswith("/proc/")  # unlinked if the parent dies (_shard_entry)
    die_with_parent(cleanup=lambda: named and os.unlink(block_name))  # (no prctl: threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
    child_logging(f"backup {k}")
    _keep_heap(True)  # else each payload's pages fault anew
    lo, hi = config.ranges[k]
    block = SharedBlock.attach(block_name)
    shard = config.build_shard(k, np.array(config.init[lo:hi]), layout.workers, layout.expected)
    shard.warm_up()  # (not within its primary's first wait: backup_timeout)
    control.send_bytes(wire.ready(k))
    try:
        promoted = follow(shard, push_regions(layout, block, lo, hi, k), link, control)
    except (wire.WireError, pushlog.LogError, ValueError) as e:
        log.error("backup %d: a bad message from its primary (%s); it stops", k, e)
        return  # the parent starts a new backup
    if promoted is not None:  # its state, and the load's log and seats
        proc = ShardProcess(config, k, block, layout, control)
        reply = proc.load(*promoted)
        del shard, promoted  # the backup's private copy: the shard serves the live params
        _keep_heap(False)
        control.send_bytes(wire.loaded(*reply))
        if reply[1] is None:
            serve(proc, join_timeout)


def _keep_heap(keep: bool) -> None:
    """A backup's glibc keeps the heap it frees; once promoted, gives it back (``malloc_trim``)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        size = 1 << 30 if keep else 128 << 10
        libc.mallopt(-1, size), libc.mallopt(-3, size)
        if not keep:
            libc.malloc_trim(0)


def follow(shard: Shard, regions: list, link, control) -> tuple | None:
    """The backup's loop: it holds a forward (payloads copied from the push ``regions``), says
    so, then applies it; returns None once stopped, once promoted its state and ``(log, keep)``."""
    backup, held = None, ("", 0)  # the push log and its bytes that the state is after
    bound = 8 * shard.params.nbytes * (len(regions) + 2) + (1 << 24)  # a turn's entries

    def take(body: bytes) -> None:  # a message on the link
        nonlocal backup, held
        msg, path, at = wire.decode_link(body)
        if isinstance(msg, CatchUp):
            backup, held = Backup(shard, msg), (path, at)
            reply = Held(backup.view, backup.entries)
        elif backup is None or not isinstance(msg, Forward):
            where = "on a backup's link" if backup else "before its catch-up"
            raise wire.WireError(f"a {type(msg).__name__} {where}")
        elif (reply := backup.hold(msg := with_payloads(msg, regions))) is not None:
            held = (path, at + sum(map(len, msg.entries[: backup.entries - msg.first])))
        with contextlib.suppress(OSError):  # else the primary died: EOF follows
            if reply is not None:
                link.send_bytes(wire.link(reply))

    while True:
        ready = wire.readable(
            [c for c in (control, link) if c], 0 if backup and backup.pending else None
        )
        if backup and (not ready or len(backup.pending) > 2):
            backup.apply()  # the link is quiet, or entries wait (their memory bounded)
        for c in (c for c in ready if c is control or c is link):  # (a drained link: closed)
            try:
                body = c.recv_bytes(None if c is control else bound)
            except (EOFError, OSError) as e:
                if c is control or not isinstance(e, EOFError | ConnectionResetError):
                    return  # stopped, or a message too long: the parent starts a new one
                link = link.close()  # the primary died: the parent promotes this copy
                continue
            if c is not control:
                take(body)
                continue
            msg = wire.decode_control(body)
            if msg[0] == "stats":  # how far it is, before its promotion (-1: no state):
                while link is not None:  # the dead primary's last forwards first, so the
                    try:  # log cut where it held them is the state it promotes
                        take(link.recv_bytes(bound))
                    except (EOFError, OSError):  # (an entry not held is in no state)
                        link = link.close()
                if backup:
                    backup.apply()
                at = {"version": shard.version if backup else -1, "held": held}
                control.send_bytes(wire.stats_reply(at))
                continue
            if backup:
                backup.apply()
            if msg[0] == "load" and backup:  # promoted: the primary's rule from here on
                return backup.promote().shard.state_dict(), *msg[2:]
            return control.send_bytes(wire.stopped({"digest": digest(shard.state_dict())}))


def with_payloads(fwd: Forward, regions: list) -> Forward:
    """``fwd``'s entries whole again: each payload left out copied from its worker's push region."""
    entries = []
    for e in fwd.entries:
        if len(e) < _REGION.size:
            raise wire.WireError(f"a forwarded entry of {len(e)} bytes")
        w, rest = _REGION.unpack_from(e)[0], memoryview(e)[_REGION.size :]
        if not -1 <= w < len(regions):
            raise wire.WireError(f"an entry tagged with worker {w}, of {len(regions)}")
        entries.append(b"".join((rest, memoryview(regions[w]).cast("B")) if w >= 0 else (rest,)))
    return fwd._replace(entries=tuple(entries))
