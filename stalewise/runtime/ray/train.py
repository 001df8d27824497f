"""``Job.train`` on Ray: shard and worker actors driven by this process, which kills them all."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.checkpoint.replay import continued
from stalewise.protocol import ServerConfig, budget, delivery, replica
from stalewise.protocol.pipeline import PUBLISH_EVERY
from stalewise.protocol.sender import History
from stalewise.runtime import driver
from stalewise.runtime.errors import ShardError, WorkerError, worker_failed
from stalewise.runtime.options import RunOptions
from stalewise.runtime.ray import cluster, import_ray, liveness
from stalewise.runtime.ray.shard import BackupActor, ShardActor
from stalewise.runtime.ray.worker import WorkerActor
from stalewise.runtime.result import TrainResult, merge_stats
from stalewise.strategies import Strategy

log = logging.getLogger(__name__)

TICK = 0.05  # seconds between two looks at the workers' progress
BACKUP_EVERY = 5.0  # seconds between the driver's copies of the shards' states
SNAPSHOT_LIMIT = 10.0  # seconds the shards may take to reach a consistent cut
GROW_EVERY = 2.0  # seconds between two looks for a free CPU (an elastic run)


class _ShardDown(Exception):
    """A shard's actor died under a call (:meth:`_Host._retrying` restores it)."""


