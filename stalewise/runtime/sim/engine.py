"""The simulator's discrete-event engine: one run's shards and workers on a virtual clock.

:class:`Simulation`: events in a heap of ``(virtual time, insertion counter, event)``; each
worker runs :func:`stalewise.protocol.loop.worker_loop`, each shard a FIFO queue (with
``replicas=2``, a primary and a backup). What is modelled: ``docs/calibrate.md``."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.protocol import PushHeader, ServerConfig, budget, compress, loop, pipeline, pulls
from stalewise.protocol import replica as rep
from stalewise.protocol.sender import Outgoing, Sender
from stalewise.runtime import driver
from stalewise.runtime.base import batch_iterator
from stalewise.runtime.errors import Failures, worker_failed
from stalewise.runtime.result import merge_stats
from stalewise.runtime.sim.config import MAX_RECORDS, SimConfig, TooLongError
from stalewise.runtime.sim.models import Join, Links, WorkerTiming

log = logging.getLogger(__name__)

# event kinds
_PULL_REQ, _SERVED, _PULL_HEAD, _PULL_RESP, _COMPUTED, _PUSH_HEAD, _PUSH_IN, _RACE = range(8)
_ACK, _LEAVE, _CPU = range(8, 11)  # _CPU: the next end of a compute's CPU time (contention)
_FORWARD, _BACKED, _CATCHUP = range(11, 14)  # between a shard's copies
_FAIL, _JOIN, _EVAL, _RESTART = range(14, 18)
_RECEIVER = {_ACK: "worker", _PULL_RESP: "worker", _FORWARD: "backup", _CATCHUP: "backup"}
_RECEIVER |= dict.fromkeys((_PULL_REQ, _PUSH_IN, _LEAVE, _BACKED), "primary")  # fault injection
_PULL, _PUSH = 0, 1  # request kinds at a shard
# what a worker's pull at shard k does once the shard has handled its push (_SimWorker.behind)
_ASK, _READ = 1, 2
# SimConfig.own_read's race: the n-th push draws frac(n * _GOLDEN + worker * _PLASTIC)
_GOLDEN, _PLASTIC = (math.sqrt(5) - 1) / 2, 0.7548776662466927
# worker phases (a push may be in flight meanwhile); _HELD: its push waits for the last acks
_IDLE, _PULLING, _COMPUTING, _HELD, _SETTLING, _DONE, _DEAD = range(7)
_GONE = object()  # what Simulation.send returns when the worker failed meanwhile


@dataclass(slots=True, eq=False)
class _SimWorker:
    """One worker id's state in a run, over its incarnations."""

    id: int
    sender: Sender  # its incarnation's sender (at first a new one's predecessor)
    pull_bytes: list[float]  # the wire size of each pull slice (model_bytes scaled)
    acks: list  # each shard's ack of the push in flight (None: not handled yet)
    behind: list[int]  # its pull at shard k waits for its push there: 0, _ASK or _READ
    joins: list[float] = field(default_factory=list)  # the times of its scripted joins
    inc: int = 0  # incarnation: events of an earlier life are dropped
    phase: int = _IDLE
    loop: Any = None  # the incarnation's protocol loop (a generator)
    loop_stats: Any = None  # the loop's stats, once it has ended
    payloads: list[bytearray] | None = None  # its push's payloads, one per shard
    push_bytes: list[float] | None = None  # the wire size of each slice of its push in flight
    replica: pulls.Replica | None = None  # the incarnation's copy (delta pulls)
    batches: Any = None  # its stream (a restart starts a new one)
    joined_at: int = 0  # the shards' clock for it when it (re)joined
    fresh: bool = True  # the incarnation's pulls may read snapshots (pipeline)
    settle: bool = False  # the computed step's push settles (pipeline)
    stepped: bool = False  # it has done a step (an error before one fails the job)
    pending: int = 0  # pull slices still to come
    acking: int = 0  # acks still to come for the push in flight
    results: list = field(default_factory=list)  # pushes acked, not yet answered
    outgoing: Outgoing | None = None  # the push committed, in flight
    pull_buf: np.ndarray | None = None  # the pull under way
    upd_buf: np.ndarray | None = None  # the push in flight
    next_buf: np.ndarray | None = None  # computed, not committed
    loss_next: float = math.nan  # the computed step's loss
    t_mark: float = 0.0  # when its pull or compute began
    cpu_free: float = 0.0  # when its copies under way end (SimConfig.copies)
    busy_end: float = 0.0  # contention: when its copies and its pull's latencies end
    push_mark: float = 0.0  # when the push in flight was committed
    ended: tuple[float, int] | None = None  # (time, order) when its loop ended
    awaiting: dict | None = None  # its failure event, until it is back
    out: Any = None  # replicas: its requests each primary has not answered (rep.Outstanding)


