"""The simulator's discrete-event engine: one run's shards and workers on a virtual clock.

:class:`Simulation` holds the state of one run of :func:`stalewise.runtime.sim.train`.
Events sit in a heap of ``(virtual time, insertion counter, event)`` entries,
so ties are broken by the order in which events were scheduled and a run is
deterministic.

Each worker runs the protocol's one worker loop
(:func:`stalewise.protocol.loop.worker_loop`), a generator the event handlers
step with ``send``, so the simulator runs the very loop the local runtime runs:

* ``BEGIN`` (a worker starts a step): answered by the budget rule
  (:mod:`stalewise.protocol.budget`): pushes committed plus steps under way
  (``started``, both exact here) below ``steps``; False ends the loop and the
  worker leaves the shards.
* ``PULL``: as the pipelining rule says (:mod:`stalewise.protocol.pipeline`,
  the local runtime's rule too), either a *snapshot read*: when the worker's own
  count of committed pushes (the one in flight included) passes every shard's
  gate, each shard's slice as it is when the request arrives, with no queueing
  at the shard (a local worker reads the published snapshot in shared memory),
  so it may lack the worker's push still in flight; or a *request* behind that
  push: each shard takes it once it has handled the push, checks its gate
  (``Shard.may_start``; a blocked pull waits at the shard and is re-checked
  after every applied push or leave) and queues it behind the requests already
  waiting (one FIFO server per shard, service time from
  :class:`~stalewise.runtime.sim.models.Service`). Either way the slice goes
  back over the links. With every slice in, the loop gets the params tree and
  runs the strategy step for real, at once, on the snapshot it got. With a pull
  codec (``ServerConfig.pull_codec``) the slice is a delta pull
  (:mod:`stalewise.protocol.pulls`): the shard's pull server encodes it, the
  worker's copy decodes it, and it costs its payload's exact byte count.
* ``Push``: after the virtual compute time of the step's ``local_steps``
  minibatches, and once the worker's previous push is acknowledged (one push in
  flight, ``pipeline.IN_FLIGHT``), the worker commits the push
  (:mod:`stalewise.protocol.commit`: the whole update is judged once, against
  the versions it pulled and each shard's version at that instant) and sends
  every shard its slice with that verdict; each shard queues, serves and
  handles the push and acks it. A gradient push is answered at once, with the
  results of the pushes acknowledged since the last answer, and the next step's
  pull overlaps it; a settling push (model averaging) is answered with its
  :class:`~stalewise.protocol.PushResult` once every ack is in.
  With a codec (``ServerConfig.codec``), the update is encoded into one payload
  per shard (:class:`~stalewise.protocol.compress.Compressor`, with the
  worker's error feedback); each shard decodes its payload itself, as in the
  local runtime, and with several shards the verdict judges the payloads
  decoded, the values the shards apply. A push slice costs its payload's exact
  byte count (scaled by ``model_bytes``).

Faults: a worker that fails while pulling or computing pushes nothing (but a
push of its still in flight, committed before, is delivered). One
that fails after committing its push (while pushing) still delivers it to
every shard: the shards that have not handled it yet get it from
``Shard.depart`` at the instant of the failure, and the push's messages still
in flight are dropped, so it is applied exactly once everywhere or refused
everywhere, never torn. A (re)join starts a new incarnation, with a new loop
(and a fresh strategy state) whose sequence numbers start at 0; it keeps the
worker id's error-feedback residual as of its last committed push (a push
encoded but not committed when the worker failed takes its residual with it).

A worker fails by a scripted :class:`~stalewise.runtime.sim.models.Failure`
or when the user's code raises in it (its data, its strategy step); the job's
failure policy (:class:`~stalewise.runtime.base.Failures`, as in the local
runtime) then restarts it ``SimConfig.restart_delay`` virtual seconds later
(a new incarnation whose stream skips the batches its worker id has drawn),
drops it, or fails the job. Two exceptions: a scripted failure answered by a
later scripted :class:`~stalewise.runtime.sim.models.Join` of that worker
keeps it away until that join (the script says when it is back; no restart is
counted), and an error before a worker id's first step is done fails the job
whatever the policy (the local runtime's warm-up step finds the same bugs
before its clock starts). A worker whose loop raises ``loop.Diverged`` stops
and is not restarted.

Cost: O(log n) per event (heap) and O(1) per-worker state per event. Under
SSP/BSP a shard asks ``Shard.min_clock`` (O(1) amortised) once per pull request
and once per applied push, never once per waiting worker.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.protocol import PushHeader, ServerConfig, budget, compress, loop, pipeline, pulls
from stalewise.protocol.sender import Outgoing, Sender
from stalewise.runtime import driver
from stalewise.runtime.base import Failures, batch_iterator, merge_stats, worker_failed
from stalewise.runtime.sim.config import MAX_RECORDS, SimConfig, TooLongError
from stalewise.runtime.sim.models import Join, Links, WorkerTiming

log = logging.getLogger(__name__)

# event kinds
_PULL_REQ, _SERVED, _PULL_HEAD, _PULL_RESP, _COMPUTED, _PUSH_HEAD, _PUSH_IN = range(7)
_ACK, _LEAVE, _FAIL, _JOIN, _EVAL, _RESTART = range(7, 13)
# request kinds at a shard
_PULL, _PUSH = 0, 1
# worker phases (of its loop; a push of its may be in flight meanwhile: ``acking``)
# _HELD: its step is computed, its push waits for the last one's acks (pipeline.IN_FLIGHT);
# _SETTLING: its settling push is committed, the loop is answered at its acks
_IDLE, _PULLING, _COMPUTING, _HELD, _SETTLING, _DONE, _DEAD = range(7)
_GONE = object()  # what Simulation.send returns when the worker failed meanwhile


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
        self.push_bytes = [[0.0] * S for _ in range(workers)]  # wire size of each push slice
        # with a codec a push slice is its shard's payload, of exactly this many bytes
        self.compressor = None
        # each worker's sending side (one protocol Sender per incarnation; a new one takes
        # its predecessor's residual buffers), and the residuals a resumed run starts from
        self.senders: list[Sender | None] = [None] * workers
        self.joined_at = [0] * workers  # the shards' clock for a worker when it (re)joined
        self.feedback: list[Any] = [None] * workers
        self.payloads: list[Any] = [None] * workers  # each worker's payloads, one per shard
        self.wire_bytes = list(self.slice_bytes)
        if not compress.is_identity(config.codec):
            self.compressor = config.compressor()
            dtype = self.params.dtype
            self.wire_bytes = [self.compressor.nbytes(k, dtype, self.scale) for k in range(S)]
        # delta pulls (ServerConfig.pull_codec): a pull server beside each shard, and each
        # worker's copy (a pulls.Replica per incarnation); a pull slice costs its payload
        self.pull_servers = None
        if config.pull_codec is not None:
            self.pull_servers = [
                pulls.PullServer.for_shard(config, k, shard) for k, shard in enumerate(self.shards)
            ]
        self.replicas: list[tuple[int, pulls.Replica] | None] = [None] * workers
        self.pull_bytes = [list(self.slice_bytes) for _ in range(workers)]  # of each pull slice
        self.pulled = [0.0, 0]  # bytes of every pull slice served (model_bytes scaled), slices
        self.links = Links(sim.network, workers, S)
        self.lat, self.service = sim.network.latency, sim.service
        self.gated = self.shards[0].consistency.gated
        self.heap: list[tuple] = []
        self.counter = itertools.count()
        self.now = self.end = 0.0
        self.busy: list[tuple | None] = [None] * S  # request in service at each shard
        self.queue: list[deque] = [deque() for _ in range(S)]
        self.waiting: list[list] = [[] for _ in range(S)]  # gated pulls: (clock, ctr, w, inc)
        self.inc = [0] * workers  # incarnation: events of an earlier life are dropped
        self.loops: list[Any] = [None] * workers  # each worker's protocol loop (a generator)
        self.phase = [_IDLE] * workers
        self.pending = [0] * workers  # pull slices still to come
        self.acking = [0] * workers  # acks still to come for the push in flight
        self.fresh = [True] * workers
        self.settle = (
            [False] * workers
        )  # the computed step's push settles (pipeline)  # the incarnation's pulls may read snapshots (pipeline)
        self.behind: list[list[bool]] = [[False] * S for _ in range(workers)]  # pull behind push
        self.results: list[list] = [[] for _ in range(workers)]  # acked, not yet answered
        self.loop_stats: list[Any] = [None] * workers  # a loop's stats, once it has ended
        self.push_mark = [0.0] * workers  # when the push in flight was committed
        self.acks: list[list] = [[None] * S for _ in range(workers)]  # the push's acks
        self.outgoing: list[Outgoing | None] = [None] * workers  # the push committed, in flight
        # the verdict looks at the versions only with a max_staleness: else no need to tell it
        self.judging = config.staleness.max_staleness != math.inf
        self.pull_buf: list[np.ndarray | None] = [None] * workers
        self.upd_buf: list[np.ndarray | None] = [None] * workers  # the push in flight
        self.next_buf: list[np.ndarray | None] = [None] * workers  # computed, not committed
        self.pool: list[np.ndarray] = []  # free parameter-sized buffers
        self.batches: list[Any] = [None] * workers
        self.loss_next = [math.nan] * workers
        self.last_loss = np.full(workers, np.nan)
        self.t_mark = [0.0] * workers
        self.started = self.pushes = self.events = self.queued = 0
        self.totals = {"pull": 0.0, "push": 0.0, "compute": 0.0, "steps": 0}
        self.consumed = [0] * workers  # batches each worker id has drawn, over its lives
        self.ended: list[tuple[float, int] | None] = [None] * workers  # (time, order) of DONE
        self.checkpointer: Any = None  # called after every event by run() when set
        self.diverged: dict[int, str] = {}  # worker -> why its loop raised loop.Diverged
        self.failures = Failures() if failures is None else failures  # the failure policy
        self.diverge_after = diverge_after  # for the worker loops
        self.stepped = [False] * workers  # worker id has done a step (errors before: fatal)
        self.awaiting: dict[int, dict] = {}  # worker -> its failure event, until it is back
        self.returns = 0  # scripted joins and restarts still to come
        self.join_times: dict[int, list[float]] = {}  # worker -> its scripted joins
        for e in sorted(sim.joins, key=lambda e: e.time):
            self.join_times.setdefault(e.worker, []).append(e.time)

    # -- plumbing ------------------------------------------------------------------

    def at(self, t: float, kind: int, w: int = -1, k: int = -1, inc: int = 0, x: float = 0.0):
        if kind < _FAIL:
            self.queued += 1  # work in flight (not an evaluation, failure or join)
        heapq.heappush(self.heap, (t, next(self.counter), kind, w, k, inc, x))

    def transfer(self, src: int, dst: int, nbytes: float, head_kind: int, w: int, k: int) -> None:
        head, tail = self.links.send(src, dst, nbytes, self.now)
        if self.links.instant(dst, nbytes, head, tail):
            self.at(head, head_kind + 1, w, k, self.inc[w])  # skip the ingress step
        else:
            self.at(head, head_kind, w, k, self.inc[w], tail)

    def take_buffer(self) -> np.ndarray:
        return self.pool.pop() if self.pool else np.empty(self.spec.size, self.params.dtype)

    def give_back(self, w: int) -> None:
        for bufs in (self.pull_buf, self.upd_buf, self.next_buf):
            if bufs[w] is not None:
                self.pool.append(bufs[w])
                bufs[w] = None

    # -- shards --------------------------------------------------------------------

    def enqueue(self, k: int, req: tuple) -> None:
        if self.busy[k] is None:
            self.serve(k, req)
        else:
            self.queue[k].append(req)

    def serve(self, k: int, req: tuple) -> None:
        self.busy[k] = req
        self.at(self.now + self.service.seconds(self.slice_bytes[k]), _SERVED, k=k)

    def served(self, k: int) -> None:
        kind, w, inc = self.busy[k]
        if inc == self.inc[w]:
            shard = self.shards[k]
            if kind == _PULL:
                self.read(w, k)
            else:
                out = self.outgoing[w]
                header = PushHeader(w, out.seq, out.bases[k], inc)
                self.acks[w][k] = ack = shard.push(
                    header, self.sent(w, k), verdict=out.verdict, now=self.now
                )
                if not ack.ok:
                    log.debug("sim: shard %d rejected worker %d's push: %s", k, w, ack.reason)
                self.at(self.now + self.lat, _ACK, w, k, inc)
                self.release(k)
                if self.behind[w][k]:  # its pull came behind the push: its turn now
                    self.behind[w][k] = False
                    self.ask(w, k, inc)
        q = self.queue[k]
        while q:
            req = q.popleft()
            if req[2] == self.inc[req[1]]:
                self.serve(k, req)
                return
        self.busy[k] = None

    def read(self, w: int, k: int) -> None:
        """Shard ``k``'s slice as it is now goes to worker ``w`` (served, or read from the
        newest snapshot: :mod:`stalewise.protocol.pipeline`)."""
        lo, hi = self.ranges[k]
        if self.pull_servers is None:
            version = self.shards[k].pull(w, self.pull_buf[w][lo:hi], now=self.now)
            self.senders[w].pulled(k, version)
            nbytes = self.slice_bytes[k]
        else:
            nbytes = self.delta_pull(w, k)
        self.pull_bytes[w][k] = nbytes
        self.pulled[0] += nbytes
        self.pulled[1] += 1
        self.transfer(self.P + k, w, nbytes, _PULL_HEAD, w, k)

    def ask(self, w: int, k: int, inc: int) -> None:
        """Worker ``w``'s pull request at shard ``k``: it waits for the gate, then queues."""
        shard = self.shards[k]
        if self.gated and not shard.may_start(w):
            heapq.heappush(self.waiting[k], (int(shard.clocks[w]), next(self.counter), w, inc))
        else:
            self.enqueue(k, (_PULL, w, inc))

    def delta_pull(self, w: int, k: int) -> float:
        """Shard ``k`` serves worker ``w``'s delta pull (:mod:`stalewise.protocol.pulls`):
        the worker's copy decodes the payload and the step gets that copy's slice.
        Returns the payload's byte count (scaled by ``model_bytes``)."""
        held = self.replicas[w]
        if held is None or held[0] != self.inc[w]:  # a new incarnation starts with no copy
            held = self.replicas[w] = (self.inc[w], pulls.Replica.for_job(self.config))
        replica = held[1]
        pulled = self.pull_servers[k].pull(w, replica.have(k), now=self.now)
        self.senders[w].pulled(k, replica.apply(k, pulled.payload))
        lo, hi = self.ranges[k]
        np.copyto(self.pull_buf[w][lo:hi], replica.params[lo:hi])
        return pulled.nbytes(self.scale)

    def pull_bytes_mean(self) -> float:
        """The mean bytes of one pull of every shard (model_bytes scaled)."""
        if not self.pulled[1]:
            return float(sum(self.slice_bytes))
        return self.pulled[0] / self.pulled[1] * self.S

    def release(self, k: int) -> None:
        """Lets through the gated pulls shard ``k``'s gate now allows (smallest clock first)."""
        h = self.waiting[k]
        if not h:
            return
        shard = self.shards[k]
        floor = shard.min_clock()
        while h:
            clock, _, w, inc = h[0]
            if inc != self.inc[w]:
                heapq.heappop(h)
                continue
            if not (
                shard.may_start(w) if shard.hybrid else shard.consistency.may_start(clock, floor)
            ):
                return
            heapq.heappop(h)
            self.enqueue(k, (_PULL, w, inc))

    # -- workers ---------------------------------------------------------------------

    def send(self, w: int, answer: Any) -> Any:
        """Answers worker ``w``'s loop; returns its next request, None when the loop
        ended (the budget is spent, or it diverged), or ``_GONE`` when the worker failed."""
        try:
            return self.loops[w].send(answer)
        except StopIteration as stop:
            self.loop_stats[w] = stop.value
            return None
        except loop.Diverged as e:  # the loop has ended: the worker stops pushing and leaves
            self.diverged[w] = str(e)
            self.failures.diverged(w, str(e), time=self.now)  # never restarted
            return None
        except Exception as e:
            self.crash(w, e)
            return _GONE

    def start_loop(self, w: int) -> None:
        """Starts a new loop for worker ``w``'s new incarnation (it asks BEGIN at once).

        A worker id keeps one stream of batches over its lives; a restart
        (:meth:`policy`) or a resumed run starts a new one, as a new process
        would, after the batches its worker id has drawn. The incarnation's
        :class:`~stalewise.protocol.sender.Sender` takes over the residual of
        its worker id's last committed push.
        """
        self.senders[w] = self.new_sender(w)
        self.joined_at[w] = max(int(shard.clocks[w]) for shard in self.shards)
        self.fresh[w] = pipeline.reads_snapshots(
            self.config, incarnation=self.inc[w], joined_at=self.joined_at[w]
        )
        self.results[w], self.loop_stats[w] = [], None
        try:
            if self.batches[w] is None:
                self.batches[w] = batch_iterator(self.data, w, self.P, drawn=self.consumed)
        except Exception as e:
            self.crash(w, e)
            return
        self.loops[w] = gen = loop.worker_loop(
            self.strategy,
            self.loss_and_grad,
            self.batches[w],
            worker=w,
            diverge_after=self.diverge_after,
        )
        next(gen)  # runs to the first BEGIN
        self.start_step(w)

    def start_step(self, w: int) -> None:
        """Answers the loop's BEGIN: a step starts while the job's budget lasts."""
        more = self.may_begin(w)
        request = self.send(w, more)
        if request is _GONE:
            return
        if request is None:  # the loop has ended: the worker leaves the job
            self.phase[w], self.loops[w] = _DONE, None
            self.ended[w] = (self.now, sum(e is not None for e in self.ended))
            if not self.acking[w]:  # else it leaves once its last push is acked
                self.leave(w)
            return
        self.started += 1  # the loop asks to PULL
        self.phase[w], self.pending[w], self.t_mark[w] = _PULLING, self.S, self.now
        self.pull_buf[w] = self.take_buffer()
        # the pipelining rule: the newest snapshots, or requests behind the push in flight
        snapshot = self.fresh[w] and pipeline.may_read(
            self.shards[0].consistency, self.senders[w].seq, (s.min_clock() for s in self.shards)
        )
        for k in range(self.S):
            self.at(self.now + self.lat, _PULL_REQ, w, k, self.inc[w], float(snapshot))

    def leave(self, w: int) -> None:
        """Worker ``w``'s loop has ended and its last push is acked: it leaves the shards."""
        for k in range(self.S):
            self.at(self.now + self.lat, _LEAVE, w, k, self.inc[w])

    def compute(self, w: int) -> None:
        """Every slice is in: the loop runs the strategy step, the compute time starts."""
        self.totals["pull"] += self.now - self.t_mark[w]
        params = tree.unflatten(self.pull_buf[w], self.spec)
        try:
            request = self.loops[w].send(params)
            if request is loop.CLOCK:  # a strategy pacing itself asks the clock: virtual time
                request = self.loops[w].send(self.now)
            # the step has run: a Push (answered at its acks, so its settle holds already)
            update, loss, local_steps = request[:3]
            if local_steps < 0:
                raise ValueError(f"the strategy step reported local_steps={local_steps} (< 0)")
            self.next_buf[w] = out = self.take_buffer()
            tree.flatten(update, spec=self.spec, out=out)
            self.settle[w] = pipeline.answer_at_acks(request)
        except Exception as e:
            self.crash(w, e)
            return
        self.stepped[w] = True
        self.pool.append(self.pull_buf[w])
        self.pull_buf[w] = None
        self.loss_next[w] = loss
        self.phase[w], self.t_mark[w] = _COMPUTING, self.now
        self.at(self.timing.finish(w, self.now, local_steps), _COMPUTED, w, inc=self.inc[w])

    def new_sender(self, w: int) -> Sender:
        """Worker ``w``'s sending side for a new incarnation: its predecessor's successor,
        or one with the residual a resumed run gave it."""
        if (old := self.senders[w]) is not None:
            return old.successor()
        start = None if self.feedback[w] is None else self.feedback[w].residual
        cfg, dtype = self.config, self.params.dtype
        return Sender(
            cfg.spec.segments, cfg.staleness, self.S, self.compressor, residual=start, dtype=dtype
        )

    def payload_buffers(self, w: int) -> list[bytearray]:
        """Worker ``w``'s payload buffers, one per shard, kept from push to push (a payload
        lives until every shard took it)."""
        bufs = self.payloads[w]
        if bufs is None:
            dtype = self.params.dtype
            sizes = [self.compressor.nbytes(k, dtype) for k in range(self.S)]
            bufs = self.payloads[w] = [bytearray(n) for n in sizes]
        return bufs

    def sent(self, w: int, k: int) -> Any:
        """What shard ``k`` receives of worker ``w``'s push: its slice, or its payload."""
        if self.compressor is not None:
            return self.payloads[w][k]
        lo, hi = self.ranges[k]
        return self.upd_buf[w][lo:hi]

    def computed(self, w: int) -> None:
        """The step's compute time is over: push, once the last push is acked (IN_FLIGHT)."""
        self.totals["compute"] += self.now - self.t_mark[w]
        if self.acking[w]:
            self.phase[w] = _HELD
            return
        self.push(w)

    def push(self, w: int) -> None:
        """Commits the update (one verdict for every shard) and sends each shard its slice;
        the loop goes on at once, or at the acks of a settling push (pipeline)."""
        self.upd_buf[w], self.next_buf[w] = self.next_buf[w], None
        if self.compressor is not None:  # the payloads are free: the last push is acked
            try:
                self.senders[w].encode(self.upd_buf[w], self.payload_buffers(w))
            except Exception as e:
                self.crash(w, e)
                return
        self.pushes += 1
        self.last_loss[w] = self.loss_next[w]
        sender = self.senders[w]
        if self.judging:  # what the sender knows: exact here
            for k, shard in enumerate(self.shards):
                sender.observed(k, shard.version)
        # judged once (payloads decoded back into the update's buffer), then committed
        self.outgoing[w] = sender.judge(self.upd_buf[w], into=self.upd_buf[w])
        sender.committed()
        self.acks[w] = [None] * self.S
        self.acking[w], self.push_mark[w] = self.S, self.now
        for k in range(self.S):
            self.push_bytes[w][k] = nbytes = self.wire_bytes[k]  # the payload's exact size
            self.transfer(w, self.P + k, nbytes, _PUSH_HEAD, w, k)
        if self.settle[w]:
            self.phase[w] = _SETTLING
            return
        self.phase[w] = _IDLE
        results, self.results[w] = self.results[w], []
        if self.send(w, results) is not _GONE:  # the loop asks BEGIN
            self.start_step(w)

    def acked(self, w: int) -> None:
        """Every ack of the push in flight is in: its result goes to the loop with the next
        answer; a held push is committed now, a settling one's loop goes on."""
        self.totals["push"] += self.now - self.push_mark[w]
        self.totals["steps"] += 1
        self.pool.append(self.upd_buf[w])
        self.upd_buf[w] = None
        self.results[w].append(self.senders[w].result(self.acks[w]))
        phase = self.phase[w]
        if phase == _HELD:
            self.push(w)
        elif phase == _SETTLING:
            self.phase[w] = _IDLE
            results, self.results[w] = self.results[w], []
            if self.send(w, results) is not _GONE:  # the loop asks BEGIN
                self.start_step(w)
        elif phase == _DONE:  # the loop has ended: its last push's result, then it leaves
            results, self.results[w] = self.results[w], []
            if self.loop_stats[w] is not None:
                loop.report(results, self.loop_stats[w], w)
            self.leave(w)

    def fail(self, w: int) -> None:
        """A scripted failure of worker ``w`` (``SimConfig.failures``); see the module docstring."""
        if self.phase[w] in (_DEAD, _DONE):
            return
        log.info("sim: worker %d fails at t=%.6g", w, self.now)
        self.depart(w)
        cause = "scripted failure (SimConfig.failures)"
        back = next((t for t in self.join_times.get(w, ()) if t >= self.now), None)
        if back is None:
            self.policy(w, cause)
            return
        # the script says when it is back: away until that join, whatever the policy
        event = {"worker": w, "time": self.now, "cause": cause, "action": "left", "rejoin": back}
        self.failures.events.append(event)
        self.awaiting[w] = event

    def crash(self, w: int, error: Exception) -> None:
        """The user's code raised ``error`` in worker ``w`` (call it in the ``except``
        block): the worker fails now, and the failure policy says what follows.

        Raises:
            WorkerError: before worker id ``w`` has done a step (a bug in its data or
                first step, whatever the policy), or as the policy decides.
        """
        detail = traceback.format_exc()
        if not self.stepped[w]:
            raise worker_failed(w, detail, f"{type(error).__name__}: {error}") from None
        self.depart(w)
        self.policy(w, f"raised {type(error).__name__}: {error}", detail)

    def policy(self, w: int, cause: str, detail: str = "") -> None:
        """Applies the failure policy to worker ``w``, which has just departed."""
        if self.failures.worker(w, cause, time=self.now, detail=detail) == "restart":
            self.awaiting[w] = self.failures.events[-1]
            self.batches[w] = None  # the new incarnation continues its id's stream
            self.returns += 1
            self.at(self.now + self.sim.restart_delay, _RESTART, w, inc=self.inc[w])

    def restarting(self, w: int) -> bool:
        """Whether worker ``w`` is down, waiting for its restart."""
        event = self.awaiting.get(w)
        return event is not None and event["action"] == "restarted"

    def depart(self, w: int) -> None:
        """Worker ``w``'s incarnation ends now: it leaves every shard, which first
        delivers a push it had committed, and its messages in flight are dropped."""
        phase, inc = self.phase[w], self.inc[w]
        if phase in (_PULLING, _COMPUTING, _HELD):
            self.started -= 1  # nothing was committed: the step is not done
        flying, self.acking[w] = self.acking[w], 0
        self.behind[w] = [False] * self.S
        self.results[w] = []
        self.phase[w] = _DEAD
        if self.loops[w] is not None:
            self.loops[w].close()
            self.loops[w] = None
        delivered = []
        for k, shard in enumerate(self.shards):
            committed = None
            if flying:  # committed: shards that have not handled it get it now
                out = self.outgoing[w]
                header = PushHeader(w, out.seq, out.bases[k], inc)
                committed = (header, self.sent(w, k), out.verdict)
            if shard.depart(w, inc, committed=committed) is not None:
                delivered.append(k)
            self.release(k)
        if delivered:
            log.info(
                "sim: worker %d's committed push %d delivered to shard(s) %s at its failure",
                w,
                self.outgoing[w].seq,
                delivered,
            )
        self.inc[w] += 1  # the push's messages still in flight are dropped: exactly once
        self.give_back(w)
        if self.senders[w] is not None:  # a push encoded, never committed: the residual stays
            self.senders[w].abandoned()

    def join(self, w: int) -> None:
        if self.phase[w] not in (_DEAD, _DONE):
            log.debug("sim: worker %d joins at t=%.6g but is live; ignored", w, self.now)
            return
        log.info("sim: worker %d joins at t=%.6g", w, self.now)
        self.rejoin(w)

    def rejoin(self, w: int) -> None:
        """Worker ``w`` comes back as a new incarnation (a scripted join or a restart)."""
        self.inc[w] += 1
        self.diverged.pop(w, None)  # a new incarnation, with a new loop
        event = self.awaiting.pop(w, None)
        for shard in self.shards:
            shard.join(w, self.inc[w])
        self.start_loop(w)
        if event is not None and self.phase[w] != _DEAD:
            event["recovered"] = self.now

    # -- checkpoints -------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """The simulator's own state for a checkpoint (JSON-able), beside the shards' states.

        ``quiescent``: no work in flight and every worker's loop has ended (the end
        of a run that used its whole budget); only such a checkpoint lets a resumed
        run start each worker when and in the order it would have gone on.
        """
        rngs = self.timing._rngs
        return {
            "now": self.now,
            "pushes": self.pushes,
            "quiescent": not self.queued
            and all(p in (_DONE, _DEAD) for p in self.phase)
            and not any(map(self.restarting, range(self.P))),
            # a worker waiting for its restart is live: a resumed run restarts it at once
            "phase": [
                "dead" if p == _DEAD and not self.restarting(w) else "live"
                for w, p in enumerate(self.phase)
            ],
            "ended": [None if e is None else list(e) for e in self.ended],
            "consumed": list(self.consumed),
            "last_loss": [None if math.isnan(x) else float(x) for x in self.last_loss],
            "rngs": None if rngs is None else [r.bit_generator.state for r in rngs],
            "egress": list(self.links.egress),
            "ingress": list(self.links.ingress),
            "totals": dict(self.totals),
            "events": self.events,
        }

    def residuals(self) -> list[np.ndarray] | None:
        """Each worker id's error-feedback residual after its last committed push, for a
        checkpoint (None when the codec keeps no feedback)."""
        comp = self.compressor
        if comp is None or not comp.error_feedback:
            return None
        zeros = np.zeros(self.spec.size, self.params.dtype)
        return [
            s.residual if s is not None else zeros if f is None else f.residual
            for s, f in zip(self.senders, self.feedback, strict=True)
        ]

    def restore(
        self, states: list[dict], saved: dict[str, Any], feedback: list[Any] | None = None
    ) -> list[tuple[float, int]]:
        """Loads a checkpoint (shard states, :meth:`checkpoint_state` and the workers'
        error feedback, from :func:`stalewise.checkpoint.feedback_of`) before :meth:`run`.

        Returns when and in which order to start the workers: for a quiescent
        checkpoint each at the instant its loop ended, in that order; otherwise
        every worker that was not dead at the checkpoint's time, by id.
        """
        for shard, state in zip(self.shards, states, strict=True):
            shard.load_state_dict(state)
        if feedback is not None and self.compressor is not None:
            self.feedback[:] = feedback  # each worker id continues with its residual
        self.now = self.end = float(saved["now"])
        self.pushes = self.started = int(saved["pushes"])
        self.consumed = [int(n) for n in saved["consumed"]]  # each stream skips as many
        self.last_loss[:] = [math.nan if x is None else x for x in saved["last_loss"]]
        if saved["rngs"] is not None and self.timing._rngs is not None:
            for rng, state in zip(self.timing._rngs, saved["rngs"], strict=True):
                rng.bit_generator.state = state
        self.links.egress[:] = saved["egress"]
        self.links.ingress[:] = saved["ingress"]
        self.totals.update(saved["totals"])
        self.events = int(saved["events"])
        for w in range(self.P):  # new incarnations, above every shard's
            self.inc[w] = max(int(s.incarnation[w]) for s in self.shards)
        if saved["quiescent"]:
            starts = [(e[0], e[1], w) for w, e in enumerate(saved["ended"]) if e is not None]
        else:
            live = [w for w, p in enumerate(saved["phase"]) if p == "live"]
            starts = [(self.now, w, w) for w in live]
        for w in range(self.P):
            if w not in {x[2] for x in starts}:
                self.phase[w] = _DEAD
        return [(t, w) for t, _, w in sorted(starts)]

    # -- the loop ------------------------------------------------------------------

    def begin(self, eval_interval: float, starts: list[tuple[float, int]] | None = None) -> None:
        """Schedules the scripted failures and joins and starts the workers' loops at the
        run's start (``starts``: a resumed run's ``(time, worker)`` starts, from
        :meth:`restore`); then :meth:`advance` runs the events. ``eval_interval`` names
        the interval in a :class:`TooLongError`."""
        t0, self.eval_interval, self.evals, self.eval_at = self.now, eval_interval, 0, None
        if starts is None:
            absent = self.sim.absent_at_start()
            for w in sorted(absent):
                self.phase[w] = _DEAD
                for shard in self.shards:
                    shard.leave(w)
        events = [e for e in self.sim.failures + self.sim.joins if e.time >= t0]
        for e in sorted(events, key=lambda e: e.time):
            self.at(e.time, _JOIN if isinstance(e, Join) else _FAIL, e.worker)
        self.returns += sum(isinstance(e, Join) for e in events)
        if starts is None:
            for w in range(self.P):
                if w not in absent:
                    self.inc[w] = 1
                    for shard in self.shards:
                        shard.join(w, 1)
                    self.start_loop(w)
        else:
            for t, w in starts:
                self.now = t
                self.inc[w] += 1
                for shard in self.shards:
                    shard.join(w, self.inc[w])
                self.start_loop(w)
            self.now = t0

    def advance(self, until: float, deadline: float, due: Callable[[], bool] | None = None) -> str:
        """Runs events up to the record time ``until`` (an evaluation event there, ordered
        with the others at that time by when it was scheduled); returns the driver's
        ``RECORD`` there (at once if ``until`` is not after :attr:`now`), ``CHECKPOINT``
        after an event once ``due()`` says so, or ``END`` when the run is over (no work in
        flight and none to come; :attr:`now` is then the last event's time).

        Raises:
            TooLongError: more than ``MAX_RECORDS`` evaluation times in this run.
            TimeoutError: past the wall-clock ``deadline`` (``time.perf_counter``).
        """
        if until <= self.now:
            return driver.RECORD
        if self.eval_at != until:
            self.eval_at = until
            self.at(until, _EVAL)
        heap, pop, inc = self.heap, heapq.heappop, self.inc
        while heap:
            t, _, kind, w, k, i, x = pop(heap)
            self.now = t
            if kind < _FAIL:
                self.queued -= 1
            if kind == _SERVED:
                self.served(k)
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
            elif kind >= _FAIL:
                idle = self.idle()  # this join or restart counts: it may bring work
                self.returns -= kind != _FAIL
                if idle or (kind == _RESTART and i != inc[w]):
                    continue  # the job is over, or the worker is back already (a join)
                if kind == _FAIL:
                    self.fail(w)
                elif kind == _JOIN:
                    self.join(w)
                else:
                    log.info("sim: worker %d restarts at t=%.6g", w, self.now)
                    self.rejoin(w)
            elif i != inc[w]:
                continue  # a message of (or to) an earlier life of worker w
            elif kind == _PULL_REQ:
                if x:  # the newest snapshot (pipeline.may_read): no queue at the shard
                    self.read(w, k)
                elif self.acking[w] and self.acks[w][k] is None:
                    self.behind[w][k] = True  # behind its push, which shard k has not handled
                else:
                    self.ask(w, k, i)
            elif kind == _PULL_HEAD:
                self.at(self.links.receive(w, self.pull_bytes[w][k], t, x), _PULL_RESP, w, k, i)
            elif kind == _PUSH_HEAD:
                done = self.links.receive(self.P + k, self.push_bytes[w][k], t, x)
                self.at(done, _PUSH_IN, w, k, i)
            elif kind == _PULL_RESP:
                self.pending[w] -= 1
                if not self.pending[w]:
                    self.compute(w)
            elif kind == _ACK:
                self.acking[w] -= 1
                if not self.acking[w]:
                    self.acked(w)
            elif kind == _COMPUTED:
                self.computed(w)
            elif kind == _PUSH_IN:
                self.enqueue(k, (_PUSH, w, i))
            elif kind == _LEAVE:
                self.shards[k].leave(w)
                if self.pull_servers is not None:
                    self.pull_servers[k].forget(w)  # its reference: the worker has left
                self.release(k)
            self.end = t
            self.events += 1
            if not self.events & 0xFFF and time.perf_counter() > deadline:
                raise TimeoutError(f"simulation did not finish within the timeout (t={t:.6g})")
            if due is not None and due():
                return driver.CHECKPOINT
        self.now = self.end
        return driver.END

    def run(
        self,
        record: Callable[[], bool],
        eval_interval: float,
        deadline: float,
        starts: list[tuple[float, int]] | None = None,
    ) -> bool:
        """Runs the whole simulation without a driver (tests, tools): ``record`` at the
        start and every ``eval_interval``, :attr:`checkpointer` (if set) after every
        event. Returns whether ``record`` said stop (else the work is done)."""
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
        """No work in flight, and no join or restart that could bring more (none left, or
        no budget)."""
        return not self.queued and not (self.returns and self.may_begin())

    def may_begin(self, w: int | None = None) -> bool:
        """The budget rule (:mod:`stalewise.protocol.budget`), with both counts exact: the
        pushes committed, and every worker's steps begun and not committed. Under BSP,
        worker ``w``'s step counts whole rounds: its round is the clock it joined at plus
        its pushes since."""
        if w is not None and self.config.consistency.averages_rounds:
            round_ = self.joined_at[w] + self.senders[w].seq
            return budget.may_begin_round(round_, self.P, self.steps)
        return budget.may_begin(self.pushes, self.started - self.pushes, self.steps)

    def stats(self, *, settled: bool = False) -> dict[str, Any]:
        """The shards' merged counters; ``settled``: no push is in flight (checks they agree)."""
        per_shard = [s.stats.as_dict() | {"version": s.version} for s in self.shards]
        return merge_stats(per_shard, settled=settled)