class _Host:
    """One run on Ray, as a :class:`~stalewise.runtime.driver.Host`."""

    runtime, virtual, checkpoint_info = "ray", False, {}

    def __init__(self, config: ServerConfig, strategy: Strategy, options: RunOptions):
        self.ray = import_ray()
        self.config, self.strategy, self.o = config, strategy, options
        self.W, self.S = options.room, config.shards  # W: the worker ids' room
        # an elastic run (workers=(min, max) or "auto") grows with the free CPUs
        self.elastic, self.expected = options.elastic, options.expected
        self.started = list(range(self.W))  # the worker ids the run starts with
        self.retired: set[int] = set()  # ids never used again (dropped, diverged)
        self.where: dict[int, Any] = {}  # worker -> ObjectRef of its actor's node id
        self.left: list[int] = []  # the workers whose node left, in order
        self.spawned = 0  # worker actors started for new ids (elastic growth)
        self.peak = 0  # the most workers live at once
        self.last_grow = -math.inf
        self.coming: dict[Any, tuple[int, float]] = {}  # prepare() ref -> (worker, since)
        self.run: driver.Run | None = None
        self.liveness = liveness.Liveness(options.worker_timeout, options.start_timeout)
        self.incs = [0] * self.W  # each worker's current incarnation
        self.actors: list[Any] = [None] * self.W
        self.runs: dict[Any, int] = {}  # a worker's run() ObjectRef -> worker
        self.watches: dict[Any, int] = {}  # a shard's watch() ObjectRef -> shard
        # a failed worker -> its gone incarnation (None: departed) while a shard was down
        self.unsettled: dict[int, int | None] = {}
        self.live: set[int] = set()  # workers whose loop has not ended
        self.shards: list[Any] = []
        self.backups: list[Any] = []  # replicas=2: each shard's backup actor
        self.bwatches: dict[Any, int] = {}  # a backup's watch() ObjectRef -> shard
        self.replaced = [0] * self.S  # backups caught up anew, per shard
        self.nodes: list[str] = []  # the node id of each shard (as started)
        self.pgs: list = []  # the placement groups: shards, workers
        self.backup: tuple[list, int] | None = None  # (shard states, pushes handled)
        self.targets: dict[int, tuple[int, int]] = {}  # the backup's pushes of each worker
        # each shard's push log chain "log-shard-K-TAG-N", anew at each checkpoint: TAG, N, names
        self.tags = [uuid.uuid4().hex[:8] for _ in range(self.S)]
        self.log_n, self.logs = 0, [""] * self.S  # ("": none)
        # error feedback: each worker's residuals as the driver knows them, and its keeper
        comp = config.compressor()
        self.ef = comp is not None and comp.error_feedback
        self.fb = [History() for _ in range(self.W)]
        self.keepers: list[Any] = [None] * self.W
        self.ended: list[dict] = []  # what each worker loop that ended normally returned
        self.owed: set[int] = set()  # the workers whose loop ended on the budget since the backup
        self.dead: list[int] = []  # the workers that diverged
        self.tick: list[dict] = []  # each shard's counters, as of the last advance()
        self.final: list[dict] = []  # ... and at the end of the run
        self.last_backup = -math.inf
        self.stopping = False
        self.share = 1.0  # CPUs per actor (cpu_share)
        self.config_ref: Any = None  # the ServerConfig in the object store (for the workers)
        # actors are named PREFIX:shard-K and PREFIX:worker-W.INCARNATION
        self.prefix = f"stalewise:{options.run}:{uuid.uuid4().hex[:8]}"
        self.t0: float | None = None

    def _start_shards(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, o = self.ray, self.o
        self.config_ref = ray.put(self.config)  # read by every worker actor
        wait = o.shard_start_timeout
        expected = None
        if self.elastic:  # the shards' bundles; the workers are placed one by one, no group
            self.share = min(1.0, cluster.cpu_share(cluster.node_cpus(), self.expected + self.S))
            self.pgs = [cluster.place(self.S, self.share, wait, "shards", apart=True)]
            expected = 0  # every worker joins (load() admits those the run starts with)
            self.started = list(range(max(self.expected, min(self.W, self._room()))))
        else:  # shards first, one bundle each, spread over the nodes; then the workers
            self.share = cluster.cpu_share(cluster.node_cpus(), self.W + self.S)
            self.pgs = [cluster.place(self.S, self.share, wait, "shards", apart=True)]
            self.pgs.append(cluster.place(self.W, self.share, wait, "workers"))
        restarts = 0 if o.on_worker_failure == "fail" else o.max_restarts
        # without the initial params (load() sends them): Ray replays the creation task
        config = dataclasses.replace(self.config, init=self.config.init[:0])
        actor = ray.remote(ShardActor)
        self.shards = [
            actor.options(
                name=f"{self.prefix}:shard-{k}",
                num_cpus=self.share,
                max_restarts=-1 if restarts is None else restarts,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[0], k),
            ).remote(config, k, self.W, PUBLISH_EVERY, expected)
            for k in range(self.S)
        ]
        info = self._get([s.ready.remote() for s in self.shards], o.shard_start_timeout, "start")
        self.nodes = [i["node"] for i in info]
        if self.config.replicas == 2:  # a backup per shard, on another node if there is one
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as Node

            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            actor, opts = ray.remote(BackupActor), {"num_cpus": 0, "max_restarts": -1}
            for k in range(self.S):  # a hard affinity: Ray drops a soft one on a busy node
                others = [n for n in nodes if n != self.nodes[k]] or [self.nodes[k]]
                place = Node(others[k % len(others)], soft=False)
                named = actor.options(
                    name=f"{self.prefix}:backup-{k}", scheduling_strategy=place, **opts
                )
                self.backups.append(named.remote(config, k, self.W, expected))
            self._get([b.ready.remote() for b in self.backups], wait, "start")

    def _room(self) -> int:  # workers the free CPUs hold
        return math.floor(float(self.ray.available_resources().get("CPU", 0.0)) / self.share + 1e-9)

    def _open_shards(self, run: driver.Run) -> None:
        states: list = [None] * self.S
        base = run.pushes_at_start
        if run.resume is not None:
            states = run.resume.states
            for w in range(self.W):  # new incarnations, above those in the checkpoint
                self.incs[w] = max(int(np.asarray(s["incarnation"])[w]) for s in states)
        for w, n in enumerate(run.drawn):
            self.liveness.heard(w, n)  # each worker id's stream goes on where it stopped
        joins = {w: self.incs[w] + 1 for w in self.started}
        for w, inc in joins.items():
            self.incs[w] = inc
        if self.ef:  # each worker id continues with its saved residual (zeros: none saved)
            assert run.feedback is not None
            for w, f in enumerate(run.feedback):
                self.fb[w].keep(self.incs[w], 0, f.residual, acked=0)
        init = [self.config.init[lo:hi] for lo, hi in self.config.ranges]
        refs = [
            s.load.remote(states[k], base, joins, [], init[k], True, self._backup(k))
            for k, s in enumerate(self.shards)
        ]
        self._get(refs, self.o.shard_start_timeout, "load")
        self._take_backup()

    def _spawn(self, w: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # progress() has a thread of its own, so it answers beside a busy run()
        actor = self.ray.remote(concurrency_groups={liveness.GROUP: 1})(WorkerActor)
        # an elastic run's workers go where Ray finds a CPU (spread), each on its own
        place: Any = "SPREAD"
        if not self.elastic:
            place = PlacementGroupSchedulingStrategy(self.pgs[1], w)
        remote = actor.options(
            name=f"{self.prefix}:worker-{w}.{self.incs[w]}",
            num_cpus=self.share,
            max_restarts=0,
            scheduling_strategy=place,
        )
        residual = self.fb[w].latest()  # None: it starts with zeros
        if self.ef and self.keepers[w] is None:  # one per worker id, in the worker's bundle
            keeper = self.ray.remote(History).options(
                name=f"{self.prefix}:keeper-{w}",
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy="DEFAULT" if self.elastic else place,
            )
            self.keepers[w] = keeper.remote()
        self.actors[w] = remote.remote(
            self.config_ref,
            self.strategy,
            self.o.for_workers(),
            w,
            self.incs[w],
            self.shards,
            residual,
            self.keepers[w],
            self.liveness.drawn.get(w, 0),  # its new stream skips what its id has drawn
        )
        if residual is not None:
            self.fb[w].keep(self.incs[w], 0, residual, acked=0)
        self.where[w] = self.actors[w].where.options(concurrency_group=liveness.GROUP).remote()
        return self.actors[w]

    def _start_workers(self) -> None:
        ray = self.ray
        refs = {self._spawn(w).prepare.remote(): w for w in self.started}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=self.o.start_timeout)
        extra = sorted(refs[r] for r in pending if refs[r] >= self.expected)
        if extra:  # an elastic run's workers beyond the expected: they may come later
            log.info(
                "ray: workers %s found no room within start_timeout; their ids are free", extra
            )
            for w in extra:
                self.ray.kill(self.actors[w], no_restart=True)
                self._get([s.leave.remote(w, self.incs[w]) for s in self.shards], None, "leave")
            self.started = [w for w in self.started if w not in extra]
            pending = [r for r in pending if refs[r] not in extra]
        if pending:
            late = sorted(refs[r] for r in pending)
            raise WorkerError(
                f"worker(s) {', '.join(map(str, late))} did not start within "
                f"{self.o.start_timeout} s (start_timeout)"
            )
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                raise worker_failed(refs[ref], str(e)) from None

    def start(self, run: driver.Run) -> None:
        self.run = run
        try:
            self._start_shards()
            self._open_shards(run)
            self._start_workers()
        except _ShardDown as e:  # before the restart path is in place
            raise ShardError(f"{e} while the run was starting") from None

    def go(self) -> None:
        self.t0 = time.perf_counter()
        self.runs = {self.actors[w].run.remote(): w for w in self.started}
        for w in self.started:
            self.liveness.watch(w, self.actors[w], ready=True)
        self.live = set(self.started)
        self.peak = len(self.live)
        if self.elastic:
            log.info(
                "ray: elastic run: %d worker(s) to start with, room for %d, %g CPU each",
                len(self.live),
                self.W,
                self.share,
            )
        self.watches = {s.watch.remote(): k for k, s in enumerate(self.shards)}
        self.bwatches = {b.watch.remote(): k for k, b in enumerate(self.backups)}

    def _backup(self, k: int) -> Any:
        return self.backups[k] if self.backups else None

    def advance(self, until: float, due: Any) -> str:
        """A backup when due, then up to one tick's wait for what ends."""
        ray = self.ray
        if self.tick and self.now() - self.last_backup >= BACKUP_EVERY:
            now = self.now()
            if self._retrying(self._take_backup):
                self.last_backup = now
        refs = [*self.runs, *self.watches, *self.bwatches]
        wait = driver.wait_for(until, self.now(), TICK)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
        for ref in sorted(done, key=lambda r: (r not in self.watches, r not in self.bwatches)):
            if ref in self.watches:  # shards first: the failure policy, then all roll back
                event = self._revive(ref)
                if event is not None and not self._fail_over(event):
                    self._restore([event])
            elif ref in self.bwatches:
                self._backup_ended(ref)
            elif ref in self.runs:
                self._worker_ended(ref)
        for w, cause in self.liveness.check():  # stood still, or not set up in time
            self.liveness.forget(w)
            for ref in [r for r, v in self.runs.items() if v == w]:
                del self.runs[ref]
            self._worker_failed(w, cause)
        if self.unsettled:
            self._retrying(self._settle)
        if self.owed and not self.live:  # the end: a backup holds every push
            self._retrying(self._take_backup)
        if self.coming:
            self._arrive()
        if self.elastic and self.live and self.now() - self.last_grow >= GROW_EVERY:
            self.last_grow = self.now()
            self._grow()
        self.tick = self._stats()
        return driver.TICK if self.live or self.owed else driver.END

    def _grow(self) -> None:
        """An elastic run: prepares a worker on a free id for each free CPU (:meth:`_arrive`)."""
        if self.stopping or self.ended or self.coming:
            return
        free = [w for w in range(self.W) if w not in self.live and w not in self.retired]
        for w in free[: self._room()]:
            self.incs[w] += 1
            self.coming[self._spawn(w).prepare.remote()] = (w, time.monotonic())

    def _arrive(self) -> None:
        """Workers :meth:`_grow` started join once set up; one failed or late is killed."""
        ray = self.ray
        refs = list(self.coming)
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for ref in refs:
            w, since = self.coming[ref]
            late = time.monotonic() - since > self.o.start_timeout
            if ref not in done and not late:
                continue
            del self.coming[ref]
            try:
                if ref not in done:
                    raise TimeoutError(
                        f"not set up within start_timeout={self.o.start_timeout:g} s"
                    )
                ray.get(ref)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning("ray: a new worker %d did not start (%s); its id stays free", w, e)
                ray.kill(self.actors[w], no_restart=True)
                continue
            if self.stopping or self.ended:  # the run is ending: it is not needed
                ray.kill(self.actors[w], no_restart=True)
                continue
            self._retrying(lambda w=w: self._join(w))
            self.runs[self.actors[w].run.remote()] = w
            self.liveness.watch(w, self.actors[w], ready=True)
            self.live.add(w)
            self.spawned += 1
            log.info("ray: worker %d joined (incarnation %d): a CPU was free", w, self.incs[w])
        self.peak = max(self.peak, len(self.live))

    def now(self) -> float:
        return 0.0 if self.t0 is None else time.perf_counter() - self.t0

    def pushes(self) -> int:
        return (self.tick or self._stats())[0]["handled"]

    def stats(self, *, settled: bool = False) -> dict:
        if not settled:
            return merge_stats(self.tick) | {"workers": len(self.live)}
        self.final = self._stats()
        # every worker has taken its acks
        return merge_stats(self.final, settled=True) | {"workers": len(self.live)}

    def losses(self) -> Any:
        return self.tick[0]["losses"]

    def params(self) -> Any:
        return tree.unflatten(self._flat(), self.config.spec)

    def stop(self) -> bool:
        self.stopping = True
        self._retrying(lambda: self._each("stop"))
        return False

    def snapshot(self, now: float, *, failure: bool = False) -> driver.Snapshot | None:
        if failure:  # no consistent cut is attempted while a failure stops the run
            return None
        snap = self._retrying(lambda: self._snapshot(now))
        if snap is not None:  # it took a backup too
            self.last_backup = now
        return snap

    def budget_spent(self) -> bool:
        return bool(self.ended)

    def diverged(self) -> list[int]:
        return self.dead

    def finish(self, stats: dict) -> np.ndarray:
        per_shard = self.final
        mine = self._retrying(lambda: self._each("digest")) if self.backups else []
        theirs = self.ray.get([b.digest.remote() for b in self.backups], timeout=self.o.ack_timeout)
        pairs = zip(mine, theirs, strict=True)  # replicas=2: each backup and its primary
        steps = max(sum(e["steps"] for e in self.ended), 1)
        stats["ray"] = {  # seconds per worker step, over the loops that ended normally
            key: sum(e["times"][key] for e in self.ended) / steps
            for key in ("pull", "push", "acks", "compute", "send")
        } | {
            "nodes": list(self.nodes),
            "cpus_per_actor": self.share,
            # seconds each shard spent handling pushes and publishing, per push handled
            "shard_push": [s["busy"]["push"] / max(s["handled"], 1) for s in per_shard],
            "shard_publish": [s["busy"]["publish"] / max(s["handled"], 1) for s in per_shard],
            # the mean bytes of one pull of every shard (a delta pull's payload, or the slice)
            "pull_bytes": sum(s["pulled"][0] / max(s["pulled"][1], 1) for s in per_shard),
            "pulls": [s["pulled"][1] for s in per_shard],
            "applied": [s["applied"] for s in per_shard],  # per shard
            "acked": sum(e["outcomes"].get("applied", 0) for e in self.ended),  # by the workers
            "backups": ["equal" if a == b else "differs" for a, b in pairs],
            "backups_replaced": list(self.replaced),
            "workers": {
                "started": len(self.started),
                "peak": self.peak,
                "joined": self.spawned,
                "left": list(self.left),
            },
        }
        return self._flat()

    def close(self) -> None:
        ray = self.ray
        for a in (*self.actors, *self.shards, *self.backups, *self.keepers):
            if a is not None:
                ray.kill(a, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs:
            remove_placement_group(pg)

    def _worker_ended(self, ref: Any) -> None:
        ray = self.ray
        w = self.runs.pop(ref)
        self.liveness.forget(w)
        try:
            ended = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            try:  # it lives on after raising: the batches it drew, the one that raised too
                _, _, drawn = ray.get(
                    self.actors[w].progress.options(concurrency_group=liveness.GROUP).remote(),
                    timeout=1.0,
                )
                self.liveness.heard(w, drawn)
            except (ray.exceptions.RayError, TimeoutError):  # else the last count heard
                log.debug("ray: worker %d did not say how many batches it drew", w)
            self._worker_failed(w, f"raised {type(cause).__name__}: {cause}", str(e))
        except ray.exceptions.RayError as e:
            if self._node_left(w, e):  # a departure, not a failure
                self._depart(w)
                self.live.discard(w)
                self.left.append(w)
                self.run.failures.left(w, "its node left the cluster", time=self.now())
            else:
                self._worker_failed(w, f"its actor died ({type(e).__name__})")
        else:
            self.live.discard(w)
            self.liveness.heard(w, ended["drawn"])
            if self.ef:  # its residual after its last push, all of them acknowledged
                inc, pushed, residual = ended["feedback"]
                self.fb[w].keep(inc, pushed, residual, acked=pushed)
            if "diverged" in ended:  # it left; it is not restarted
                self.dead.append(w)
                self.retired.add(w)
                self.run.failures.diverged(w, ended["diverged"], time=self.now())
            else:
                self.ended.append(ended)
                if not self.stopping and ended["feedback"][0] < self.incs[w]:
                    self._respawn(w)  # its loop ended unseen by a rollback
                elif not self.stopping:
                    self.owed.add(w)

    def _node_left(self, w: int, error: Exception) -> bool:
        """An elastic run: whether worker ``w`` died (``error``) because its node left."""
        ray = self.ray
        if not self.elastic:
            return False
        named = re.search(r"node has died\. Node Id: ([0-9a-f]+)", str(error))
        node = named.group(1) if named else None
        if node is None and w in self.where:
            try:
                node = ray.get(self.where[w], timeout=1.0)
            except (ray.exceptions.RayError, TimeoutError):
                return False  # it died before it said where it runs: a failure
        if node is None:
            return False
        deadline = time.monotonic() + 5.0  # Ray may report the actor before the node
        while True:
            if not {n["NodeID"]: n["Alive"] for n in ray.nodes()}.get(node, False):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(TICK * 4)

    def _worker_failed(self, w: int, cause: str, detail: str = "") -> None:
        """The commit rule for worker ``w``, then the failure policy (restart, drop, raise)."""
        self.ray.kill(self.actors[w], no_restart=True)  # it may live on after raising
        self._depart(w)
        action = self.run.failures.worker(w, cause, time=self.now(), detail=detail)
        if action == "drop" or self.stopping:
            self.live.discard(w)
            if action == "drop":
                self.retired.add(w)
            return
        self.incs[w] += 1
        self.unsettled.setdefault(w, None)
        with contextlib.suppress(_ShardDown):  # after the failover (or a restore admits it)
            self._settle()

    def _join(self, w: int) -> None:
        self._get([s.join.remote(w, self.incs[w]) for s in self.shards], self.o.ack_timeout, "join")

    def _settle(self) -> None:
        """Failed workers': the commit rule for the gone incarnation, then (still live) the next
        joins (a join made twice is made once) and starts; _ShardDown: the rest later."""
        for w, gone in list(self.unsettled.items()):
            if gone is not None:
                self._commit(w, gone)
                self.unsettled[w] = None
            if w in self.live:
                self._join(w)
                self._respawn(w)
            del self.unsettled[w]

    def _respawn(self, w: int) -> None:
        """A new actor for worker ``w``'s admitted incarnation, in place of its old one."""
        self.ray.kill(self.actors[w], no_restart=True)
        self.runs[self._spawn(w).run.remote()] = w
        self.liveness.watch(w, self.actors[w], ready=False)  # it sets up inside run()
        self.live.add(w)

    def _depart(self, w: int) -> None:
        """The commit rule for worker ``w``'s gone incarnation; its residual kept for its next."""
        counts: list = []
        try:
            counts = self._commit(w, self.incs[w])
        except _ShardDown:  # after its failover (or a restore rolls back)
            log.warning("ray: worker %d's commit rule waits for a shard to come back", w)
            self.unsettled[w] = self.incs[w]
        if not self.ef:
            return
        pushes = delivery.committed(counts)
        residual = self._residual(w, self.incs[w], pushes)
        if residual is None:
            log.warning("ray: worker %d's error-feedback residual is lost; its next incarnation "
                        "starts with none", w)  # fmt: skip
            self.fb[w].clear()
        else:
            self.fb[w].keep(self.incs[w], pushes, residual, acked=pushes)

    def _commit(self, w: int, inc: int) -> list:
        """The commit rule for ``w``'s gone incarnation ``inc``: each shard's count after."""
        t = self.o.ack_timeout
        with self._shard_calls("depart", f"the shards did not cut {w} within {t} s"):
            refs = cluster.depart(self.shards, w, inc, t, lambda r: self._get(r, t, "cut", False))
        return self._get(refs, t, "depart")

    def _residual(self, w: int, inc: int, pushes: int | None) -> np.ndarray | None:
        """Worker ``w``'s residual after ``pushes`` of incarnation ``inc`` (None: unknown)."""
        residual = self.fb[w].at(inc, pushes)
        if residual is None and pushes and self.keepers[w] is not None:
            ray = self.ray
            try:
                got = self.keepers[w].at.remote(inc, pushes)
                residual = ray.get(got, timeout=self.o.ack_timeout)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning("ray: worker %d's residual keeper did not answer: %s", w, e)
        return residual

    def _fail_over(self, event: dict) -> bool:
        """replicas=2: shard ``event["shard"]``'s restarted actor takes its backup's state, the
        workers keeping their incarnations (False: no backup holds all it let out; roll back)."""
        ray, k = self.ray, event["shard"]
        if not self.backups:
            return False
        try:
            got = ray.get(self.backups[k].state.remote(), timeout=self.o.ack_timeout)
            if got is None:
                raise RuntimeError("its backup was not caught up")
            seen = self.tick[k].get("exposed") if self.tick else None
            if why := replica.stale(seen, got["view"], got["state"]["version"], got["handled"]):
                raise RuntimeError(f"its backup is stale: {why}")
            log_at = None  # its push log: its chain's newest, cut where the backup's state is
            if self.logs[k]:
                newest = os.path.join(self.o.checkpoint_dir, self.logs[k])
                if (at := continued(newest, *got["held"])) is None:
                    self.tags[k], self.logs[k] = uuid.uuid4().hex[:8], ""  # a new chain
                else:
                    log_at = (newest, at, self.o.checkpoint_fsync)
            load = self.shards[k].load.remote(got["state"], got["handled"], {}, [],
                backup=self.backups[k], seats=got["seats"], log_at=log_at,
                ledger=got["kept"])  # fmt: skip
            version = self._get([load], self.o.shard_start_timeout, "restore")[0]
            if self.stopping:  # a restarted shard has forgotten the stop
                self._get([self.shards[k].stop.remote()], self.o.ack_timeout, "stop")
        except (ray.exceptions.RayError, RuntimeError, _ShardDown) as e:
            log.warning("ray: shard %d has no backup to come back from (%s)", k, e)
            return False
        at = (version, got["entries"])
        log.warning("ray: shard %d is back from its backup (version %d, entry %d)", k, *at)
        self.run.failures.shard_restarted(event, version=version, lost=0, source="backup")
        return True

    def _next_logs(self) -> list[tuple[str, bool]]:
        """Each shard's next push log ``(path, fsync)``: its chain's next (N taken)."""
        self.log_n += 1
        self.logs = [f"log-shard-{k}-{t}-{self.log_n:06d}" for k, t in enumerate(self.tags)]
        folder = self.o.checkpoint_dir
        with contextlib.suppress(OSError):  # else each shard says why it writes none
            os.makedirs(folder, 0o755, exist_ok=True)
        return [(os.path.join(folder, n), self.o.checkpoint_fsync) for n in self.logs]

    def _backup_ended(self, ref: Any) -> None:
        """Shard ``k``'s backup died: once Ray restarted it, its primary catches it up."""
        k = self.bwatches.pop(ref)
        log.warning("ray: shard %d's backup died; a new one catches up from its primary", k)
        try:
            self._ready(self.backups[k], f"shard {k}'s backup")
        except ShardError as e:  # e.g. its node left: the primary serves alone
            log.warning("ray: %s; shard %d serves alone", e, k)
            return
        call = lambda: [self.shards[k].attach.remote(self.backups[k])]  # noqa: E731
        self._retrying(lambda: self._get(call(), self.o.ack_timeout, "attach"))
        self.replaced[k] += 1
        self.bwatches[self.backups[k].watch.remote()] = k

    def _revive(self, ref: Any) -> dict | None:
        """Failure policy for the shard whose watch ``ref`` ended; its event (None: the end)."""
        ray = self.ray
        k = self.watches.pop(ref)
        try:
            ray.get(ref)
            return None  # the job is ending
        except ray.exceptions.RayError as e:
            cause = f"its actor died ({type(e).__name__})"
        now = self.now()
        self.run.failures.shard(k, cause, time=now)  # ShardError unless it is to be restarted
        event = self.run.failures.events[-1]
        self._ready(self.shards[k], f"shard {k}")
        self.watches[self.shards[k].watch.remote()] = k
        return event

    def _ready(self, actor: Any, who: str) -> None:
        """Waits until Ray has restarted ``actor`` (ShardError after shard_start_timeout)."""
        ray, limit = self.ray, self.o.shard_start_timeout
        deadline = time.monotonic() + limit
        while True:  # calls fail while it is restarting
            try:
                ray.get(actor.ready.remote(), timeout=limit)
                return
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise ShardError(
                        f"{who} did not come back within {limit} s (shard_start_timeout)"
                    ) from None
                time.sleep(TICK)
            except ray.exceptions.RayError as e:
                raise ShardError(f"{who} did not come back ({type(e).__name__}: {e})") from None

    def _await_down(self, down: _ShardDown) -> list[dict]:
        """After a failed shard call: revives each shard whose watch ended; their failure events."""
        ray = self.ray
        if not self.watches:
            raise ShardError(f"{down} while the run was starting or ending") from None
        limit = self.o.shard_start_timeout
        done, _ = ray.wait(list(self.watches), num_returns=1, timeout=limit)
        if not done:
            raise ShardError(
                f"{down}, and no shard's actor ended within {limit} s (shard_start_timeout)"
            ) from None
        refs = list(self.watches)
        events = [self._revive(ref) for ref in ray.wait(refs, num_returns=len(refs), timeout=0)[0]]
        return [e for e in events if e is not None]

    def _retrying(self, call: Any) -> Any:
        """``call()``, made again after each shard failure it met (once restored)."""
        while True:
            try:
                return call()
            except _ShardDown as down:
                events = self._await_down(down)
                rest = [e for e in events if not self._fail_over(e)]
                if rest or not events:
                    self._restore(rest)

    def _restore(self, events: list[dict]) -> int:
        """Rolls every shard back to the newest backup after ``events``; returns the version."""
        assert self.backup is not None
        states, handled = self.backup
        owed, self.owed = set() if self.stopping else self.owed, set()
        owed |= {w for w in self.unsettled if w in self.live}  # it joins anew
        self.unsettled = {}
        while True:
            joins = {}
            for w in budget.after_rollback(self.live, owed):
                self.incs[w] += 1
                joins[w] = self.incs[w]
                self.fb[w].clear()  # it keeps its own residual, unknown here until it pushes
            gone = [w for w in range(self.W) if w not in joins]
            refs = [
                s.load.remote(states[k], handled, joins, gone, backup=self._backup(k))
                for k, s in enumerate(self.shards)
            ]
            self.tags = [uuid.uuid4().hex[:8] for _ in range(self.S)]  # the logs end: new chains
            self.logs = [""] * self.S
            try:
                versions = self._get(refs, self.o.shard_start_timeout, "restore")
                if self.stopping:  # a restarted shard has forgotten the stop
                    self._each("stop")
                break
            except _ShardDown as down:
                events += self._await_down(down)
        for w in sorted(owed):
            self._respawn(w)
        log.warning(
            "ray: the shards were rolled back to version %d (%d pushes); workers %s carry on "
            "as new incarnations",
            versions[0],
            handled,
            sorted(joins),
        )
        for event in events:  # the backup's version: how many updates were lost is unknown
            self.run.failures.shard_restarted(event, version=versions[0])
        return versions[0]

    @contextlib.contextmanager
    def _shard_calls(self, what: str, late: str) -> Iterator[None]:
        """Ray's errors from shard calls as ``TimeoutError(late)``, or :class:`_ShardDown`."""
        ray = self.ray
        try:
            yield
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(late) from None
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
            raise _ShardDown(f"{self._who(e)} did not answer {what} ({type(e).__name__})") from None
        refs = list(self.watches)
        if refs and ray.wait(refs, num_returns=len(refs), timeout=0)[0]:
            raise _ShardDown(f"a shard's actor died during {what}")

    def _who(self, e: Exception) -> str:
        ids = [getattr(s, "_actor_id", None) for s in self.shards]  # Ray's handle (or absent)
        k = [k for k, i in enumerate(ids) if i is not None and getattr(e, "actor_id", 0) == i.hex()]
        return f"shard {k[0]}" if k else "a shard"

    def _get(self, refs: list, timeout: float | None, what: str, fetch: bool = True) -> list:
        """Shard calls ``refs``' answers (``fetch``: else None); _ShardDown once a shard's actor ended."""
        ray, n = self.ray, len(refs)
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        with self._shard_calls(what, f"the shards did not answer {what} within {timeout} s"):
            while n and len(ray.wait(refs, num_returns=n, timeout=TICK, fetch_local=False)[0]) < n:
                if self.watches and ray.wait(list(self.watches), timeout=0)[0]:
                    raise _ShardDown(f"a shard's actor died during {what}")
                if time.monotonic() > deadline:
                    raise ray.exceptions.GetTimeoutError()
            return ray.get(refs) if fetch else None

    def _each(self, method: str, what: str | None = None) -> list:
        refs = [getattr(s, method).remote() for s in self.shards]
        return self._get(refs, self.o.ack_timeout, what or method)

    def _stats(self) -> list[dict]:
        return self._retrying(lambda: self._each("stats"))

    def _flat(self) -> np.ndarray:
        return self._retrying(self._observe)

    def _observe(self) -> np.ndarray:
        replies = self._each("observe", "pull")
        # each slice is an object its shard owns: lost with the shard (ObjectLostError)
        slices = self._get([r[1] for r in replies], self.o.ack_timeout, "pull")
        return np.concatenate(slices) if len(slices) > 1 else np.array(slices[0])

    def _take_backup(self, logs: bool = False) -> bool:
        """A consistent copy of the shards into ``self.backup`` (False: none this time)."""
        logs = logs and self.o.checkpoint_dir is not None
        with self._shard_calls("state", f"the shards did not freeze within {self.o.ack_timeout} s"):
            got = cluster.consistent_states(self.shards, list(self.runs), self.o.ack_timeout,
                                            SNAPSHOT_LIMIT, self._next_logs if logs else None)  # fmt: skip
        if got is not None:
            self.backup, self.targets = got[:2], got[2]
            self.owed.clear()
        return got is not None

    def _snapshot(self, now: float) -> driver.Snapshot | None:
        """A backup and the workers' residuals at it (None: none this time)."""
        if not self._take_backup(logs=True):
            return None
        assert self.backup is not None
        residuals = self._residuals() if self.ef else None
        if self.ef and residuals is None:
            return None
        drawn = [self.liveness.drawn.get(w, 0) for w in range(self.W)]
        step = {"pushes": self.backup[1], "time": now, "drawn": drawn}
        if self.o.checkpoint_dir is not None:  # begun at this cut
            step["logs"] = list(self.logs)
        return driver.Snapshot(self.backup[0], step, residuals)

    def _residuals(self) -> list[np.ndarray] | None:
        """Each worker's residual at the backup's cut (None: one is not known yet)."""
        out = [self._residual(w, *self.targets[w]) for w in range(self.W)]
        for w, residual in enumerate(out):
            if residual is None:  # e.g. a worker carrying on after a restore, before it pushed
                log.info("ray: checkpoint deferred: worker %d's residual is not known yet", w)
                return None
        return out


def run(config: ServerConfig, strategy: Strategy, options: RunOptions) -> TrainResult:
    """Trains on Ray (the ``"ray"`` runtime), connecting for the run if needed."""
    from stalewise.runtime.ray import connect

    ray = import_ray()
    started = connect()
    try:
        return driver.drive(_Host(config, strategy, options), config, strategy, options)
    finally:
        if started:
            ray.shutdown()
