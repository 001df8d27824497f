"""A shard as an asyncio Ray actor around a protocol ``Shard``: it moves, and decides no rule."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from stalewise.checkpoint.store import LogWriter
from stalewise.protocol import PushHeader, ServerConfig, Verdict, delivery, pipeline, pulls
from stalewise.protocol.replica import Backup, CatchUp, Forward, Held, Primary, digest
from stalewise.runtime.logs import child_logging

log = logging.getLogger(__name__)

BACKUP_WAIT = 30.0  # seconds a backup may take to hold a forward before it is replaced


def payload_spans(config: ServerConfig) -> list[tuple[int, int]] | None:
    """Each shard's ``[start, stop)`` bytes in a compressed push (None: plain vectors)."""
    compressor = config.compressor()
    if compressor is None:
        return None
    ends = np.cumsum([compressor.nbytes(k, config.init.dtype) for k in range(config.shards)])
    return [(int(e - n), int(e)) for e, n in zip(ends, np.diff(ends, prepend=0), strict=True)]


class ShardActor:
    """Shard ``k`` of a job with ``workers`` workers; closed (pulls wait) until :meth:`load`."""

    def __init__(
        self,
        config: ServerConfig,
        k: int,
        workers: int,
        publish_every: float,
        expected: int | None = None,
    ):
        child_logging(f"shard {k}")
        self.config, self.k, self.workers = config, k, workers
        self.expected = expected  # of the worker ids, those counted from the start (None: all)
        self.lo, self.hi = config.ranges[k]
        self.size, self.dtype = config.spec.size, config.init.dtype
        zeros = np.zeros(self.hi - self.lo, self.dtype)
        self.shard = config.build_shard(k, zeros, workers, expected)
        self.shard.warm_up()
        self.several = len(config.ranges) > 1  # a torn push is possible: keep recent pushes
        self.exact = pipeline.exact_pulls(config)
        self.scratch = np.empty(self.hi - self.lo, self.dtype)
        spans = payload_spans(config)  # with a codec: this shard's bytes of a push
        self.span = None if spans is None else spans[k]
        self.push_bytes = None if spans is None else spans[-1][1]
        # each worker's pushes not yet acked by every shard: (bases, verdict, update)
        self.last = delivery.Ledger()
        # delta pulls (ServerConfig.pull_codec): the pull server beside the shard
        self.pulls = self._pull_server()
        self.pulled = [0, 0]  # bytes and number of the pull slices served
        self.pull_cost = 0.0  # seconds a delta pull takes (a moving average)
        self.losses = np.full(workers, np.nan)  # each worker's last train loss
        self.handled = 0  # pushes that counted as a step (the job's push count, on shard 0)
        self.snap: Any = None  # ObjectRef of the published slice
        self.pub = pipeline.Publication(publish_every)
        # seconds spent handling pushes, publishing, serving delta pulls
        self.busy = {"push": 0.0, "publish": 0.0, "pull": 0.0}
        self.timer: Any = None  # a deferred publish (ASP), when one is due
        self.cutting = delivery.Cut()  # a consistent cut under way: pushes wait
        self.opened, self.changed = asyncio.Event(), asyncio.Event()
        self.stopped = False
        # replicas=2: the backup actor, the Primary its replies wait on, one forward at a time
        self.backup: Any = None
        self.primary: Primary | None = None
        self.forwarding, self.holder = asyncio.Lock(), 0  # (holder: the backup's pid attached)
        self.record: Any = None  # the Primary's journal, when one is attached
        self.exposed: tuple | None = None  # what was let out, as of _held() (replica.stale)
        self.log, self.unsent = LogWriter(f"shard {k}"), 0  # the push log; bytes not forwarded

    async def ready(self) -> dict:
        """``{"node", "pid", "version"}``: the driver's start check."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return {"node": node, "pid": os.getpid(), "version": self.shard.version}

    async def watch(self) -> None:
        """Never returns: its ObjectRef fails when this actor dies."""
        await asyncio.get_running_loop().create_future()

    async def load(
        self,
        state: dict | None,
        handled: int,
        joins: dict[int, int],
        gone: list[int],
        init: np.ndarray | None = None,
        resume: bool = False,
        backup: Any = None,
        seats: np.ndarray | None = None,
        log_at: tuple | None = None,
        ledger: dict | None = None,
    ) -> int:
        """Opens the shard on ``state`` (None: ``init``), ``seats`` and ``ledger`` (``Ledger.kept``),
        goes on with the push log ``log_at`` (``(path, at, fsync)``), makes ``gone`` leave,
        admits ``joins`` and catches up its ``backup``; returns the version."""
        self.log.end()
        if state is not None:
            self.shard.load_state_dict(state)
            if seats is not None:
                np.copyto(self.shard.admitted, seats[0])
                np.copyto(self.shard.retired, seats[1])
            if resume:
                self.shard.resume()
        elif init is not None:  # a fresh shard over the initial values
            self.shard = self.config.build_shard(self.k, init.copy(), self.workers, self.expected)
        self.pulls = self._pull_server()  # references are not kept: the next pulls are full
        self.record = self.shard.journal = None  # (attach records anew)
        if log_at is not None:
            self.begin_log(*log_at)
        self.handled = int(handled)
        for w in gone:
            if self.shard.live[w]:
                self.shard.leave(w)
            self.shard.retire(w)
        for w, inc in joins.items():
            self.shard.admit(int(w), int(inc))
        self.last = delivery.Ledger(ledger)
        self.snap, self.pub.version = None, -1
        self.cutting.thaw()
        await self.attach(backup or self.backup)
        self.opened.set()
        self._notify()
        return self.shard.version

    async def attach(self, backup: Any) -> None:
        """Starts ``backup`` (None: none) from this shard's state now, in a new view."""
        if backup is None:
            return
        async with self.forwarding:  # no forward of the new view goes before the catch-up
            self.backup = backup
            self.primary = Primary(self.shard, view=self.primary.view if self.primary else 0)
            self.record, self.shard.journal, self.unsent = self.shard.journal, self._journal, 0
            try:  # in a view newer than the backup's (a dead primary's, maybe)
                self.holder = (await asyncio.wait_for(backup.ready.remote(), BACKUP_WAIT))["pid"]
                followed = await asyncio.wait_for(backup.view.remote(), BACKUP_WAIT)
                start = self.primary.attach(followed)
                seats = np.stack([self.shard.admitted, self.shard.retired])  # not in state_dict
                kept, self.last.changes = self.last.kept, []
                call = backup.start.remote(start, self.handled, seats, self.log.where(), kept)
                await asyncio.wait_for(call, BACKUP_WAIT)
            except Exception as e:  # Ray's errors, a timeout
                await self._lose_backup(e)
        self._notify()

    async def _held(self) -> None:
        """Returns once the backup holds every entry made (at once with none attached)."""
        while (p := self.primary) is not None and p.backed and p.acked < p.entries:
            async with self.forwarding:
                if p is not self.primary or not p.backed or (fwd := p.forward()) is None:
                    continue
                try:
                    at, self.unsent = self.log.where(self.unsent), 0
                    changes, self.last.changes = self.last.changes, []
                    call = self.backup.receive.remote(fwd, self.handled, at, changes)
                    held = await asyncio.wait_for(call, BACKUP_WAIT)
                    if held is None or held.entries < fwd.first + len(fwd.entries):
                        raise RuntimeError(
                            f"it holds {held} after {fwd.first} + {len(fwd.entries)}"
                        )
                    p.held(held)
                except Exception as e:  # Ray's errors, a timeout, a refusal
                    await self._lose_backup(e)
            self._notify()
        if (p := self.primary) is not None:
            self.exposed = (p.view, p.backed, self.shard.version, self.handled)

    def begin_log(self, path: str, at: int | None = None, fsync: bool = False) -> None:
        """:meth:`LogWriter.begin <stalewise.checkpoint.store.LogWriter.begin>` at the state now."""
        if self.log.begin(path, at, fsync):
            self.shard.journal, self.unsent = self._journal, 0
        elif self.record is None:
            self.shard.journal = None

    def _journal(self, entry: list) -> None:
        """A journal entry: to the push log (synced before any reply), and to the Primary."""
        size = self.log.write(entry)
        if not self.log.sync() and self.record is None:  # the log failed: no entry for anyone
            self.shard.journal = None
        if self.record is not None:
            self.unsent += size
            self.record(entry)
            if not self.primary.backed:  # alone: for no one (a new backup takes the state)
                self.primary.forward()
                self.unsent = 0

    async def _lose_backup(self, why: Exception) -> None:
        """The backup failed: kills it; serves alone once it is gone (in BACKUP_WAIT, else exits)."""
        import ray

        log.warning("shard %d: its backup failed (%s); serving alone once it is gone", self.k, why)
        if not isinstance(why, ray.exceptions.RayActorError):  # alive: Ray restarts it
            ray.kill(self.backup, no_restart=False)
        deadline = time.monotonic() + BACKUP_WAIT
        while (left := deadline - time.monotonic()) > 0:
            try:
                got = await asyncio.wait_for(self.backup.ready.remote(), min(left, 1.0))
                if got["pid"] != self.holder and got["version"] < 0:
                    break  # a new incarnation, empty
                ray.kill(self.backup, no_restart=False)  # the one attached, or one with a copy
            except ray.exceptions.ActorDiedError:
                break
            except Exception:  # Ray's errors, a timeout: restarting, or slow
                pass
            await asyncio.sleep(0.05)
        else:
            log.error("shard %d: its backup was given up on and is not gone; exiting", self.k)
            os._exit(1)
        self.primary.detach()
        self.last.changes = None

    async def join(self, w: int, inc: int) -> int:
        """Admits incarnation ``inc`` of worker ``w`` (once), after a restarted actor's load as
        :meth:`cut`, :meth:`committed` and :meth:`depart`; returns the clock it joins at."""
        await self.opened.wait()
        if self.shard.incarnation[w] < inc:
            self.shard.admit(w, inc)
            self.last.forget(w)
        await self._held()
        self._notify()
        return int(self.shard.clocks[w])

    async def expire_unstarted(self) -> list[int]:
        """Drops the expected workers that never joined; returns their ids."""
        gone = self.shard.expire_unstarted()
        await self._held()
        self._notify()
        return gone

    async def cut(self, w: int, inc: int) -> int | None:
        """Cuts ``w``'s incarnation ``inc`` off; returns its pushes handled here (None: unknown)."""
        await self.opened.wait()
        self.shard.retire(w, inc)
        await self._held()
        self._notify()
        return self.shard.handled(w, inc)

    async def leave(self, w: int, inc: int) -> None:
        """``w``'s incarnation ``inc`` leaves (its loop ended with its acks)."""
        await self.cut(w, inc)  # (after a restarted actor's load)
        await self.depart(w, inc, None)

    async def committed(self, w: int, inc: int, start: int, stop: int) -> list | None:
        """``[(seq, bases, verdict, update), ...]`` of ``w``'s ``start .. stop - 1`` (or None)."""
        await self.opened.wait()
        got = self.last.between(w, inc, start, stop)
        if got is not None:
            return [(seq, *entry) for seq, entry in zip(range(start, stop), got, strict=True)]
        why = "are no longer kept here; a shard lacking them stays without them"
        log.error("shard %d: worker %d's pushes %d..%d " + why, self.k, w, start, stop - 1)
        return None

    async def depart(self, w: int, inc: int, committed: list | None) -> int | None:
        """Incarnation ``inc`` of ``w`` is gone: delivers ``committed``, departs; :meth:`cut`."""
        await self.opened.wait()
        for seq, bases, verdict, update in committed or ():  # in order, each if it is the next
            header = PushHeader(w, seq, int(bases[self.k]), inc)
            ack = self.shard.deliver(w, inc, (header, self._payload(update), Verdict(*verdict)))
            if ack is not None:
                self._count(w, ack, math.nan)
        self.shard.depart(w, inc)
        self.last.forget(w)
        await self._held()
        if not self.exact:
            self._publish_soon()
        self._notify()
        return self.shard.handled(w, inc)

    async def digest(self) -> str:
        return digest(self.shard.state_dict())

    async def stop(self) -> None:
        """The job is ending: every pull, waiting or new, is answered "stop"."""
        self.stopped = True
        self._notify()

    async def stats(self) -> dict:
        """The shard's counters with ``version``, ``handled``, ``losses``, ``busy``, ``pulled``."""
        return self.shard.stats.as_dict() | {
            "version": self.shard.version,
            "handled": self.handled,
            "losses": self.losses.tolist(),
            "busy": dict(self.busy),
            "pulled": list(self.pulled),
            "exposed": self.exposed,
        }

    async def count(self) -> tuple[int, bool, int]:
        """``(pushes handled, stopping, round under way)``, for an attached client."""
        return self.handled, self.stopped, self.shard.min_clock()

    async def freeze(self) -> list[tuple[int, int]]:
        return self.cutting.freeze(self.shard)

    async def snapshot(
        self, targets: dict[int, tuple[int, int]], log_to: tuple | None = None
    ) -> tuple[dict, int]:
        """Once frozen: ``(Shard.state_dict(), pushes handled)`` after every push below
        ``targets``; ``log_to``: ``(path, fsync)`` of the push log begun at that state."""
        self.cutting.aim(targets)
        self._notify()
        while not self.cutting.reached(self.shard) or (log_to and not self._all_held()):
            if log_to:  # a forward never spans two logs
                await self._held()
            if not self.cutting.reached(self.shard):
                await self._changed()
        if log_to:  # (thawed, given up, too: a chain has no gap)
            self.begin_log(log_to[0], None, log_to[1])
        return self.shard.state_dict(), self.handled

    def _all_held(self) -> bool:
        p = self.primary
        return p is None or not p.backed or p.acked >= p.entries

    async def thaw(self) -> None:
        self.cutting.thaw()
        self._notify()

    async def observe(self) -> tuple[int, Any]:
        """The current slice for an observer (evaluation): ``(version, ObjectRef)``."""
        await self._held()
        if self.pulls is not None:  # delta pulls publish no snapshot: a copy for the observer
            import ray

            return self.shard.version, ray.put(self.shard.params)
        return self._publish(exact=True)

    async def pull(self, w: int, inc: int, pushed: int, have: int = 0, fresh: int = 0) -> tuple:
        """Worker ``w``'s pull once ``Shard.may_serve`` lets it: ``("ok", version, snapshot ref
        or delta payload, pushes handled, w's clock)``, ``("stop",)``, ``("moved", newer inc)``
        or ``("gone",)``; ``fresh``: a version the snapshot must have."""
        await self.opened.wait()
        shard = self.shard
        while (end := self._ended(w, inc)) is None and not shard.may_serve(w, inc, pushed):
            await self._changed()
        if end is not None:
            return end
        await self._held()  # no worker holds a version its backup lacks
        if self.pulls is not None:
            reply = ("ok", *self._delta(w, have), self.handled, int(shard.clocks[w]))
        else:
            version, ref = self._publish(exact=self.exact or self.pub.version < fresh)
            if shard.staleness.dc_lambda or shard.hybrid:
                shard.pull(w, now=time.monotonic())  # DC-ASGD keeps the pull; hybrid times it
            self._served(shard.params.nbytes)
            reply = ("ok", version, ref, self.handled, int(shard.clocks[w]))
        await self._held()  # the pull's own entry
        return reply

    async def follow(self, w: int, inc: int, seen: int, have: int = 0) -> tuple:
        """ASP: :meth:`pull`'s answer (no clock) once a version above ``seen`` is published."""
        await self.opened.wait()
        while True:
            if (end := self._ended(w, inc)) is not None:
                return end
            await self._held()
            if self.shard.admitted[w] == inc:
                if self.pub.version < 0:
                    self._publish(exact=True)
                if self.pub.version > seen:
                    if self.pulls is not None:
                        reply = ("ok", *self._delta(w, have), self.handled)
                        await self._held()  # the pull's own entries
                        return reply
                    self._served(self.shard.params.nbytes)
                    return ("ok", self.pub.version, self.snap, self.handled)
            await self._changed()

    def _ended(self, w: int, inc: int) -> tuple | None:
        """``("stop",)``, ``("moved", inc)`` or ``("gone",)`` if the pull gets no snapshot."""
        if self.stopped:
            return ("stop",)
        dropped = self.shard.dropped(w, inc)
        return None if dropped is None else ("moved", dropped) if dropped else ("gone",)

    async def push(
        self,
        w: int,
        inc: int,
        seq: int,
        bases: tuple,
        verdict: tuple,
        loss: float,
        acked: int,
        update: Any,
    ) -> tuple | None:
        """One push of the whole flat ``update``: ``(Ack, pushes handled)``, None if cut off."""
        await self.opened.wait()  # a restarted actor: until it has its state
        shard = self.shard
        while self.cutting.waits(shard, w, inc, seq):
            await self._changed()
        if shard.admitted[w] != inc:
            return None  # an incarnation that is not (or no longer) connected
        t = time.perf_counter()
        header = PushHeader(w, seq, int(bases[self.k]), inc)
        ack = shard.push(
            header, self._payload(update), verdict=Verdict(*verdict), now=time.monotonic()
        )
        self.busy["push"] += time.perf_counter() - t
        self._count(w, ack, loss)
        if self.several:  # kept until every shard has it, for one that may lack it (depart)
            self.last.keep(w, inc, seq, acked=acked, entry=(tuple(bases), tuple(verdict), update))
        await self._held()  # (its backup holds the entry kept, too)
        if not self.exact:
            self._publish_soon()
        self._notify()
        return ack, self.handled

    def _payload(self, update: Any) -> Any:
        """This shard's slice of ``update`` (anything malformed as is: the shard refuses it)."""
        coded = self.span is not None
        shape, dtype = ((self.push_bytes,), np.uint8) if coded else ((self.size,), self.dtype)
        if not isinstance(update, np.ndarray) or update.shape != shape or update.dtype != dtype:
            return update
        if coded:
            return update[self.span[0] : self.span[1]]
        np.copyto(self.scratch, update[self.lo : self.hi])
        return self.scratch

    def _count(self, w: int, ack: Any, loss: float) -> None:
        if ack.staleness is not None and not ack.duplicate:  # the worker's step counted
            self.handled += 1
            if not math.isnan(loss):
                self.losses[w] = loss

    def _pull_server(self) -> pulls.PullServer | None:
        if self.config.pull_codec is None:
            return None
        return pulls.PullServer.for_shard(self.config, self.k, self.shard)

    def _delta(self, w: int, have: int) -> tuple[int, np.ndarray]:
        """``(version, payload bytes)`` of ``w``'s delta pull against ``have``."""
        t = time.perf_counter()
        pulled = self.pulls.pull(w, have, now=time.monotonic())
        spent = time.perf_counter() - t
        self.busy["pull"] += spent
        self.pull_cost = 0.8 * self.pull_cost + 0.2 * spent
        self._served(len(pulled.payload))
        return pulled.version, np.frombuffer(pulled.payload, np.uint8)

    def _served(self, nbytes: int) -> None:
        self.pulled[0] += int(nbytes)
        self.pulled[1] += 1

    def _publish(self, exact: bool) -> tuple[int, Any]:
        """``(version, ref)`` of the snapshot to serve, published anew when due."""
        import ray

        start, version = time.monotonic(), self.shard.version
        if self.pub.due(version, start, exact=exact) and self._all_held():  # none it lacks
            self.snap = None if self.pulls is not None else ray.put(self.shard.params)
            self.pub.published(version, start=start, end=time.monotonic())
            self.busy["publish"] += self.pub.at - start
        return self.pub.version, self.snap

    def _publish_soon(self) -> None:
        """ASP, after a push: publishes now or schedules it."""
        followers = int(np.count_nonzero(self.shard.admitted)) if self.pulls is not None else 0
        wait = self.pub.wait(self.shard.version, time.monotonic(), self.pull_cost * followers)
        if self.timer is not None or wait is None:
            return
        if wait <= 0:
            self._publish(exact=True)
        else:
            self.timer = asyncio.get_running_loop().call_later(wait, self._deferred)

    def _deferred(self) -> None:
        self.timer = asyncio.ensure_future(self._publish_held())

    async def _publish_held(self) -> None:
        await self._held()
        self.timer = None
        if self.pub.version != self.shard.version:
            self._publish(exact=True)
            self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def _changed(self) -> None:
        await self.changed.wait()