class Simulation:
    """The state of one simulated run; see the module docstring."""

    def __init__(
        self,
        config: ServerConfig,
        worker_fns: tuple,
        workers: int,
        steps: int,
        sim: SimConfig,
        timing: WorkerTiming,
        *,
        failures: Failures | None = None,
        diverge_after: int | None = loop.DIVERGE_AFTER,
        kill: tuple[str, int, str, int] | None = None,
    ):
        self.config, self.spec = config, config.spec
        self.loss_and_grad, self.data, self.strategy = worker_fns
        self.P, self.steps, self.sim, self.timing = workers, steps, sim, timing
        self.params = np.array(config.init, copy=True)
        self.ranges = config.ranges
        self.S = S = len(self.ranges)
        self.shards = [
            config.build_shard(k, self.params[lo:hi], workers)
            for k, (lo, hi) in enumerate(self.ranges)
        ]
        # model_bytes: every slice (and so every pull and push) scaled alike
        self.scale = sim.model_bytes / self.spec.nbytes if sim.model_bytes else 1.0
        self.slice_bytes = [(hi - lo) * self.params.itemsize * self.scale for lo, hi in self.ranges]
        # a push slice's wire size: with a codec, its shard's payload, of exactly this many bytes
        self.wire_bytes = list(self.slice_bytes)
        self.compressor = None
        if not compress.is_identity(config.codec):
            self.compressor = config.compressor()
            dtype = self.params.dtype
            self.wire_bytes = [self.compressor.nbytes(k, dtype, self.scale) for k in range(S)]
        # delta pulls (ServerConfig.pull_codec): a pull server beside each shard
        self.pull_servers = None
        if config.pull_codec is not None:
            self.pull_servers = [
                pulls.PullServer.for_shard(config, k, shard) for k, shard in enumerate(self.shards)
            ]
        self.pushed_bytes = 0.0  # bytes of every push slice sent (model_bytes scaled)
        self.pulled = [0.0, 0]  # bytes of every pull slice served (model_bytes scaled), slices
        self.links = Links(sim.network, workers, S)
        self.lat, self.service = sim.network.latency, sim.service
        self.own_read = sim.own_read
        self.contention, self.copies = sim.contention, sim.copies
        # contention: the workers copying or pulling (each once), their ends (heap of (end, id))
        self.busy_n, self.busy_ends = 0, []
        # contention: the computes share the cores; the work clock (CPU seconds each has had
        # by time cpu[1], at cpu[2] s a CPU second), their ends on it (heap), the plan's number
        self.cpu, self.cpu_heap, self.cpu_plan = [0.0, 0.0, 1.0], [], 0
        self.copying: list[float] = []  # copies: when each copy under way ends (heap)
        self.serving = 0  # shards serving a request
        self.gated = self.shards[0].consistency.gated
        # the verdict looks at the versions only with a max_staleness: else no need to tell it
        self.judging = config.staleness.max_staleness != math.inf
        self.heap: list[tuple] = []
        self.counter = itertools.count()
        self.now = self.end = 0.0
        self.busy: list[tuple | None] = [None] * S  # request in service at each shard
        self.queue: list[deque] = [deque() for _ in range(S)]
        self.waiting: list[list] = [[] for _ in range(S)]  # gated pulls: (clock, ctr, wk, inc)
        # what each shard last published for snapshot reads: params, version, when, slowest clock
        self.snaps = [[s.params.copy(), s.version, 0.0, s.min_clock()] for s in self.shards]
        dtype = self.params.dtype
        sends = (config.spec.segments, config.staleness, S, self.compressor)  # each id's Sender
        self.workers = [
            _SimWorker(w, Sender(*sends, dtype=dtype), [0.0] * S, [None] * S, [0] * S)
            for w in range(workers)
        ]
        for e in sorted(sim.joins, key=lambda e: e.time):
            self.workers[e.worker].joins.append(e.time)
        # by worker id, for the driver and batch_iterator: last loss, batches drawn
        self.last_loss = np.full(workers, np.nan)
        self.consumed = [0] * workers
        self.pool: list[np.ndarray] = []  # free parameter-sized buffers
        self.started = self.pushes = self.events = self.queued = 0
        self.ends = itertools.count()  # the order in which the workers' loops end
        self.totals = {"pull": 0.0, "push": 0.0, "compute": 0.0, "steps": 0}
        self.checkpointer: Any = None  # called after every event by run() when set
        self.diverged: dict[int, str] = {}  # worker -> why its loop raised loop.Diverged
        self.failures = Failures() if failures is None else failures  # the failure policy
        self.diverge_after = diverge_after  # for the worker loops
        self.returns = 0  # scripted joins and restarts still to come
        self.replicas = config.replicas > 1
        if self.replicas and self.pull_servers is not None:
            raise ValueError("replicas=2: the simulator does not replicate delta pulls yet; "
                             "leave pull_codec unset")  # fmt: skip
        self.primary = [rep.Primary(s) for s in self.shards] if self.replicas else []
        self.backups: list[rep.Backup | None] = [None] * S
        self.pid = [0] * S  # each shard's primary process: messages to or from a dead one drop
        self.chan, self.bfree = [0.0] * S, [0.0] * S  # primary-to-backup channel, backup free
        self.notices = rep.Outstanding(S)  # the launcher's joins, leaves, departs not yet held
        # the fault injector: ("worker" | "primary" | "backup", k, "in" | "out", m) dies before
        # its m-th message in or right after its m-th out; with it, messages by process, the
        # copies' logs, the pushes acknowledged (shard, worker, incarnation, seq)
        self.kill, self.received = kill, None if kill is None else Counter()
        self.dying: tuple | None = None  # killed as it sent: dies once its handler is over
        self.logs = None if kill is None else {("p", k): [] for k in range(S)}
        self.told: set[tuple[int, int, int, int]] = set()

    # -- plumbing ------------------------------------------------------------------

    def at(self, t: float, kind: int, w: int = -1, k: int = -1, inc: int = 0, x: float = 0.0):
        if kind < _FAIL:
            self.queued += 1  # work in flight (not an evaluation, failure or join)
        pid = self.pid[k] if k >= 0 else 0
        heapq.heappush(self.heap, (t, next(self.counter), kind, w, k, inc, x, pid))

    def transfer(
        self, src: int, dst: int, nbytes: float, head_kind: int, wk: _SimWorker, k: int, at=None
    ):
        head, tail = self.links.send(src, dst, nbytes, self.now if at is None else at)
        if self.links.instant(dst, nbytes, head, tail):
            self.at(head, head_kind + 1, wk.id, k, wk.inc)  # skip the ingress step
        else:
            self.at(head, head_kind, wk.id, k, wk.inc, tail)

    def take_buffer(self) -> np.ndarray:
        return self.pool.pop() if self.pool else np.empty(self.spec.size, self.params.dtype)

    # -- shards --------------------------------------------------------------------

    def enqueue(self, k: int, req: tuple) -> None:
        if self.busy[k] is None:
            self.serve(k, req)
        else:
            self.queue[k].append(req)

    def serve(self, k: int, req: tuple) -> None:
        if self.busy[k] is None:
            self.serving += 1
        self.busy[k] = req
        seconds, copy = self.service.seconds(self.slice_bytes[k]), 0.0
        if self.copies is not None and req[0] == _PUSH:  # the apply's copies, on the bus
            copy = self.copy(self.now, self.copies.apply, self.slice_bytes[k])
        seconds = self.stretched(seconds, copy, self.runnable())
        if self.contention is not None:
            self.replan()
        self.at(self.now + seconds, _SERVED, k=k)

    def copy(self, start: float, copies: float, nbytes: float) -> float:
        """Seconds of ``copies`` copies of ``nbytes`` from ``start``, sharing the memory bus."""
        h = self.copying
        while h and h[0] <= start:
            heapq.heappop(h)
        seconds = self.copies.seconds(copies, nbytes, len(h) + 1)
        heapq.heappush(h, start + seconds)
        return seconds

    def worker_copy(self, wk: _SimWorker, copies: float, nbytes: float, cpu: float) -> float:
        """When worker ``wk``'s copies of ``nbytes`` and ``cpu`` seconds besides end."""
        start = max(self.now, wk.cpu_free)
        seconds = self.stretched(cpu, self.copy(start, copies, nbytes), self.runnable(wk))
        if self.contention is not None:
            self.busy_until(wk, start + seconds)
        wk.cpu_free = start + seconds
        return wk.cpu_free

    def stretched(self, cpu: float, copy: float, n: int) -> float:
        """Seconds of ``cpu`` CPU seconds and ``copy`` seconds of copies with ``n`` runnable: at
        the contention factor, but a copy sharing a bus on ``copy_cores`` cores (what copies
        there cost each other) only at its wait for a core beyond them."""
        if self.contention is None:
            return cpu + copy
        c, at = self.copies, self.contention.apply_at
        shared = c is not None and c.bus < math.inf and c.cores < math.inf
        return cpu * at(n) + copy * (at(n) / at(min(n, c.cores)) if shared else at(n))

    def busy_until(self, wk: _SimWorker, end: float) -> None:
        """Worker ``wk`` runs until ``end`` (its copies, its pull): it starts now or goes on."""
        self.runnable()  # its last run's end is counted first
        if end > max(wk.busy_end, self.now):
            self.busy_n += wk.busy_end <= self.now
            wk.busy_end = end
            heapq.heappush(self.busy_ends, (end, wk.id))

    def runnable(self, wk: _SimWorker | None = None) -> int:
        """The processes runnable now (contention): workers computing, copying or pulling (one
        process each), shards serving; and worker ``wk``, if given and not counted yet."""
        h = self.busy_ends
        while h and h[0][0] <= self.now:
            end, w = heapq.heappop(h)
            self.busy_n -= self.workers[w].busy_end == end  # its last end: its run is over
        mine = wk is not None and wk.busy_end <= self.now
        return self.busy_n + len(self.cpu_heap) + self.serving + mine

    def replan(self, entry: tuple | None = None) -> None:
        """The computes (and ``entry``) at the factor for the runnable now: one ``_CPU`` event."""
        cpu, heap = self.cpu, self.cpu_heap
        cpu[0] += (self.now - cpu[1]) / cpu[2] if heap else 0.0
        cpu[1] = self.now
        if entry is not None:
            heapq.heappush(heap, (cpu[0] + entry[0], next(self.counter), *entry[1:]))
        self.cpu_plan += 1
        if heap:
            cpu[2] = self.contention.step_at(self.runnable())
            self.at(self.now + max(heap[0][0] - cpu[0], 0.0) * cpu[2], _CPU, x=self.cpu_plan)

    def served(self, k: int) -> None:
        kind, wk, inc = self.busy[k]
        if inc == wk.inc:
            if kind == _PULL:
                self.read(wk, k)
                self.publish(k)
            else:
                out = wk.outgoing
                header = PushHeader(wk.id, out.seq, out.bases[k], inc)
                wk.acks[k] = ack = self.shards[k].push(
                    header, self.sent(wk, k), verdict=out.verdict, now=self.now
                )
                if not ack.ok:
                    log.debug("sim: shard %d rejected worker %d's push: %s", k, wk.id, ack.reason)
                self.reply(k, (_ACK, wk, inc))
                self.release(k)
                self.publish(k)
                how, wk.behind[k] = wk.behind[k], 0
                if how == _ASK:  # its pull came behind the push: its turn now
                    self.ask(wk, k, inc)
                elif how == _READ:  # a snapshot read that waited for it (race): it holds it
                    self.read(wk, k, snapshot=True)
        q = self.queue[k]
        while q:
            req = q.popleft()
            if req[2] == req[1].inc:
                self.serve(k, req)
                return
        self.busy[k] = None
        self.serving -= 1
        if self.contention is not None:
            self.replan()

    def publish(self, k: int, *, force: bool = False) -> None:
        """Shard ``k`` after a turn copies its params out for snapshot reads when the protocol
        says so (``pipeline.publish_due``: a busy shard defers it), or ``force``."""
        shard, snap = self.shards[k], self.snaps[k]
        clock = shard.min_clock()
        due = pipeline.publish_due(shard.version, snap[1], busy=bool(self.queue[k]),
                                   clock_moved=clock != snap[3], since=self.now - snap[2])  # fmt: skip
        if force or due:
            np.copyto(snap[0], shard.params)
            snap[1], snap[2] = shard.version, self.now
        if snap[1] == shard.version:
            snap[3] = clock

    def read(self, wk: _SimWorker, k: int, snapshot: bool = False) -> None:
        """Shard ``k``'s slice goes to worker ``wk``: as it is now (served), or as it was last
        published (``snapshot``: a snapshot read)."""
        lo, hi = self.ranges[k]
        if self.pull_servers is None:
            out, snap, ack = wk.pull_buf[lo:hi], self.snaps[k], wk.acks[k]
            version = self.shards[k].pull(wk.id, out, now=self.now)
            # a read after a settled push holds it (the local client reads the version its ack
            # named: the published one, else the live params)
            held = 0 if ack is None or not wk.settle else ack.version
            if snapshot and snap[1] != version and snap[1] >= held:
                np.copyto(out, snap[0])
                version = snap[1]
            wk.sender.pulled(k, version)
            nbytes = self.slice_bytes[k]
        else:  # a delta pull: the worker's copy decodes the payload, the step gets its slice
            if wk.replica is None:  # a new incarnation starts with no copy
                wk.replica = pulls.Replica.for_job(self.config)
            pulled = self.pull_servers[k].pull(wk.id, wk.replica.have(k), now=self.now)
            wk.sender.pulled(k, wk.replica.apply(k, pulled.payload))
            np.copyto(wk.pull_buf[lo:hi], wk.replica.params[lo:hi])
            nbytes = pulled.nbytes(self.scale)
        wk.pull_bytes[k] = nbytes
        self.pulled[0] += nbytes
        self.pulled[1] += 1
        self.reply(k, (_PULL_RESP, wk, wk.inc, nbytes))

    def reply(self, k: int, message: tuple) -> None:
        """Shard ``k`` answers: at once, or (replicas) once its backup holds what it did."""
        for r in self.primary[k].reply(message) if self.replicas else (message,):
            self.respond(k, r)

    def respond(self, k: int, r: tuple) -> None:
        """Sends a reply of shard ``k`` that is free to go."""
        if r[0] == _LEAVE:  # a notice the backup holds
            self.notices.answered(k, r[1])
        elif r[2] != r[1].inc or not self.sends(("primary", k)):
            pass
        elif r[0] == _ACK:
            self.at(self.now + self.lat, _ACK, r[1].id, k, r[2])
        else:
            self.transfer(self.P + k, r[1].id, r[3], _PULL_HEAD, r[1], k)

    def notice(self, k: int, request: tuple) -> Any:
        """The launcher's ``("join" | "leave" | "depart", worker, incarnation[, committed])``
        at shard ``k``; returns its result (replicas: resent to a promoted primary until held)."""
        op, w, inc, *committed = request
        shard = self.shards[k]
        if op == "join":
            result = (self.primary[k] if self.replicas else shard).join(w, inc)
        elif op == "leave":
            result = shard.leave(w)
        else:
            result = shard.depart(w, inc, committed=committed[0])
        if self.replicas:
            self.notices.sent(k, request[:3], request)
            self.reply(k, (_LEAVE, request[:3]))
        return result

    def flush(self) -> None:
        """Forwards each primary's new entries to its backup (``replicas``)."""
        for k, primary in enumerate(self.primary):
            fwd = primary.forward()
            if fwd is None:
                continue
            if self.logs is not None:
                self.logs["p", k] += fwd.entries
            if primary.backed:
                self.channel(k, sum(map(len, fwd.entries)) * self.scale, _FORWARD, fwd)

    def channel(self, k: int, nbytes: float, kind: int, x: Any) -> None:
        """A message from shard ``k``'s primary to its backup, in order."""
        if not self.sends(("primary", k)):
            return
        t = max(self.now + self.lat + nbytes / self.links.bw[self.P + k], self.chan[k])
        self.chan[k] = t
        self.at(t, kind, k=k, x=x)

    def attach(self, k: int) -> None:
        """A new backup of shard ``k`` starts from its primary's state now."""
        start = self.primary[k].attach()
        self.backups[k] = None
        arrays = (v.nbytes for v in start.state.values() if isinstance(v, np.ndarray))
        self.channel(k, sum(arrays) * self.scale, _CATCHUP, start)

    def backup(self, k: int, start: rep.CatchUp) -> None:
        """Shard ``k``'s backup starts (caught up) at ``start``."""
        lo, hi = self.ranges[k]
        shard = self.config.build_shard(k, self.params[lo:hi].copy(), self.P)
        self.backups[k], self.bfree[k] = rep.Backup(shard, start), self.now
        if self.logs is not None:
            self.logs["b", k] = self.logs["p", k][: start.entries]

    def between(self, kind: int, k: int, x: Any) -> None:
        """A message between shard ``k``'s copies: a forward, its held, a catch-up."""
        primary, backup = self.primary[k], self.backups[k]
        if kind == _BACKED:
            for r in primary.held(x):
                self.respond(k, r)
        elif kind == _CATCHUP and x.view == primary.view:
            self.backup(k, x)
        elif kind == _FORWARD and backup is not None:
            new = x.entries[max(backup.entries - x.first, 0) :]
            if (held := backup.receive(x)) is None:
                return
            if self.logs is not None:
                self.logs["b", k] += new
            nbytes = sum(map(len, new)) * self.scale
            self.bfree[k] = t = max(self.now, self.bfree[k]) + self.service.seconds(nbytes)
            if self.sends(("backup", k)):
                self.at(t + self.lat, _BACKED, k=k, x=held)

    def race(self, wk: _SimWorker, k: int) -> None:
        """Worker ``wk``'s snapshot read at shard ``k`` racing its own push (``own_read``)."""
        p = self.own_read
        idle = self.wire_bytes[k] / self.links.bw[wk.id] + self.service.seconds(self.slice_bytes[k])
        if p <= 0.0 or idle <= 0.0:
            self.read(wk, k, snapshot=True)
            return
        wk.behind[k] = _READ
        if p < 1.0:  # else it always waits for the push
            u = (wk.sender.seq * _GOLDEN + wk.id * _PLASTIC) % 1.0
            self.at(self.now + idle / -math.log(p) * -math.log1p(-u), _RACE, wk.id, k, wk.inc)

    def ask(self, wk: _SimWorker, k: int, inc: int) -> None:
        """Worker ``wk``'s pull request at shard ``k``: it waits for the gate, then queues."""
        shard = self.shards[k]
        if self.gated and not shard.may_start(wk.id):
            entry = (int(shard.clocks[wk.id]), next(self.counter), wk, inc)
            heapq.heappush(self.waiting[k], entry)
        else:
            self.enqueue(k, (_PULL, wk, inc))

    def release(self, k: int) -> None:
        """Lets through the gated pulls shard ``k``'s gate now allows (smallest clock first)."""
        h = self.waiting[k]
        if not h:
            return
        shard = self.shards[k]
        floor = shard.min_clock()
        while h:
            clock, _, wk, inc = h[0]
            if inc != wk.inc:
                heapq.heappop(h)
                continue
            if not (
                shard.may_start(wk.id)
                if shard.hybrid
                else shard.consistency.may_start(clock, floor)
            ):
                return
            heapq.heappop(h)
            self.enqueue(k, (_PULL, wk, inc))

    def failover(self, k: int) -> None:
        """Shard ``k``'s primary died: its backup serves, the launcher's notices and each
        worker's unanswered requests are resent to it, and a new backup catches up."""
        backup = self.backups[k]
        if backup is None:
            raise RuntimeError(f"shard {k}: its primary died before a backup caught up")
        log.info("sim: shard %d's primary died at t=%.6g; its backup serves", k, self.now)
        self.pid[k] += 1
        self.serving -= self.busy[k] is not None
        self.busy[k], self.waiting[k] = None, []
        self.queue[k].clear()
        primary = self.primary[k] = backup.promote()
        self.shards[k] = primary.shard
        self.publish(k, force=True)
        if self.logs is not None:
            self.logs["p", k] = self.logs.pop(("b", k))
        for request in self.notices.resend(k):
            self.notice(k, request)
        for wk in self.workers:
            wk.behind[k] = 0
            for kind in wk.out.resend(k) if wk.out is not None else ():
                if kind == _PUSH_HEAD:
                    wk.acks[k] = None
                    self.transfer(wk.id, self.P + k, wk.push_bytes[k], _PUSH_HEAD, wk, k)
                else:
                    self.at(self.now + self.lat, kind, wk.id, k, wk.inc)
        self.attach(k)

    def boundary(self, kind: int, w: int, k: int, inc: int, x: Any) -> bool:
        """A message arrives (fault injection): counts it; True if its process dies first."""
        role = _RECEIVER.get(kind)
        if role is None or (w >= 0 and inc != self.workers[w].inc) or (role == "worker" and x):
            return False  # not a message; to or from an earlier life; a worker's copy of one
        name = (role, w if role == "worker" else k)
        return self.counts(name, "in") and self.die(name)

    def counts(self, name: tuple, way: str) -> bool:
        """Counts a message of process ``name``; True if the fault injector kills it there."""
        m = self.received[(*name, way)]
        self.received[(*name, way)] = m + 1
        if (*name, way, m) != self.kill:
            return False
        self.kill = None
        return True

    def sends(self, name: tuple) -> bool:
        """Whether process ``name`` sends now (fault injection: not once killed or ``dying``)."""
        if self.received is None:
            return True
        if self.dying == name:
            return False
        if self.counts(name, "out"):
            self.dying = name
        return True

    def die(self, name: tuple) -> bool:
        """Process ``name`` dies now: what the launcher does then."""
        self.dying, (role, k) = None, name
        if role == "primary":
            self.failover(k)
        elif role == "backup":
            for r in self.primary[k].detach():
                self.respond(k, r)
            self.attach(k)
        elif self.workers[k].phase == _DONE:
            self.depart(self.workers[k])
        else:
            self.fail(self.workers[k], "killed (fault injection)")
        if self.replicas:
            self.flush()
        return True

    # -- workers ---------------------------------------------------------------------

    def send(self, wk: _SimWorker, answer: Any) -> Any:
        """Answers worker ``wk``'s loop; returns its next request, None when the loop
        ended (the budget is spent, or it diverged), or ``_GONE`` when the worker failed."""
        try:
            return wk.loop.send(answer)
        except StopIteration as stop:
            wk.loop_stats = stop.value
            return None
        except loop.Diverged as e:  # the loop has ended: the worker stops pushing and leaves
            self.diverged[wk.id] = str(e)
            self.failures.diverged(wk.id, str(e), time=self.now)  # never restarted
            return None
        except Exception as e:
            self.crash(wk, e)
            return _GONE

    def start_loop(self, wk: _SimWorker) -> None:
        """Starts a new loop for worker ``wk``'s new incarnation (it asks BEGIN at once)."""
        w, cfg = wk.id, self.config
        wk.sender = wk.sender.successor()
        wk.joined_at = max(int(shard.clocks[w]) for shard in self.shards)
        wk.fresh = pipeline.reads_snapshots(cfg, incarnation=wk.inc, joined_at=wk.joined_at)
        wk.results, wk.loop_stats, wk.replica = [], None, None
        try:
            if wk.batches is None:
                wk.batches = batch_iterator(self.data, w, self.P, drawn=self.consumed)
        except Exception as e:
            self.crash(wk, e)
            return
        wk.loop = gen = loop.worker_loop(self.strategy, self.loss_and_grad, wk.batches, worker=w,
                                         diverge_after=self.diverge_after)  # fmt: skip
        next(gen)  # runs to the first BEGIN
        self.start_step(wk)

    def start_step(self, wk: _SimWorker) -> None:
        """Answers the loop's BEGIN: a step starts while the job's budget lasts."""
        request = self.send(wk, self.may_begin(wk))
        if request is _GONE:
            return
        if request is None:  # the loop has ended: the worker leaves the job
            wk.phase, wk.loop = _DONE, None
            wk.ended = (self.now, next(self.ends))
            if not wk.acking:  # else it leaves once its last push is acked
                self.leave(wk)
            return
        self.started += 1  # the loop asks to PULL
        wk.phase, wk.pending, wk.t_mark = _PULLING, self.S, self.now
        wk.pull_buf = self.take_buffer()
        # the pipelining rule: the newest snapshots, or requests behind the push in flight
        snapshot = wk.fresh and pipeline.may_read(
            self.shards[0].consistency, wk.sender.seq, (s.min_clock() for s in self.shards)
        )
        lat = self.lat
        if self.contention is not None:  # the pull's two latencies, stretched: it runs too
            lat += 2 * lat * (self.contention.step_at(self.runnable(wk)) - 1)
            self.busy_until(wk, self.now + lat + self.lat)
        start = max(self.now, wk.cpu_free)  # after the copies of its push
        for k in range(self.S):
            if self.request(wk, k, _PULL_REQ):
                self.at(start + lat, _PULL_REQ, wk.id, k, wk.inc, float(snapshot))

    def request(self, wk: _SimWorker, k: int, kind: int) -> bool:
        """Whether worker ``wk``'s request ``kind`` to shard ``k`` leaves (fault injection)."""
        if wk.out is not None:
            wk.out.sent(k, kind, kind)
        return self.sends(("worker", wk.id))

    def leave(self, wk: _SimWorker) -> None:
        """Worker ``wk``'s loop has ended and its last push is acked: it leaves the shards."""
        for k in range(self.S):
            if self.request(wk, k, _LEAVE):
                self.at(self.now + self.lat, _LEAVE, wk.id, k, wk.inc)

    def compute(self, wk: _SimWorker) -> None:
        """Every slice is in: the loop runs the strategy step, the compute time starts."""
        self.totals["pull"] += self.now - wk.t_mark
        params = tree.unflatten(wk.pull_buf, self.spec)
        try:
            request = wk.loop.send(params)
            if request is loop.CLOCK:  # a strategy pacing itself asks the clock: virtual time
                request = wk.loop.send(self.now)
            # the step has run: a Push (answered at its acks, so its settle holds already)
            update, loss, local_steps = request[:3]
            if local_steps < 0:
                raise ValueError(f"the strategy step reported local_steps={local_steps} (< 0)")
            wk.next_buf = out = self.take_buffer()
            tree.flatten(update, spec=self.spec, out=out)
            wk.settle = pipeline.answer_at_acks(request)
        except Exception as e:
            self.crash(wk, e)
            return
        wk.stepped = True
        self.pool.append(wk.pull_buf)
        wk.pull_buf = None
        wk.loss_next = loss
        wk.phase, wk.t_mark = _COMPUTING, self.now
        timing, p = self.timing, self.timing.paces[wk.id]
        if self.contention is None:
            self.at(timing.finish(wk.id, self.now, local_steps), _COMPUTED, wk.id, inc=wk.inc)
        else:  # its CPU time shares the cores (a slowdown: its factor at the start scales it)
            base = timing.draw(wk.id, local_steps)
            f = math.prod(s.factor for s in p.slowdowns if s.start <= self.now < s.end)
            work = timing.cpu_work(wk.id, base) * f
            self.replan((work, wk, wk.inc, base, work, local_steps))

    def sent(self, wk: _SimWorker, k: int) -> Any:
        """What shard ``k`` receives of worker ``wk``'s push: its slice, or its payload."""
        if self.compressor is not None:
            return wk.payloads[k]
        lo, hi = self.ranges[k]
        return wk.upd_buf[lo:hi]

    def computed(self, wk: _SimWorker) -> None:
        """The step's compute time is over: push, once the last push is acked (IN_FLIGHT)."""
        self.totals["compute"] += self.now - wk.t_mark
        if wk.acking:
            wk.phase = _HELD
            return
        self.push(wk)

    def push(self, wk: _SimWorker) -> None:
        """Commits the update (one verdict for every shard) and sends each shard its slice;
        the loop goes on at once, or at the acks of a settling push (pipeline)."""
        wk.upd_buf, wk.next_buf = wk.next_buf, None
        sender = wk.sender
        if self.compressor is not None:  # the payloads are free: the last push is acked
            dtype = self.params.dtype
            if wk.payloads is None:  # kept from push to push, one per shard
                wk.payloads = [bytearray(self.compressor.nbytes(k, dtype)) for k in range(self.S)]
            try:
                sender.encode(wk.upd_buf, wk.payloads)
            except Exception as e:
                self.crash(wk, e)
                return
            # a segment push (fragments, zero leaves) sends its pieces only
            wk.push_bytes = [sender.sent_nbytes(k, dtype, self.scale) for k in range(self.S)]
        else:
            wk.push_bytes = self.wire_bytes
        self.pushed_bytes += sum(wk.push_bytes)
        self.pushes += 1
        self.last_loss[wk.id] = wk.loss_next
        if self.judging:  # what the sender knows: exact here
            for k, shard in enumerate(self.shards):
                sender.observed(k, shard.version)
        # judged once (payloads decoded back into the update's buffer), then committed
        wk.outgoing = sender.judge(wk.upd_buf, into=wk.upd_buf)
        sender.committed()
        wk.acks = [None] * self.S
        wk.acking, wk.push_mark = self.S, self.now
        c, at = self.copies, None  # with copies: the slices leave once the worker encoded all
        for k in range(self.S if c is not None else 0):  # (the parameters', whatever is sent)
            at = self.worker_copy(wk, c.push, self.slice_bytes[k], c.push_time / self.S)
        for k in range(self.S):
            if self.request(wk, k, _PUSH_HEAD):
                self.transfer(wk.id, self.P + k, wk.push_bytes[k], _PUSH_HEAD, wk, k, at)
        if wk.settle:
            wk.phase = _SETTLING
            return
        self.answer(wk)

    def answer(self, wk: _SimWorker) -> None:
        """The loop goes on: it gets the results acked since its last answer and asks BEGIN."""
        wk.phase = _IDLE
        results, wk.results = wk.results, []
        if self.send(wk, results) is not _GONE:
            self.start_step(wk)

    def acked(self, wk: _SimWorker) -> None:
        """Every ack of the push in flight is in: its result goes to the loop with the next
        answer; a held push is committed now, a settling one's loop goes on."""
        self.totals["push"] += self.now - wk.push_mark
        self.totals["steps"] += 1
        self.pool.append(wk.upd_buf)
        wk.upd_buf = None
        wk.results.append(wk.sender.result(wk.acks))
        if wk.phase == _HELD:
            self.push(wk)
        elif wk.phase == _SETTLING:
            self.answer(wk)
        elif wk.phase == _DONE:  # the loop has ended: its last push's result, then it leaves
            results, wk.results = wk.results, []
            if wk.loop_stats is not None:
                loop.report(results, wk.loop_stats, wk.id)
            self.leave(wk)

    def fail(self, wk: _SimWorker, cause: str = "scripted failure (SimConfig.failures)") -> None:
        """A failure of worker ``wk`` (``SimConfig.failures``, or ``kill``)."""
        if wk.phase in (_DEAD, _DONE):
            return
        log.info("sim: worker %d fails at t=%.6g", wk.id, self.now)
        self.depart(wk)
        back = next((t for t in wk.joins if t >= self.now), None)
        if back is None:
            self.policy(wk, cause)
            return
        # the script says when it is back: away until that join, whatever the policy
        event = dict(worker=wk.id, time=self.now, cause=cause, action="left", rejoin=back)
        self.failures.events.append(event)
        wk.awaiting = event

    def crash(self, wk: _SimWorker, error: Exception) -> None:
        """The user's code raised ``error`` in worker ``wk`` (call it in the ``except`` block);
        WorkerError before worker id ``wk`` has done a step, or as the policy decides."""
        detail = traceback.format_exc()
        if not wk.stepped:
            raise worker_failed(wk.id, detail, f"{type(error).__name__}: {error}") from None
        self.depart(wk)
        self.policy(wk, f"raised {type(error).__name__}: {error}", detail)

    def policy(self, wk: _SimWorker, cause: str, detail: str = "") -> None:
        """Applies the failure policy to worker ``wk``, which has just departed."""
        if self.failures.worker(wk.id, cause, time=self.now, detail=detail) == "restart":
            wk.awaiting = self.failures.events[-1]
            wk.batches = None  # the new incarnation continues its id's stream
            self.returns += 1
            self.at(self.now + self.sim.restart_delay, _RESTART, wk.id, inc=wk.inc)

    def restarting(self, w: int) -> bool:
        """Whether worker ``w`` is down, waiting for its restart."""
        event = self.workers[w].awaiting
        return event is not None and event["action"] == "restarted"

    def depart(self, wk: _SimWorker) -> None:
        """Worker ``wk``'s incarnation ends now: it leaves every shard, which first
        delivers a push it had committed, and its messages in flight are dropped."""
        if wk.phase in (_PULLING, _COMPUTING, _HELD):
            self.started -= 1  # nothing was committed: the step is not done
        flying, wk.acking = wk.acking, 0
        wk.behind, wk.results, wk.phase, wk.out = [0] * self.S, [], _DEAD, None
        if wk.loop is not None:
            wk.loop.close()
            wk.loop = None
        out, delivered = wk.outgoing, []
        for k in range(self.S):
            committed = None
            if flying:  # committed: shards that have not handled it get it now
                header = PushHeader(wk.id, out.seq, out.bases[k], wk.inc)
                payload = self.sent(wk, k)  # a copy: it may be resent to a promoted primary
                committed = (header, payload.copy() if self.replicas else payload, out.verdict)
            if self.notice(k, ("depart", wk.id, wk.inc, committed)) is not None:
                delivered.append(k)
            self.release(k)
        if delivered:
            msg = "sim: worker %d's committed push %d delivered to shard(s) %s at its failure"
            log.info(msg, wk.id, out.seq, delivered)
        wk.inc += 1  # the push's messages still in flight are dropped: exactly once
        self.pool += [b for b in (wk.pull_buf, wk.upd_buf, wk.next_buf) if b is not None]
        wk.pull_buf = wk.upd_buf = wk.next_buf = None
        wk.sender.abandoned()  # a push encoded, never committed: the residual stays

    def rejoin(self, wk: _SimWorker) -> None:
        """Worker ``wk`` comes back as a new incarnation (a scripted join or a restart)."""
        wk.inc += 1
        self.diverged.pop(wk.id, None)  # a new incarnation, with a new loop
        event, wk.awaiting = wk.awaiting, None
        wk.out = rep.Outstanding(self.S) if self.replicas else None
        for k in range(self.S):
            self.notice(k, ("join", wk.id, wk.inc))
        self.start_loop(wk)
        if event is not None and wk.phase != _DEAD:
            event["recovered"] = self.now

    # -- checkpoints -------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """The simulator's own state for a checkpoint (JSON-able), beside the shards' states."""
        # a worker waiting for its restart is live: a resumed run restarts it at once
        dead = [wk.phase == _DEAD and not self.restarting(wk.id) for wk in self.workers]
        in_flight = 0  # committed, not yet handled by every shard: lost to a resume
        for wk in self.workers:
            seats = ((int(s.incarnation[wk.id]), int(s.next_seq[wk.id])) for s in self.shards)
            in_flight += max(wk.sender.seq - budget.handled(wk.inc, wk.sender.seq, seats), 0)
        return {
            "now": self.now,
            "pushes": self.pushes - in_flight,  # as budget.held counts them
            "quiescent": not self.queued
            and all(wk.phase in (_DONE, _DEAD) for wk in self.workers)
            and not any(map(self.restarting, range(self.P))),
            "phase": ["dead" if d else "live" for d in dead],
            "ended": [None if wk.ended is None else list(wk.ended) for wk in self.workers],
            "consumed": list(self.consumed),
            "last_loss": [None if math.isnan(x) else float(x) for x in self.last_loss],
            "rngs": self.timing.rng_states(),
            "egress": list(self.links.egress),
            "ingress": list(self.links.ingress),
            "totals": dict(self.totals),
            "events": self.events,
        }

    def residuals(self) -> list[np.ndarray] | None:
        """Each worker id's residual after its last committed push (None: the codec keeps none)."""
        comp = self.compressor
        if comp is None or not comp.error_feedback:
            return None
        return [wk.sender.residual for wk in self.workers]

    def restore(
        self, states: list[dict], saved: dict[str, Any], feedback: list[Any] | None = None
    ) -> list[tuple[float, int]]:
        """Loads a checkpoint (shard states, :meth:`checkpoint_state`, the workers' error
        feedback) before :meth:`run`; returns the ``(time, worker)`` starts."""
        for shard, state in zip(self.shards, states, strict=True):
            shard.load_state_dict(state)
            shard.resume()
        if feedback is not None and self.compressor is not None:
            for wk, f in zip(self.workers, feedback, strict=True):
                np.copyto(wk.sender.residual, f.residual)  # each id goes on with its residual
        self.now = self.end = float(saved["now"])
        for k in range(self.S):
            self.publish(k, force=True)
        self.pushes = self.started = int(saved["pushes"])
        self.consumed = [int(n) for n in saved["consumed"]]  # each stream skips as many
        self.last_loss[:] = [math.nan if x is None else x for x in saved["last_loss"]]
        self.timing.load_rng_states(saved["rngs"])
        self.links.egress[:] = saved["egress"]
        self.links.ingress[:] = saved["ingress"]
        self.totals.update(saved["totals"])
        self.events = int(saved["events"])
        for wk in self.workers:  # new incarnations, above every shard's
            wk.inc = max(int(s.incarnation[wk.id]) for s in self.shards)
        if saved["quiescent"]:
            starts = [(e[0], e[1], w) for w, e in enumerate(saved["ended"]) if e is not None]
        else:
            live = [w for w, p in enumerate(saved["phase"]) if p == "live"]
            starts = [(self.now, w, w) for w in live]
        started = {x[2] for x in starts}
        for wk in self.workers:
            if wk.id not in started:
                wk.phase = _DEAD
        return [(t, w) for t, _, w in sorted(starts)]

    # -- the loop ------------------------------------------------------------------

    def begin(self, eval_interval: float, starts: list[tuple[float, int]] | None = None) -> None:
        """Schedules the scripted failures and joins and starts the loops (``starts``: resumed)."""
        t0, self.eval_interval, self.evals, self.eval_at = self.now, eval_interval, 0, None
        if starts is None:
            absent = self.sim.absent_at_start()
            for w in sorted(absent):
                self.workers[w].phase = _DEAD
                for k in range(self.S):
                    self.notice(k, ("leave", w, 0))
        events = [e for e in self.sim.failures + self.sim.joins if e.time >= t0]
        for e in sorted(events, key=lambda e: e.time):
            self.at(e.time, _JOIN if isinstance(e, Join) else _FAIL, e.worker)
        self.returns += sum(isinstance(e, Join) for e in events)
        if starts is None:
            starts = [(t0, w) for w in range(self.P) if w not in absent]
        for t, w in starts:  # each a new incarnation: the first is 1
            self.now = t
            self.rejoin(self.workers[w])
        self.now = t0
        self.flush()
        for k, primary in enumerate(self.primary):  # each backup starts with the job
            self.backup(k, primary.attach())

    def advance(self, until: float, deadline: float, due: Callable[[], bool] | None = None) -> str:
        """Runs events up to the record time ``until``; returns ``RECORD`` there, ``CHECKPOINT``
        once ``due()`` says so, or ``END`` when the run is over. TooLongError: more than
        ``MAX_RECORDS`` evaluation times; TimeoutError: past the wall-clock ``deadline``."""
        if until <= self.now:
            return driver.RECORD
        if self.eval_at != until:
            self.eval_at = until
            self.at(until, _EVAL)
        heap, pop, workers = self.heap, heapq.heappop, self.workers
        while heap:
            t, _, kind, w, k, i, x, e = pop(heap)
            self.now = t
            if kind < _FAIL:
                self.queued -= 1
            if k >= 0 and kind < _FORWARD and e != self.pid[k]:
                continue  # to or from a dead primary
            if self.received is not None and self.boundary(kind, w, k, i, x):
                continue  # its process died before it
            if kind == _SERVED:
                self.served(k)
            elif kind == _CPU:  # bookkeeping, not counted: ends the CPU times that are over
                if x == self.cpu_plan:  # (else replanned since); they sleep what is left
                    self.replan()
                    while (h := self.cpu_heap) and h[0][0] <= self.cpu[0] * (1 + 1e-12):
                        _, _, wk, inc, base, work, steps = heapq.heappop(h)
                        if inc == wk.inc and wk.phase == _COMPUTING:
                            wake = self.contention.wake_at(self.runnable() + 1)
                            g = (t - wk.t_mark) / work if work > 0 else 1.0
                            rest = self.timing.rest(wk.id, base, steps, g, wake)
                            end = self.timing.finish(wk.id, t, work=rest)
                            self.at(end, _COMPUTED, wk.id, inc=wk.inc)
                    self.replan()
                continue
            elif kind == _EVAL:
                self.eval_at = None
                if self.idle():
                    break
                self.evals += 1
                if self.evals > MAX_RECORDS:
                    raise TooLongError(t, self.eval_interval, self.pushes, self.steps, MAX_RECORDS)
                if time.perf_counter() > deadline:  # cheap next to a record
                    raise TimeoutError(f"simulation did not finish within the timeout (t={t:.6g})")
                return driver.RECORD
            elif _FORWARD <= kind < _FAIL:
                self.between(kind, k, x)
            elif kind >= _FAIL:
                wk = workers[w]
                idle = self.idle()  # this join or restart counts: it may bring work
                self.returns -= kind != _FAIL
                if idle or (kind == _RESTART and i != wk.inc):
                    continue  # the job is over, or the worker is back already (a join)
                if kind == _FAIL:
                    self.fail(wk)
                elif kind == _JOIN and wk.phase not in (_DEAD, _DONE):
                    log.debug("sim: worker %d joins at t=%.6g but is live; ignored", w, t)
                else:  # back by a scripted join or a restart
                    how = "joins" if kind == _JOIN else "restarts"
                    log.info("sim: worker %d %s at t=%.6g", w, how, t)
                    self.rejoin(wk)
            elif i != (wk := workers[w]).inc:
                continue  # a message of (or to) an earlier life of worker w
            elif kind == _PULL_REQ:
                unhandled = wk.acking and wk.acks[k] is None  # its push, at shard k
                if x and unhandled and self.own_read is not None:
                    self.race(wk, k)
                elif x:  # the newest snapshot (pipeline.may_read): no queue at the shard
                    self.read(wk, k, snapshot=True)
                elif unhandled:
                    wk.behind[k] = _ASK  # behind its push, which shard k has not handled
                else:
                    self.ask(wk, k, i)
            elif kind == _RACE:
                if wk.behind[k] == _READ:  # its push was not handled in time: the read misses it
                    wk.behind[k] = 0
                    self.read(wk, k, snapshot=True)
            elif kind == _PULL_HEAD:
                self.at(self.links.receive(w, wk.pull_bytes[k], t, x), _PULL_RESP, w, k, i)
            elif kind == _PUSH_HEAD:
                self.at(self.links.receive(self.P + k, wk.push_bytes[k], t, x), _PUSH_IN, w, k, i)
            elif kind == _PULL_RESP and self.copies is not None and not x:  # the worker copies it
                c = self.copies
                done = self.worker_copy(wk, c.pull, self.slice_bytes[k], c.pull_time / self.S)
                self.at(done, _PULL_RESP, w, k, i, 1.0)
            elif kind == _PULL_RESP:
                if wk.out is not None:
                    wk.out.answered(k, _PULL_REQ)
                wk.pending -= 1
                if not wk.pending:
                    self.compute(wk)
            elif kind == _ACK:
                if wk.out is not None:
                    wk.out.answered(k, _PUSH_HEAD)
                if self.logs is not None and wk.acks[k].ok:
                    self.told.add((k, w, i, wk.acks[k].seq))
                wk.acking -= 1
                if not wk.acking:
                    self.acked(wk)
            elif kind == _COMPUTED:
                self.computed(wk)
            elif kind == _PUSH_IN:
                self.enqueue(k, (_PUSH, wk, i))
            elif kind == _LEAVE:
                if wk.out is not None:
                    wk.out.answered(k, _LEAVE)
                self.notice(k, ("leave", w, i))
                if self.pull_servers is not None:
                    self.pull_servers[k].forget(w)  # its reference: the worker has left
                self.release(k)
            if self.replicas:
                self.flush()
            if self.dying is not None:
                self.die(self.dying)
            self.end = t
            self.events += 1
            if not self.events & 0xFFF and time.perf_counter() > deadline:
                raise TimeoutError(f"simulation did not finish within the timeout (t={t:.6g})")
            if due is not None and due():
                return driver.CHECKPOINT
        self.now = self.end
        return driver.END

    def run(self, record: Callable[[], bool], eval_interval: float, deadline: float,
            starts: list[tuple[float, int]] | None = None) -> bool:  # fmt: skip
        """Runs the whole simulation without a driver; returns whether ``record`` said stop."""
        self.begin(eval_interval, starts)
        hook = self.checkpointer
        after = None if hook is None else (lambda: hook(self))  # returns None: runs on
        k = math.floor(self.now / eval_interval)
        while not record():
            k += 1
            if self.advance(k * eval_interval, deadline, after) == driver.END:
                return False
        return True

    def idle(self) -> bool:
        """No work in flight, and no join or restart that could bring more (or no budget)."""
        return not self.queued and not (self.returns and self.may_begin())

    def may_begin(self, wk: _SimWorker | None = None) -> bool:
        """The budget rule with exact counts; under BSP in whole rounds of the shards' round."""
        if wk is not None and self.config.consistency.averages_rounds:
            shards = max(s.min_clock() for s in self.shards)
            r = budget.round_of(wk.joined_at + wk.sender.seq, shards)
            return budget.may_begin_round(r, self.P, self.steps)
        return budget.may_begin(self.pushes, self.started - self.pushes, self.steps)

    def stats(self, *, settled: bool = False) -> dict[str, Any]:
        """The shards' merged counters; ``settled``: no push is in flight (checks they agree)."""
        per_shard = [s.stats.as_dict() | {"version": s.version} for s in self.shards]
        return merge_stats(per_shard, settled=settled)