class BackupActor:
    """Shard ``k``'s backup (replicas=2): a :class:`Backup` of its primary, once started."""

    def __init__(self, config: ServerConfig, k: int, workers: int, expected: int | None):
        child_logging(f"shard {k} backup")
        self.config, self.k, self.workers, self.expected = config, k, workers, expected
        self.copy: Backup | None = None
        self.last = delivery.Ledger()  # its primary's, as of the entries held
        self.handled = 0  # the primary's count of pushes, as of the entries held
        self.held: tuple[str, int] = ("", 0)  # the push log and its bytes the state is after

    ready, watch = ShardActor.ready, ShardActor.watch  # version: the state's (-1: none)

    @property
    def shard(self) -> Any:
        return SimpleNamespace(version=-1) if self.copy is None else self.copy.shard

    async def view(self) -> int:
        """The view it follows (-1: none)."""
        return -1 if self.copy is None else self.copy.view

    async def start(
        self, start: CatchUp, handled: int, seats: np.ndarray, held: tuple[str, int], kept: dict
    ) -> None:
        """Starts from the primary's state, ``seats``, log position ``held`` and ledger ``kept``."""
        lo, hi = self.config.ranges[self.k]
        zeros = np.zeros(hi - lo, self.config.init.dtype)
        shard = self.config.build_shard(self.k, zeros, self.workers, self.expected)
        self.copy = Backup(shard, start)
        self.handled, self.held = handled, tuple(held)
        self.last = delivery.Ledger(kept)
        np.copyto(self.copy.shard.admitted, seats[0])
        np.copyto(self.copy.shard.retired, seats[1])

    async def receive(
        self, forward: Forward, handled: int, at: tuple[str, int], changes: list
    ) -> Held | None:
        """:meth:`Backup.receive` (None: not started, or of another view); ``at``: the push
        log's path and bytes before ``forward``'s entries; ``changes``: its ledger's since."""
        held = None if self.copy is None else self.copy.receive(forward)
        if held is not None:
            self.handled = handled
            self.last.replay(changes or ())  # (None: a forward racing a load)
            new = forward.entries[: held.entries - forward.first]
            self.held = (at[0], at[1] + sum(map(len, new)))
        return held

    async def digest(self) -> str | None:
        return None if self.copy is None else digest(self.shard.state_dict())

    async def state(self) -> dict | None:
        """What a restarted primary loads (``_Host._fail_over``), or None: not started."""
        if (b := self.copy) is None:
            return None
        seats = np.stack([b.shard.admitted, b.shard.retired])
        return {"state": b.shard.state_dict(), "handled": self.handled, "entries": b.entries,
                "seats": seats, "held": self.held, "kept": self.last.kept, "view": b.view}  # fmt: skip
